"""What does the shape check cost ``reduce``, ``broadcast`` and ``gather``? 2 CPU ranks (gloo).

Before any data moves, nbaccel's collectives compare what every rank passed (structure, shapes
and dtypes, hashed into one number) in one all_gather of 9 int64 per rank, however many
tensors the call holds; a mismatch then raises on every rank instead of aborting one (issue 32).
This times each collective with that check ("checked", the public function) beside the same
collective without it ("unchecked", the private function the public one calls after the
check), for a metric (1 float), a batch of logits (64 x 64 floats), a batch dict of 8 such
tensors (one check for the 8) and a large tensor (1M floats, 4 MB).

Method, for a shared and noisy machine: two ranks (one thread each) in fresh processes; each
round times one trial of every variant (``REPEAT`` calls after a barrier), in an order that
rotates every round; a round's paired ratio is a variant's time over the unchecked one's in
the same round, and its paired difference the time the check added. "unchecked again" is a
second copy of the unchecked collective: how far from 1 a ratio strays with no difference at
all. We report medians and interquartile ranges, on rank 0.

    python benchmarks/collective_checks.py [--rounds 30] \
        [--out benchmarks/results/collective-checks-cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbaccel.accelerator import collectives as c
from nbaccel.env import find_free_port
from nbaccel.tensors import map_tensors

DATA = {  # name: (how to build it, calls per trial)
    "metric (1 float)": (lambda: torch.randn(1), 100),
    "logits (64 x 64)": (lambda: torch.randn(64, 64), 100),
    "dict of 8 x (64 x 64)": (lambda: {f"t{i}": torch.randn(64, 64) for i in range(8)}, 20),
    "large (1M floats)": (lambda: torch.randn(2**20), 5),
}


def _gather(data):  # what gather does after its check
    return map_tensors(data, lambda t: c._gather_one(t, check=False))


OPS = {  # collective: {variant: call}
    "reduce": {
        "checked": lambda d: c.reduce(d, "sum"),
        "unchecked": lambda d: c._reduce(d, "sum"),
        "unchecked again": lambda d: c._reduce(d, "sum"),
    },
    "broadcast": {
        "checked": lambda d: c.broadcast(d),
        "unchecked": lambda d: c._broadcast(d, 0),
        "unchecked again": lambda d: c._broadcast(d, 0),
    },
    "gather": {
        "checked": lambda d: c.gather(d),
        "unchecked": _gather,
        "unchecked again": _gather,
    },
}


def worker(rank: int, port: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        times = {f"{op} / {d}": {v: [] for v in OPS[op]} for op in OPS for d in DATA}
        for op, variants in OPS.items():
            names = list(variants)
            for name, (build, repeat) in DATA.items():
                torch.manual_seed(0)
                data = build()
                for call in variants.values():  # warm-up
                    call(data)
                for r in range(rounds):
                    for variant in names[r % len(names) :] + names[: r % len(names)]:
                        dist.barrier()
                        start = time.perf_counter()
                        for _ in range(repeat):
                            variants[variant](data)
                        times[f"{op} / {name}"][variant].append(
                            (time.perf_counter() - start) / repeat
                        )
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def summarise(times: dict) -> dict:
    rows = {}
    for case, variants in times.items():
        base = variants["unchecked"]
        for name, values in variants.items():
            ratios = [v / b for v, b in zip(values, base, strict=True)]
            extra = [(v - b) * 1e6 for v, b in zip(values, base, strict=True)]
            rows[f"{case} / {name}"] = {
                "us": statistics.median(values) * 1e6,
                "us_iqr": _iqr(values, 1e6),
                "ratio": statistics.median(ratios),
                "ratio_iqr": _iqr(ratios),
                "extra_us": statistics.median(extra),
                "extra_us_iqr": _iqr(extra),
            }
    return rows


def _iqr(values: list[float], scale: float = 1.0) -> list[float]:
    q = statistics.quantiles(values, n=4)
    return [q[0] * scale, q[2] * scale]


def machine(rounds: int) -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    models = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
        if line.startswith("model name")
    ]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpu": models[0] if models else platform.processor(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rounds": rounds,
        "load_before": os.getloadavg()[0],
    }


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# reduce, broadcast and gather with and without the shape check: 2 CPU ranks (gloo)",
        "",
        f"CPU: {m['cpu']}, {m['cores']} cores; Python {m['python']}; torch {m['torch']}; "
        f"nbaccel {m['commit']}; {m['date']}; {m['rounds']} rounds; 1-min load "
        f"{m['load_before']:.1f} before, {m['load_after']:.1f} after.",
        "Time per call on rank 0 (median, IQR); ratio: median of per-round ratios to the "
        "unchecked call in the same round; extra: median of the per-round differences.",
        "",
        "| collective / data / variant | us per call | IQR | ratio | ratio IQR | extra us |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["rows"].items():
        extra = "" if name.endswith("/ unchecked") else f"{row['extra_us']:+.0f}"
        lines.append(
            f"| {name} | {row['us']:.0f} | {row['us_iqr'][0]:.0f}-{row['us_iqr'][1]:.0f} | "
            f"{row['ratio']:.2f} | {row['ratio_iqr'][0]:.2f}-{row['ratio_iqr'][1]:.2f} | "
            f"{extra} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/collective-checks-cpu.json")
    args = parser.parse_args()
    raw = Path(args.out).with_suffix(".raw.json")
    about = machine(args.rounds)
    mp.spawn(worker, args=(find_free_port(), args.rounds, str(raw)), nprocs=2)
    about["load_after"] = os.getloadavg()[0]
    result = {"machine": about, "rows": summarise(json.loads(raw.read_text()))}
    raw.unlink()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    Path(args.out).with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
