"""What does the Accelerator cost per training step? Raw PyTorch versus nbaccel, on one CPU.

One small training loop (an MLP 512 wide, batch 64, SGD, synthetic data in memory, iterated
through a DataLoader) is written once per framework, as its user would write it, and timed in
three modes: "plain" (float32), "accumulation 4" (a real step every 4th micro-batch) and "bf16"
(autocast). HF Accelerate and Lightning Fabric join as extra columns when they are installed
(`pip install -c constraints.txt -e '.[bench]'`).

The machine may be shared and noisy, so every variant runs in this one process, round-robin
(the first variant rotates each round), the same number of steps per trial, on objects rebuilt
every few rounds. Each round gives a paired ratio: a variant's steps/s over raw PyTorch's in the
same round. We report the median ratio, the median steps/s, and the interquartile range (IQR)
of both. Wall time (``perf_counter``) is the measure; the ratio of process CPU time is shown
beside it, as it ignores the time other programs held the CPU. "raw again", a second copy of
the raw loop, shows how far from 1 a ratio strays with no difference in the code at all.

The time breakdown (``nbaccel.breakdown``, on by default) is measured as a pair: "nbaccel" with
it and "nbaccel, no breakdown" (``NBACCEL_BREAKDOWN=0``), and the paired ratio of the two in
each round is the breakdown's cost (reported below the table).

    python benchmarks/overhead.py [--rounds 25] [--steps N] [--threads 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
from nbaccel.env import BREAKDOWN_VAR

MODES = {"plain": (1, "no"), "accumulation 4": (4, "no"), "bf16": (1, "bf16")}  # accum, precision
WIDTH, BATCH, LR = 512, 64, 1e-3
REBUILD = 5  # rounds between fresh models, optimizers and loaders


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
    # No autocast at all in float32: even a disabled one costs ~10 us per step.
    bf16 = precision == "bf16"
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16)) if bf16 else contextlib.nullcontext

    def epoch() -> float:
        for i, (x, y) in enumerate(loader):
            with autocast():
                loss = F.cross_entropy(model(x), y)
            (loss / accum if accum > 1 else loss).backward()
            if (i + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
        return loss.item()

    return epoch


def accelerator_epoch(accelerator, model, optimizer, loader):
    """One loop for nbaccel and HF Accelerate: that is the point of sharing the API."""

    def epoch() -> float:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        return loss.item()

    return epoch


def nbaccel_loop(steps: int, accum: int, precision: str):
    accelerator = nbaccel.Accelerator(precision, gradient_accumulation_steps=accum, cpu=True)
    return accelerator_epoch(accelerator, *accelerator.prepare(*make_parts(steps)))


def nbaccel_without_breakdown(steps: int, accum: int, precision: str):
    """nbaccel with its time breakdown switched off, as ``NBACCEL_BREAKDOWN=0`` does."""
    saved = os.environ.get(BREAKDOWN_VAR)
    os.environ[BREAKDOWN_VAR] = "0"  # read once, when the Accelerator is made
    try:
        return nbaccel_loop(steps, accum, precision)
    finally:
        if saved is None:
            os.environ.pop(BREAKDOWN_VAR)
        else:
            os.environ[BREAKDOWN_VAR] = saved


def accelerate_loop(steps: int, accum: int, precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # its process-wide singletons
    GradientState._reset_state()  # would refuse a new mode
    accelerator = Accelerator(
        mixed_precision=precision, gradient_accumulation_steps=accum, cpu=True
    )
    return accelerator_epoch(accelerator, *accelerator.prepare(*make_parts(steps)))


def fabric_loop(steps: int, accum: int, precision: str):
    from lightning.fabric import Fabric

    fabric_precision = "bf16-mixed" if precision == "bf16" else "32-true"
    fabric = Fabric(accelerator="cpu", devices=1, precision=fabric_precision)
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


def calibrate(accum: int, precision: str, seconds: float = 0.3) -> int:
    """Steps (a multiple of 4, at least 8) for one raw trial to take about ``seconds``."""
    epoch = raw(8, accum, precision)
    epoch()
    start = time.perf_counter()
    epoch()
    return max(8, 4 * round(seconds / ((time.perf_counter() - start) / 8) / 4))


def stat(xs: list[float], digits: int) -> dict:
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": round(median, digits), "iqr": [round(q1, digits), round(q3, digits)]}


def run_mode(mode: str, variants: dict, rounds: int, steps: int | None) -> dict:
    accum, precision = MODES[mode]
    steps = steps or calibrate(accum, precision)
    wall: dict[str, list[float]] = {name: [] for name in variants}  # steps/s, one per round
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    loss = {}
    for r in range(rounds):
        if r % REBUILD == 0:  # fresh objects: where their memory lies moves speed by ~1%
            epochs = {name: build(steps, accum, precision) for name, build in variants.items()}
            for epoch in epochs.values():
                epoch()  # warm-up: allocator, autograd graph, autocast caches
        for name in list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]:
            start, cpu_start = time.perf_counter(), time.process_time()
            loss[name] = epochs[name]()
            wall[name].append(steps / (time.perf_counter() - start))
            cpu[name].append(steps / (time.process_time() - cpu_start))
    results = {}
    for name in variants:
        results[name] = {
            "steps_per_s": stat(wall[name], 1),
            "ratio": stat([x / b for x, b in zip(wall[name], wall["raw"], strict=True)], 4),
            "cpu_time_ratio": stat([x / b for x, b in zip(cpu[name], cpu["raw"], strict=True)], 4),
            "last_loss": round(loss[name], 4),  # equal across variants: the same math
            "per_round_steps_per_s": [round(x, 1) for x in wall[name]],
        }
    pair = "nbaccel", "nbaccel, no breakdown"
    out = {"steps_per_trial": steps, "variants": results}
    if all(name in variants for name in pair):  # the breakdown's cost: on over off, paired
        on, off = wall[pair[0]], wall[pair[1]]
        out["breakdown_on_over_off"] = stat([a / b for a, b in zip(on, off, strict=True)], 4)
    return out


def revision() -> str:
    """The git commit of the nbaccel measured, "-dirty" when its files differ from it."""
    git = ["git", "-C", str(Path(nbaccel.__file__).resolve().parent)]
    try:
        out = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "."]).returncode != 0
    except OSError:
        return "unknown"
    return out.stdout.strip() + "-dirty" * dirty if out.returncode == 0 else "unknown"


def machine(threads: int) -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if "model name" in ln]
    info = {
        "cpu": models[0] if models else platform.processor(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "nbaccel": f"{nbaccel.__version__} ({revision()})",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for package in ("accelerate", "lightning"):
        with contextlib.suppress(ImportError):
            info[package] = __import__(package).__version__
    return info


def to_markdown(report: dict) -> str:
    m, c = report["machine"], report["config"]
    lines = [
        f"CPU: {m['cpu']}, {m['cores']} cores; torch.set_num_threads({m['threads']}); "
        f"torch {m['torch']}; Python {m['python']}; nbaccel {m['nbaccel']}; {m['date']}.",
        f"MLP {c['width']} wide, batch {c['batch']}, {c['optimizer']}; {c['rounds']} rounds of "
        "N steps per variant. Ratio: variant / raw steps/s in the same round. Median (IQR).",
        "",
        "| mode | variant | steps/s | ratio to raw | CPU-time ratio |",
        "|---|---|---:|---:|---:|",
    ]

    def cell(s: dict, digits: int) -> str:
        (q1, q3), f = s["iqr"], f".{digits}f"
        return f"{s['median']:{f}} ({q1:{f}}-{q3:{f}})"

    for mode, result in report["modes"].items():
        for name, r in result["variants"].items():
            lines.append(
                f"| {mode} (N={result['steps_per_trial']}) | {name} | {cell(r['steps_per_s'], 1)}"
                f" | {cell(r['ratio'], 3)} | {cell(r['cpu_time_ratio'], 3)} |"
            )
    costs = [
        f"{mode} {cell(result['breakdown_on_over_off'], 4)}"
        for mode, result in report["modes"].items()
        if "breakdown_on_over_off" in result
    ]
    if costs:
        lines += ["", "Time breakdown, steps/s with it over without (paired): " + "; ".join(costs)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds per mode")
    parser.add_argument("--steps", type=int, help="steps per trial (default: ~0.3 s of raw)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", default="benchmarks/results/overhead-cpu.json")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2, for a median and quartiles")
    if args.steps is not None and (args.steps < 4 or args.steps % 4):
        parser.error("--steps must be a multiple of 4, so every accumulation window is full")
    torch.set_num_threads(args.threads)
    # "raw again" is a second, identical raw loop: how far its ratio strays from 1 is the noise.
    variants = {
        "raw": raw,
        "raw again": raw,
        "nbaccel": nbaccel_loop,
        "nbaccel, no breakdown": nbaccel_without_breakdown,
    }
    for name, module, loop in [("accelerate", "accelerate", accelerate_loop),
                               ("fabric", "lightning.fabric", fabric_loop)]:  # fmt: skip
        try:
            __import__(module)
            variants[name] = loop
        except ImportError:
            print(f"({name} is not installed: column skipped)")
    config = {"width": WIDTH, "batch": BATCH, "optimizer": f"SGD(lr={LR})", "rounds": args.rounds}
    report = {"machine": machine(args.threads), "config": config, "modes": {}}
    for mode in MODES:
        report["modes"][mode] = run_mode(mode, variants, args.rounds, args.steps)
    table = to_markdown(report)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text("# Training-loop overhead on CPU\n\n" + table)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
