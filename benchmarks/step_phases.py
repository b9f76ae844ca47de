"""Where does nbaccel's per-step cost go? Each phase of a training step, timed against raw PyTorch.

``overhead.py`` says how much slower a whole step is; this says in which phase the time goes:
getting the batch from the DataLoader, entering ``accumulate``, the forward and loss, the
backward, the optimizer's step, ``zero_grad`` and leaving ``accumulate``. The loop and the
model are ``overhead.py``'s (MLP 512 wide, batch 64, SGD, one thread), in its plain mode, with
its method: each round builds every variant afresh, then they take turns 4 steps at a time in
an order shuffled for every turn, nbaccel's recorder pacing its periodic work on the variant's
own running time (``OwnClock``). A phase's time is this thread's CPU time between two clock
readings around it (``time.thread_time``: a few hundred nanoseconds a reading, the same in
every variant); the figure is the median over rounds of the paired difference to raw PyTorch,
in microseconds a step, with its interquartile range. "raw again" is the noise floor.

Its steps start with cold caches, as a real step does after the step before (the weights and
gradients, 4 MiB, are larger than a core's L2): a framework's Python costs several times what
the same calls cost in a hot microbenchmark (``overhead_parts.py`` measures by how much).

    python benchmarks/step_phases.py [--rounds 30] [--out benchmarks/results/step-phases-cpu.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from pathlib import Path
from time import thread_time as clock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import BLOCK, OwnClock, calibrate, cell, machine, make_parts, stat, turns, warm_up

import nbaccel
from nbaccel.env import BREAKDOWN_VAR

PHASES = ("data", "enter accumulate", "forward and loss", "backward", "step", "zero_grad", "exit")


def raw(steps: int, spent: list[float]):
    """Raw PyTorch's step, phase by phase; ``spent`` adds up each phase's seconds."""
    model, optimizer, loader = make_parts(steps)
    while True:
        batches = iter(loader)
        while True:
            t0 = clock()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            t1 = clock()  # nothing to enter: two readings, as in nbaccel's loop
            t2 = clock()
            loss = F.cross_entropy(model(x), y)
            t3 = clock()
            loss.backward()
            t4 = clock()
            optimizer.step()
            t5 = clock()
            optimizer.zero_grad()
            t6 = clock()
            t7 = clock()
            add(spent, t0, t1, t2, t3, t4, t5, t6, t7)
            yield


def accelerated(steps: int, spent: list[float], breakdown: bool, clock: OwnClock):
    """nbaccel's step (``overhead.py``'s loop), ``accumulate`` entered and left by hand so that
    both are timed; its recorder's periodic work paced by ``clock``, as in ``overhead.py``."""
    os.environ[BREAKDOWN_VAR] = "1" if breakdown else "0"  # read when the Accelerator is made
    accelerator = nbaccel.Accelerator(cpu=True, live=False)
    clock.pace(accelerator.recorder)
    model, optimizer, loader = accelerator.prepare(*make_parts(steps))
    while True:
        batches = iter(loader)
        while True:
            t0 = clock()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            t1 = clock()
            block = accelerator.accumulate(model)
            block.__enter__()
            t2 = clock()
            loss = F.cross_entropy(model(x), y)
            t3 = clock()
            accelerator.backward(loss)
            t4 = clock()
            optimizer.step()
            t5 = clock()
            optimizer.zero_grad()
            t6 = clock()
            block.__exit__(None, None, None)
            t7 = clock()
            add(spent, t0, t1, t2, t3, t4, t5, t6, t7)
            yield


def add(spent: list[float], *moments: float) -> None:
    for i, (start, end) in enumerate(itertools.pairwise(moments)):
        spent[i] += end - start


VARIANTS = {
    "raw": lambda steps, spent, clock: raw(steps, spent),
    "raw again": lambda steps, spent, clock: raw(steps, spent),
    "nbaccel": lambda steps, spent, clock: accelerated(steps, spent, True, clock),
    "nbaccel, no breakdown": lambda steps, spent, clock: accelerated(steps, spent, False, clock),
}


def measure(rounds: int) -> dict:
    steps = calibrate(1, "no")
    order = random.Random(0)
    per_step: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}  # us, per round
    saved = os.environ.get(BREAKDOWN_VAR)
    try:
        for _ in range(rounds):
            spent = {name: [0.0] * len(PHASES) for name in VARIANTS}
            clocks = {name: OwnClock() for name in VARIANTS}
            runs = {
                name: build(steps, spent[name], clocks[name]) for name, build in VARIANTS.items()
            }
            warm_up(runs)
            for name in VARIANTS:
                spent[name][:] = [0.0] * len(PHASES)  # the warm-up is not counted
            for name in turns(runs, steps, order):
                with clocks[name]:
                    for _ in range(BLOCK):
                        next(runs[name])
            for name in VARIANTS:
                per_step[name].append([s / steps * 1e6 for s in spent[name]])
    finally:
        if saved is None:
            os.environ.pop(BREAKDOWN_VAR, None)
        else:
            os.environ[BREAKDOWN_VAR] = saved
    return {"steps_per_round": steps, "rounds": rounds, "per_step_us": per_step}


def summarize(result: dict) -> dict:
    per_step, raw_rounds = result["per_step_us"], result["per_step_us"]["raw"]
    table = {}
    for name, rounds in per_step.items():
        table[name] = {
            "step_us": stat([sum(r) for r in rounds], 1),
            "added_us": {
                phase: stat([r[i] - b[i] for r, b in zip(rounds, raw_rounds, strict=True)], 1)
                for i, phase in enumerate(PHASES)
            },
            "added_step_us": stat(
                [sum(r) - sum(b) for r, b in zip(rounds, raw_rounds, strict=True)], 1
            ),
        }
    return table


def to_markdown(report: dict) -> str:
    m, table = report["machine"], report["table"]
    lines = [
        "# Where nbaccel's per-step cost goes, phase by phase (CPU)",
        "",
        f"CPU: {m['cpu']}, {m['cores']} cores; torch.set_num_threads(1); torch {m['torch']}; "
        f"Python {m['python']}; nbaccel {m['nbaccel']}; {m['date']}.",
        f"overhead.py's MLP, plain mode; {report['rounds']} rounds of "
        f"{report['steps_per_round']} steps per variant, in shuffled turns of {BLOCK} steps. "
        "Microseconds a step of this thread's CPU time, added to raw PyTorch's (paired by "
        "round): median (IQR).",
        "",
        "| variant | step, us | added, us | " + " | ".join(PHASES) + " |",
        "|---|" + "---:|" * (2 + len(PHASES)),
    ]
    for name, row in table.items():
        phases = [cell(row["added_us"][phase], 1) for phase in PHASES]
        lines.append(
            f"| {name} | {cell(row['step_us'], 1)} | {cell(row['added_step_us'], 1)} | "
            + " | ".join(phases)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/step-phases-cpu.json")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2, for a median and quartiles")
    torch.set_num_threads(1)
    result = measure(args.rounds)
    report = {
        "machine": machine(1),
        "rounds": args.rounds,
        "steps_per_round": result["steps_per_round"],
        "table": summarize(result),
        "per_step_us": result["per_step_us"],
    }
    text = to_markdown(report)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
