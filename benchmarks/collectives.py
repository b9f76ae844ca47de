"""What does checking shapes cost ``gather``? Checked versus unchecked, on 2 CPU ranks (gloo).

``nbaccel.utils.gather`` first exchanges each tensor's shape and dtype (one all_gather of
10 int64 per rank), so a mismatch raises a clear error on every rank instead of returning
garbage. This measures that check beside the same gather without it, for a metric (1 float), a
batch of logits (64 x 64 floats) and a large tensor (1M floats, 4 MB).

Method, for a shared and noisy machine: two ranks (one thread each) in fresh processes; each
round times one trial of every variant (``REPEAT`` gathers after a barrier), in an order that
rotates every round; a round's paired ratio is a variant's time over the unchecked gather's in
the same round. "unchecked again" is a second copy of the unchecked gather: how far from 1 a
ratio strays with no difference at all. We report medians and interquartile ranges.

    python benchmarks/collectives.py [--rounds 30] [--out benchmarks/results/collectives-cpu.json]
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

from nbaccel.accelerator import collectives
from nbaccel.env import find_free_port

SIZES = {"metric (1 float)": (1,), "logits (64 x 64)": (64, 64), "large (1M floats)": (2**20,)}
REPEAT = {"metric (1 float)": 200, "logits (64 x 64)": 200, "large (1M floats)": 10}
VARIANTS = {
    "checked": lambda t: collectives._gather_one(t),
    "unchecked": lambda t: collectives._gather_one(t, check=False),
    "unchecked again": lambda t: collectives._gather_one(t, check=False),
}


def worker(rank: int, port: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times: dict[str, dict[str, list[float]]] = {s: {v: [] for v in VARIANTS} for s in SIZES}
    names = list(VARIANTS)
    for size, shape in SIZES.items():
        tensor = torch.randn(shape)
        for fn in VARIANTS.values():  # warm-up
            fn(tensor)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(REPEAT[size]):
                    VARIANTS[name](tensor)
                times[size][name].append((time.perf_counter() - start) / REPEAT[size])
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def summarise(times: dict) -> dict:
    rows = {}
    for size, variants in times.items():
        base = variants["unchecked"]
        for name, values in variants.items():
            ratios = [v / b for v, b in zip(values, base, strict=True)]
            rows[f"{size} / {name}"] = {
                "us": statistics.median(values) * 1e6,
                "us_iqr": _iqr(values, 1e6),
                "ratio": statistics.median(ratios),
                "ratio_iqr": _iqr(ratios),
            }
    return rows


def _iqr(values: list[float], scale: float = 1.0) -> list[float]:
    q = statistics.quantiles(values, n=4)
    return [q[0] * scale, q[2] * scale]


def machine(rounds: int) -> dict:
    models = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ] if Path("/proc/cpuinfo").exists() else []  # fmt: skip
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
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/collectives-cpu.json")
    args = parser.parse_args()
    raw = Path(args.out).with_suffix(".raw.json")
    mp.spawn(worker, args=(find_free_port(), args.rounds, str(raw)), nprocs=2)
    result = {"machine": machine(args.rounds), "rows": summarise(json.loads(raw.read_text()))}
    raw.unlink()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    m = result["machine"]
    lines = [
        "# gather with and without the shape check: 2 CPU ranks (gloo)",
        "",
        f"CPU: {m['cpu']}, {m['cores']} cores; Python {m['python']}; torch {m['torch']}; "
        f"nbaccel {m['commit']}; {m['date']}; {m['rounds']} rounds; 1-min load {m['load']:.1f}.",
        "Time per gather on rank 0 (median, IQR); ratio: median of per-round ratios to the "
        "unchecked gather in the same round.",
        "",
        "| tensor / variant | us per gather | IQR | ratio | ratio IQR |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in result["rows"].items():
        lines.append(
            f"| {name} | {row['us']:.0f} | {row['us_iqr'][0]:.0f}-{row['us_iqr'][1]:.0f} | "
            f"{row['ratio']:.2f} | {row['ratio_iqr'][0]:.2f}-{row['ratio_iqr'][1]:.2f} |"
        )
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
