"""When a rank or a node dies on a 2-node SLURM launch: how long until the cell ends, and whom it
names. "now" (this tree) against "before" (the launch as it was before issue 61, from a git
worktree of ``--before``), on the same test cluster, variants alternating round by round.

Scenarios (each a fresh Python process that calls ``notebook_launcher`` as a cell would):

- ``late error``: rank 1 raises after ``end_training()`` while rank 0 returns (rank 0's agent
  then waits in torch's exit barrier): from rank 1's error file to the call's end.
- ``rank SIGKILLed``: rank 1's process on n2 gets SIGKILL mid-run: from the kill to the end.
- ``node dead``: n2's slurmd, its step's slurmstepd and its ranks get SIGKILL: from the kill to
  the end, and from SLURM marking n2 not responding (``*``) to the end (negative: the cell
  ended before SLURM knew).
- ``stop, node dead``: the same kill, then SIGINT (the stop button) one second later: from the
  SIGINT to the end.

The cluster is ``tests/slurm/cluster.py``'s (KillWait=5, SlurmdTimeout=20; a real cluster's
defaults are 30 and 300, which lengthen "before" more than "now"). Needs root and SLURM.

    python benchmarks/cluster_deaths.py [--rounds 3] [--before d222e68] [--scenarios ...] \
        [--out benchmarks/results/cluster-deaths-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.launch import machine, machine_line, summary, write  # noqa: E402  (shared)
from tests.slurm import cluster as test_cluster  # noqa: E402

ONE = """
import json, os, signal, sys, time
from nbaccel import SlurmCluster, notebook_launcher
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell's ignores it

def steps():
    import os, time, torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("pid", os.getpid(), "on", os.environ["SLURMD_NODENAME"], flush=True)
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)

def late():
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails after end_training()")
    return 0

function = {"late error": late}.get(sys.argv[1], steps)
said = ""
try:
    notebook_launcher(function, num_nodes=2, cluster=SlurmCluster(time=10, folder=sys.argv[2]))
except BaseException as error:
    said = str(error).splitlines()[0] if str(error) else type(error).__name__
print("RESULT", json.dumps({"ended": time.time(), "said": said[:160]}), flush=True)
"""

SCENARIOS = ("late error", "rank SIGKILLed", "node dead", "stop, node dead")


def one(cluster, scenario: str, tree: Path) -> dict:
    """One launch in a fresh process whose ``nbaccel`` is ``tree``'s; returns its timings."""
    folder = tempfile.mkdtemp(prefix="deaths-")
    env = {**os.environ, **cluster.env, "PYTHONPATH": str(tree)}
    child = subprocess.Popen(
        [sys.executable, "-c", ONE, scenario, folder], env=env, cwd=folder, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    marked: list[float] = []
    found, event = {}, None
    for line in child.stdout:
        if m := re.search(r"\[rank (\d)\] pid (\d+) on (n\d)", line):
            found[m[3]] = int(m[2])
        if scenario != "late error" and len(found) == 2 and event is None:
            event = time.time()
            if scenario == "rank SIGKILLed":
                os.kill(found["n2"], signal.SIGKILL)
            else:
                cluster.kill_node("n2")
                threading.Thread(target=_watch_marks, args=(cluster, marked), daemon=True).start()
                if scenario == "stop, node dead":
                    time.sleep(1.0)
                    event = time.time()
                    child.send_signal(signal.SIGINT)
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    child.wait(timeout=600)
    if scenario == "late error":
        event = min(p.stat().st_mtime for p in Path(folder).glob("*/rank-1.error.json"))
    timing = {"to end": result["ended"] - event, "said": result["said"]}
    if marked:
        timing["SLURM marked to end"] = result["ended"] - marked[0]
    if scenario in ("node dead", "stop, node dead"):
        cluster.revive("n2")
    return timing


def _watch_marks(cluster, marked: list[float]) -> None:
    for _ in range(1200):
        shown = cluster.run("sinfo", "-h", "-N", "-n", "n2", "-o", "%t", check=False).stdout
        if shown.strip().endswith("*") or shown.startswith("down"):
            marked.append(time.time())
            return
        time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default="d222e68", help="the commit before issue 61's change")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--out", type=Path, default=None, help="write JSON here, Markdown beside")
    opts = parser.parse_args()
    start_load = os.getloadavg()[0]
    before = Path(tempfile.mkdtemp(prefix="nbaccel-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before),
                    opts.before], check=True, capture_output=True)  # fmt: skip
    trees = {"before": before, "now": ROOT}
    cluster = test_cluster.start()
    runs = {s: {v: [] for v in trees} for s in opts.scenarios}
    try:
        for i in range(opts.rounds):
            order = list(trees)[i % 2 :] + list(trees)[: i % 2]
            for scenario in opts.scenarios:
                for variant in order:
                    runs[scenario][variant].append(one(cluster, scenario, trees[variant]))
                    print(f"round {i + 1}: {scenario}, {variant}: {runs[scenario][variant][-1]}",
                          file=sys.stderr)  # fmt: skip
    finally:
        cluster.stop()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)])
    results = {"machine": machine(opts.rounds, start_load), "before": opts.before, "runs": runs}
    for scenario, variants in runs.items():
        for variant, timings in variants.items():
            keys = [k for k in timings[0] if k != "said"]
            results.setdefault("summary", {}).setdefault(scenario, {})[variant] = {
                k: summary([t[k] for t in timings if k in t]) for k in keys
            } | {"said": sorted({_plain(t["said"]) for t in timings})}
    text = report(results)
    print(text)
    if opts.out:
        write(opts.out, results, text + "\n")


def _plain(said: str) -> str:
    """What the cell said, without what differs from run to run (pids, ports), shortened."""
    said = re.sub(r"\(pid \d+\)", "(pid ...)", said)
    said = re.sub(r":\d+\b", ":...", re.sub(r"\[[^\]]*pair\.cc:\d+\] ", "", said))
    return said[:110] + ("..." if len(said) > 110 else "")


def report(results: dict) -> str:
    lines = [
        "# When a rank or a node dies on a 2-node SLURM launch",
        "",
        f"Machine: {machine_line(results['machine'])}. The test cluster of tests/slurm/cluster.py "
        "(KillWait=5, SlurmdTimeout=20). Seconds, median [min, max] of "
        f"{results['machine']['runs']} rounds; 'before' is {results['before']}.",
        "",
        "| scenario | variant | to the cell's end | from SLURM's mark | what the cell said first |",
        "|---|---|---:|---:|---|",
    ]
    for scenario, variants in results["summary"].items():
        for variant, s in variants.items():
            end = s["to end"]
            mark = s.get("SLURM marked to end")
            marked = f"{mark['median']:.1f}" if mark else "n/a"
            said = " / ".join(s["said"]).replace("|", "\\|")
            lines.append(
                f"| {scenario} | {variant} | {end['median']:.1f} [{end['min']:.1f}, "
                f"{end['max']:.1f}] | {marked} | {said} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
