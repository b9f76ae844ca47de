"""How long from the call to the first step, and to the value back: a 2-node SLURM launch
against a local 2-process launch of the same function.

The function records the moment its first step starts and returns it (the nodes of the test
cluster share this machine's clock; on a real cluster, nodes' clocks differ by up to
milliseconds to seconds, so compare each node's durations instead). Variants alternate round by
round, the first one rotating; medians with min and max.

Needs the test cluster: as root, with SLURM installed (`make slurm`), this starts the two-node
cluster of ``tests/slurm/cluster.py`` and stops it at the end.

    python benchmarks/cluster.py [--rounds 5] [--out benchmarks/results/cluster-cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import nbaccel
from nbaccel import SlurmCluster, notebook_launcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.slurm import cluster as test_cluster


def first_step() -> float:
    """The moment this rank's first step starts, after the process group formed."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    started = time.time()
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    return started


def one(variant: str, folder: str) -> dict:
    called = time.time()
    if variant == "slurm, 2 nodes x 1":
        cluster = SlurmCluster(time=10, folder=folder)
        step = notebook_launcher(first_step, num_nodes=2, cluster=cluster, live=False)
    else:
        step = notebook_launcher(first_step, num_processes=2, cpu=True, live=False)
    return {"first step": step - called, "value back": time.time() - called}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cluster-cpu.json")
    args = parser.parse_args()
    if reason := test_cluster.why_not():
        sys.exit(f"benchmarks/cluster.py: {reason}")
    variants = ["local, 2 processes", "slurm, 2 nodes x 1"]
    cluster = test_cluster.start()
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        with tempfile.TemporaryDirectory() as folder:
            notebook_launcher(first_step, num_processes=2, cpu=True, live=False)  # warm server
            for r in range(args.rounds):
                for v in variants[r % 2 :] + variants[: r % 2]:
                    results[v].append(one(v, folder))
    finally:
        cluster.stop()
    write(results, args)


def write(results: dict, args) -> None:
    def cell(v: str, key: str) -> str:
        xs = [m[key] for m in results[v]]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    load = os.getloadavg()[0]
    head = (
        f"Python {platform.python_version()}, torch {torch.__version__}, nbaccel "
        f"{nbaccel.__version__}, {os.cpu_count()} cores, 1-min load {load:.1f}; the test "
        f"cluster's two nodes on this one machine (SLURM 22.05, Debian 12); {args.rounds} "
        f"rounds; {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}. "
        "Seconds, median (min-max)."
    )
    lines = [
        "# From the call to the first step and to the value back: SLURM against a local launch",
        "",
        head,
        "",
        "| variant | call -> first step | call -> value back |",
        "|---|---:|---:|",
    ]
    lines += [f"| {v} | {cell(v, 'first step')} | {cell(v, 'value back')} |" for v in results]
    out = Path(args.out)
    out.write_text(json.dumps({"head": head, "results": results}, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
