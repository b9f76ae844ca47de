"""How long does the stop button take to end a hung 2-worker launch, with and without asking the
ranks where they are first?

The job hangs as the classic desync does: rank 1 sleeps in ``wait_for_the_moon`` while rank 0
waits for it in an ``all_reduce``. Once rank 0 is about to enter the all-reduce (it says so by
creating a file), a thread here waits a little longer, then sends this process SIGINT, as
Jupyter's stop button sends the kernel: ``notebook_launcher`` asks every rank for its stacks
(``stacks.collect``), stops the workers, waits for them to exit and raises KeyboardInterrupt. We
time the signal to the KeyboardInterrupt, and separately the asking alone (``Attempt._where``).
"without" replaces the asking by nothing, to pair each measure with the launcher as it was.

Variants alternate round by round, the first one rotating; medians with min and max.

    python benchmarks/interrupt.py [--rounds 10] [--out benchmarks/results/interrupt-cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch

import nbaccel
from nbaccel import notebook_launcher
from nbaccel.launch import supervisor
from nbaccel.observe.hang import report

SETTLE = 0.3  # seconds after rank 0's file, so that it is inside the all-reduce


def wait_for_the_moon() -> None:
    time.sleep(600)


def hang(ready: str) -> None:
    import torch.distributed as dist

    state = nbaccel.PartialState()
    if state.process_index == 1:
        wait_for_the_moon()
    open(ready, "w").close()
    dist.all_reduce(torch.ones(1))


def one_stop(asking: bool) -> dict:
    """One hung launch, stopped by SIGINT: seconds to the KeyboardInterrupt, and to ask."""
    asked: list[float] = []
    where = supervisor.Attempt._where

    def timed_where(self):
        started = time.perf_counter()
        found = where(self) if asking else report({}, [])
        asked.append(time.perf_counter() - started)
        return found

    with tempfile.TemporaryDirectory() as folder:
        ready = os.path.join(folder, "ready")
        sent: list[float] = []

        def stop() -> None:
            while not os.path.exists(ready):
                time.sleep(0.01)
            time.sleep(SETTLE)
            sent.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGINT)

        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        with mock.patch.object(supervisor.Attempt, "_where", timed_where):
            try:
                notebook_launcher(hang, args=(ready,), num_processes=2, live=False, timeout=120)
            except KeyboardInterrupt:
                stopped = time.perf_counter()
            else:
                raise RuntimeError("the hung launch returned")
        stopper.join()
    return {"stop_s": stopped - sent[0], "ask_s": asked[0]}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    one_stop(True)  # warm-up: the fork server starts
    variants = {"with stacks": True, "without": False}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(args.rounds):
        for name in names[i % 2 :] + names[: i % 2]:
            runs[name].append(one_stop(variants[name]))
        print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    results = {
        name: {k: summary([r[k] for r in rows]) for k in ("stop_s", "ask_s")}
        for name, rows in runs.items()
    }
    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nbaccel": nbaccel.__version__,
        "cores": len(os.sched_getaffinity(0)),
        "rounds": args.rounds,
        "load": os.getloadavg()[0],
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(table(results, meta))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=1))
        args.out.with_suffix(".md").write_text(table(results, meta) + "\n")


def table(results: dict, meta: dict) -> str:
    lines = [
        "# The stop button on a hung 2-worker launch, with and without asking where ranks are",
        "",
        f"Python {meta['python']}, torch {meta['torch']}, nbaccel {meta['nbaccel']}, "
        f"{meta['cores']} cores, 1-min load {meta['load']:.1f}; {meta['rounds']} rounds; "
        f"{meta['when']}. Seconds, median (min-max).",
        "",
        "| variant | SIGINT -> KeyboardInterrupt | asking the ranks |",
        "|---|---:|---:|",
    ]
    for name, r in results.items():
        cells = [f"{r[k]['median']:.3f} ({r[k]['min']:.3f}-{r[k]['max']:.3f})" for k in r]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
