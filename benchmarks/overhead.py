"""What does the Accelerator cost per training step? Raw PyTorch versus nbaccel, on one CPU.

One small training loop (an MLP 512 wide, batch 64, SGD, synthetic data in memory) is written
once per framework, as its user would write it, and timed in three modes: "plain" (float32),
"accumulation 4" (a real step every 4th micro-batch) and "bf16" (autocast). HF Accelerate and
Lightning Fabric join as extra columns when they are installed (`pip install -e '.[bench]'`).

The machine is shared and noisy, so every variant runs in this one process, round-robin (the
starting variant rotates each round), the same number of steps per trial. Each round gives a
paired ratio: a variant's steps/s over raw PyTorch's in the same round. We report the median
ratio, the median steps/s, and the interquartile range (IQR) of both.

    python benchmarks/overhead.py [--rounds 20] [--steps 96] [--threads 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbaccel

MODES = {"plain": (1, "no"), "accumulation 4": (4, "no"), "bf16": (1, "bf16")}  # accum, precision
WIDTH, BATCH, LR = 512, 64, 1e-3


def make_parts(steps: int):
    """The same model (same initial weights), optimizer and data for every variant."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = TensorDataset(torch.randn(steps * BATCH, WIDTH), torch.randint(0, 10, (steps * BATCH,)))
    return model, optimizer, DataLoader(data, batch_size=BATCH)


def raw(steps: int, accum: int, precision: str):
    model, optimizer, loader = make_parts(steps)

    def epoch() -> float:
        for i, (x, y) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = F.cross_entropy(model(x), y)
            (loss / accum if accum > 1 else loss).backward()
            if (i + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
        return loss.item()

    return epoch


def nbaccel_loop(steps: int, accum: int, precision: str):
    accelerator = nbaccel.Accelerator(precision, gradient_accumulation_steps=accum, cpu=True)
    model, optimizer, loader = accelerator.prepare(*make_parts(steps))

    def epoch() -> float:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        return loss.item()

    return epoch


def accelerate_loop(steps: int, accum: int, precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # HF Accelerate keeps process-wide singletons; a new mode needs them cleared.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(
        mixed_precision=precision, gradient_accumulation_steps=accum, cpu=True
    )
    model, optimizer, loader = accelerator.prepare(*make_parts(steps))

    def epoch() -> float:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        return loss.item()

    return epoch


def fabric_loop(steps: int, accum: int, precision: str):
    from lightning.fabric import Fabric

    fabric = Fabric(
        accelerator="cpu", devices=1, precision="bf16-mixed" if precision == "bf16" else "32-true"
    )
    model, optimizer, loader = make_parts(steps)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)

    def epoch() -> float:  # Fabric leaves accumulation to the user, as raw PyTorch does
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0
            with fabric.no_backward_sync(model, enabled=not last):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / accum if accum > 1 else loss)
            if last:
                optimizer.step()
                optimizer.zero_grad()
        return loss.item()

    return epoch


def available_variants() -> dict:
    variants = {"raw": raw, "nbaccel": nbaccel_loop}
    for name, module, loop in [
        ("accelerate", "accelerate", accelerate_loop),
        ("fabric", "lightning.fabric", fabric_loop),
    ]:
        try:
            __import__(module)
            variants[name] = loop
        except ImportError:
            print(f"({name}: not installed, column skipped; pip install -e '.[bench]')")
    return variants


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def run_mode(mode: str, variants: dict, rounds: int, steps: int) -> dict:
    accum, precision = MODES[mode]
    epochs = {}
    for name, build in variants.items():  # built one after another: HF resets its singletons
        epochs[name] = build(steps, accum, precision)
        epochs[name]()  # warm-up: allocator, autograd graph, autocast caches
    rates: dict[str, list[float]] = {name: [] for name in variants}
    losses = {}
    for r in range(rounds):
        names = list(variants)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            losses[name] = epochs[name]()
            rates[name].append(steps / (time.perf_counter() - start))
    result = {}
    for name, xs in rates.items():
        ratios = [x / base for x, base in zip(xs, rates["raw"], strict=True)]
        q1, med, q3 = quartiles(xs)
        r1, rmed, r3 = quartiles(ratios)
        result[name] = {
            "steps_per_s": round(med, 1),
            "steps_per_s_iqr": [round(q1, 1), round(q3, 1)],
            "ratio": round(rmed, 4),
            "ratio_iqr": [round(r1, 4), round(r3, 4)],
            "last_loss": round(losses[name], 4),
            "per_round_steps_per_s": [round(x, 1) for x in xs],
        }
    return result


def machine(threads: int) -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu
        )
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "nbaccel": nbaccel.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for package in ("accelerate", "lightning"):
        with contextlib.suppress(ImportError):
            info[package] = __import__(package).__version__
    return info


def to_markdown(report: dict) -> str:
    m, cfg = report["machine"], report["config"]
    lines = [
        f"CPU: {m['cpu']} ({m['cores']} cores), torch.set_num_threads({m['threads']}), "
        f"torch {m['torch']}, Python {m['python']}, {m['date']}",
        f"MLP {cfg['width']} wide, batch {cfg['batch']}, SGD; {cfg['rounds']} rounds x "
        f"{cfg['steps']} steps per variant. Ratio = variant / raw steps/s in the same round.",
        "",
        "| mode | variant | steps/s (median) | steps/s IQR | ratio to raw (median) | ratio IQR |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, result in report["modes"].items():
        for name, r in result.items():
            (q1, q3), (r1, r3) = r["steps_per_s_iqr"], r["ratio_iqr"]
            lines.append(
                f"| {mode} | {name} | {r['steps_per_s']:.1f} | {q1:.1f}-{q3:.1f} | "
                f"{r['ratio']:.3f} | {r1:.3f}-{r3:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per mode")
    parser.add_argument("--steps", type=int, default=96, help="training steps per trial")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", default="benchmarks/results/overhead-cpu.json")
    args = parser.parse_args()
    if args.steps % 4:
        parser.error("--steps must be a multiple of 4, so every accumulation window is full")
    torch.set_num_threads(args.threads)
    variants = available_variants()
    report = {
        "machine": machine(args.threads),
        "config": {
            "width": WIDTH,
            "batch": BATCH,
            "optimizer": f"SGD(lr={LR})",
            "rounds": args.rounds,
            "steps": args.steps,
        },
        "modes": {mode: run_mode(mode, variants, args.rounds, args.steps) for mode in MODES},
    }
    table = to_markdown(report)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text("# Training-loop overhead on CPU\n\n" + table)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
