"""How long does the stop button take while a first launch's fork server still imports torch?

A fresh process (a script: nothing is started ahead, as in a kernel with ``NBACCEL_PRESTART=0``)
imports torch and nbaccel, calls a trivial 2-worker ``notebook_launcher``, and is sent SIGINT
(Jupyter's stop button sends the kernel the same) ``--after`` seconds into the call, while its
server still imports torch. We time the signal to the KeyboardInterrupt.

"now": the launcher as it is (the server gets ``supervisor.STOP_GRACE_SECONDS`` to read its
socket's end, then SIGKILL). "before": the same launcher with the 10 s grace it had before, when
the stop waited for the server to finish its imports. One core is kept busy throughout, as on a
learner's laptop or a shared Binder (issue 65 measured about 6 s there). Variants alternate round
by round, the first one rotating; medians with min and max.

    python benchmarks/stop_at_start.py [--rounds 8] [--after 0.8] \
        [--out benchmarks/results/stop-at-start-cpu.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.launch import machine, machine_line, summary, write  # noqa: E402  (shared)

ONE = """
import os, signal, sys, threading, time, torch
from nbaccel import notebook_launcher
from nbaccel.launch import supervisor
if {before}:
    supervisor.STOP_GRACE_SECONDS = 10.0  # the grace the stop had before issue 65
sent = []
def press():
    sent.append(time.perf_counter())
    os.kill(os.getpid(), signal.SIGINT)
threading.Timer({after}, press).start()
try:
    notebook_launcher(lambda: 1, num_processes=2, cpu=True, live=False)
    print("finished before the stop")
except KeyboardInterrupt:
    print(time.perf_counter() - sent[0])
"""


def one(variant: str, after: float) -> float | None:
    code = ONE.format(before=variant == "before", after=after)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    last = (out.stdout.strip().splitlines() or [""])[-1]
    try:
        return float(last)
    except ValueError:  # the launch ended before the press: nothing to time
        print(f"{variant}: {last or out.stderr[-300:]}", file=sys.stderr)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--after", type=float, default=0.8)
    default = Path("benchmarks/results/stop-at-start-cpu.json")
    parser.add_argument("--out", type=Path, default=default)
    args = parser.parse_args()
    start_load = os.getloadavg()[0]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    variants = ["now", "before"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for r in range(args.rounds):
            for variant in variants[r % 2 :] + variants[: r % 2]:
                seconds = one(variant, args.after)
                if seconds is not None:
                    times[variant].append(seconds)
                print(f"round {r + 1}: {variant}: {seconds}", file=sys.stderr, flush=True)
    finally:
        busy.kill()
        busy.wait()
    results = {
        "machine": machine(args.rounds, start_load),
        "rounds": args.rounds,
        "after_s": args.after,
        "one_core_busy": True,
        "variants": {v: {**summary(ts), "all": ts} for v, ts in times.items()},
    }
    m = results["machine"]
    lines = [
        "# The stop button while the first launch's server imports torch, on CPU",
        "",
        f"{machine_line(m)}; {args.rounds} rounds, one core kept busy, SIGINT {args.after:g} s "
        "into the call.",
        "",
        "| launcher | signal to KeyboardInterrupt, s: median (min-max) | timed rounds |",
        "|---|---:|---:|",
    ]
    for v, r in results["variants"].items():
        if r["all"]:
            lines.append(
                f"| {v} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | {len(r['all'])} |"
            )
    write(args.out, results, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
