"""What does the time breakdown cost a training step? Measured finely enough to see 1%.

``overhead.py`` pairs nbaccel with and without the breakdown on its 512-wide MLP, but a step
of several milliseconds on a shared machine varies by more than the cost in question. So this
measures the cost where it can be resolved, in two places:

* **one process**: the same ``Accelerator`` loop (prepared model, optimizer and DataLoader,
  ``backward``, ``step``, ``zero_grad``) on a tiny model (``Linear(8, 1)``, batch 4), whose step
  is mostly the framework's own Python, with ``NBACCEL_BREAKDOWN`` on and off. The difference
  of the two medians, in microseconds a step, is what the breakdown adds to *any* step
  (forward hooks, the compute spans, the DataLoader's clock); divide it by your step time.
* **two ranks, DDP**: the communication hook alone (torch's ``allreduce_hook`` behind the
  breakdown's note), on lesson 5's model (``MLP(64, 256, 10)``, batch 32, gloo), against the
  same DDP model without a hook, in the same two processes.

One process: each trial is a fixed number of steps; variants alternate, the first one rotating
each round. Two ranks: in each round both models run the same number of steps, in turns of
``TURN`` steps in an order shuffled for every turn (the same order on both ranks), as
``overhead.py``'s variants take turns, so that the machine's drift falls on both alike. The
figures are medians of per-round paired ratios, with their interquartile range.

    python benchmarks/breakdown.py [--rounds 21] [--out benchmarks/results/breakdown-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import machine  # the same machine description

from nbaccel import Accelerator, notebook_launcher
from nbaccel.env import BREAKDOWN_VAR

TINY_STEPS = 2000
TURN = 4  # steps a DDP model runs at each of its turns (two_ranks)


def stat(values: list[float], digits: int = 4) -> dict:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {
        "median": round(statistics.median(values), digits),
        "iqr": [round(q1, digits), round(q3, digits)],
    }


def tiny_trial(on: bool) -> float:
    """Seconds per step of one pass over the loader, the breakdown on or off."""
    os.environ[BREAKDOWN_VAR] = "1" if on else "0"  # read when the Accelerator is made
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, live=False)
    data = TensorDataset(torch.randn(4 * TINY_STEPS, 8), torch.randn(4 * TINY_STEPS, 1))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, 4))
    start = time.perf_counter()
    for x, y in loader:
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    seconds = (time.perf_counter() - start) / TINY_STEPS
    accelerator.end_training()
    return seconds


def one_process(rounds: int) -> dict:
    saved = os.environ.get(BREAKDOWN_VAR)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        tiny_trial(True), tiny_trial(False)  # warm-up
        for i in range(rounds):
            for on in (True, False) if i % 2 == 0 else (False, True):
                times[on].append(tiny_trial(on))
    finally:
        if saved is None:
            os.environ.pop(BREAKDOWN_VAR, None)
        else:
            os.environ[BREAKDOWN_VAR] = saved
    on, off = times[True], times[False]
    return {
        "model": "Linear(8, 1), batch 4",
        "steps_per_trial": TINY_STEPS,
        "us_per_step_on": stat([t * 1e6 for t in on], 1),
        "us_per_step_off": stat([t * 1e6 for t in off], 1),
        "added_us_per_step": stat([(a - b) * 1e6 for a, b in zip(on, off, strict=True)], 2),
        "steps_per_s_on_over_off": stat([b / a for a, b in zip(on, off, strict=True)]),
    }


def ddp_hook(rounds: int, steps: int = 200) -> dict:
    """In each of 2 ranks: per-step time of DDP with the breakdown's hook over DDP without."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nbaccel.lessons import MLP
    from nbaccel.observe.breakdown import Breakdown, timed_allreduce

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plain, hooked = (
        DistributedDataParallel(MLP(64, 256, 10)),
        DistributedDataParallel(MLP(64, 256, 10)),
    )
    breakdown = Breakdown()
    hooked.register_comm_hook((breakdown, None), timed_allreduce)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def turn(model) -> float:
        start = time.perf_counter()
        for _ in range(TURN):
            with breakdown:  # both inside a compute span, as Accelerator.backward is
                F.cross_entropy(model(x), y).backward()
        return time.perf_counter() - start

    order = random.Random(0)  # the same turns on both ranks: their all-reduces pair up
    turn(plain), turn(hooked)
    ratios, plain_s = [], []
    for _ in range(rounds):
        seconds = {"plain": 0.0, "hooked": 0.0}
        for _ in range(steps // TURN):  # turns of a few steps, in a shuffled order
            for name in order.sample(sorted(seconds), 2):
                seconds[name] += turn(plain if name == "plain" else hooked)
        ratios.append(seconds["plain"] / seconds["hooked"])
        plain_s.append(seconds["plain"] / steps)
    # Free the DDP models while their gloo group lives: a Reducer that outlives the group tears
    # it down when freed, holding the GIL that a gloo thread waits for (a deadlock).
    plain.reducer = hooked.reducer = None
    dist.destroy_process_group()
    return {"ratios": ratios, "plain_ms": statistics.median(plain_s) * 1e3}


def two_ranks(rounds: int) -> dict:
    ranks = notebook_launcher(
        ddp_hook, args=(rounds,), num_processes=2, cpu=True, return_all=True, live=False
    )
    return {
        "model": "MLP(64, 256, 10), batch 32, gloo, 2 ranks",
        "step_ms_without_hook": round(ranks[0]["plain_ms"], 3),
        "steps_per_s_hook_over_none": [stat(r["ratios"]) for r in ranks],
    }


def to_markdown(report: dict) -> str:
    m, one, two = report["machine"], report["one_process"], report["two_ranks"]

    def cell(s: dict, digits: int) -> str:
        (q1, q3), f = s["iqr"], f".{digits}f"
        return f"{s['median']:{f}} ({q1:{f}}-{q3:{f}})"

    ddp = "; ".join(
        f"rank {i} {cell(s, 3)}" for i, s in enumerate(two["steps_per_s_hook_over_none"])
    )
    return "\n".join(
        [
            "# What the time breakdown costs a step",
            "",
            f"CPU: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; Python {m['python']}; "
            f"nbaccel {m['nbaccel']}; {m['date']}; {report['rounds']} rounds. Median (IQR).",
            "",
            "| where | measure | value |",
            "|---|---|---:|",
            f"| one process, {one['model']} | us a step, breakdown on | "
            f"{cell(one['us_per_step_on'], 1)} |",
            f"| | us a step, off | {cell(one['us_per_step_off'], 1)} |",
            f"| | added us a step (paired) | {cell(one['added_us_per_step'], 2)} |",
            f"| | steps/s on / off (paired) | {cell(one['steps_per_s_on_over_off'], 3)} |",
            f"| {two['model']} | steps/s with the hook / without, per rank | {ddp} |",
            f"| | step without the hook | {two['step_ms_without_hook']:.2f} ms |",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out", default="benchmarks/results/breakdown-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {
        "machine": machine(1),
        "rounds": args.rounds,
        "one_process": one_process(args.rounds),
        "two_ranks": two_ranks(args.rounds),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    markdown = to_markdown(report)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
