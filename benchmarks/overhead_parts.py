"""Where do nbaccel's per-step costs come from? ``overhead.py``'s loop with one part at a time.

``overhead.py`` compares whole loops; this one builds raw PyTorch's loop and swaps in one
piece of nbaccel at a time: the prepared DataLoader (with the recorder's counting and the time
breakdown, as ``prepare`` makes it, and without them), the prepared optimizer, the prepared
model, ``accelerator.backward``; then every piece but ``accumulate``, then nbaccel's whole
loop. Same model, data, modes and method as ``overhead.py`` (``run_lockstep``: every variant
built afresh each round, turns of 4 steps in an order shuffled for every turn, each variant's
periodic work on its own clock), so the ratios are comparable with its table.

One variant is raw PyTorch's loop with nbaccel's per-step bookkeeping written inline: the same
clock readings (the data's wait, a span around forward, backward and the optimizer's step), the
batch's samples and device checked, the recorder's deadline tested, the accumulation window's
arithmetic, bf16's float32 output. No call of nbaccel's: what the step's own work costs, the
least a step built otherwise could cost.

Two variants sketch a fused step (``Fused``): the same bookkeeping reached through the calls a
user's loop makes to Accelerate's API, one frame each, which is the least any design with that
API and that bookkeeping could cost; then the same sketch finding the data's end from the
loader's length instead of reading a batch ahead, as Accelerate and nbaccel do.

Two more variants calibrate what Python costs in such a step: raw PyTorch's loop plus 30 or
90 calls of small methods (each reads three attributes of its object and makes one small
object), the kind of work a wrapper does. Their cost is measured twice: in the loop, from the
paired ratio, and run hot (the same calls in a tight loop, the usual microbenchmark). The ratio
of the two says how much more a wrapper's Python costs between a real step's compute, which
leaves the caches cold, than a microbenchmark says.

A variant's cost in microseconds a step: ``(1 / ratio - 1)`` times raw PyTorch's time per step
in the same round, the median over rounds.

    python benchmarks/overhead_parts.py [--rounds 30] [--modes plain bf16] [--out FILE.json]
    python benchmarks/overhead_parts.py --size lesson  # lesson 5's step (overhead.py's --size)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # its SIZE: make_parts' step
from overhead import (
    MODES,
    accelerator_steps,
    cell,
    machine,
    make_parts,
    nbaccel_loop,
    raw,
    run_lockstep,
    stat,
    step_config,
    step_text,
    write,
)  # fmt: skip

import nbaccel
from nbaccel.accelerator.data.loader import PreparedDataLoader

CALLS = (30, 90)  # the Python calibration's chain lengths


def partly(*parts: str):
    """Raw PyTorch's loop (``overhead.raw``) with nbaccel's ``parts`` swapped in: "loader",
    "bare loader" (no recorder, no breakdown), "optimizer", "model", "backward". It steps as raw
    does, every ``accum``-th micro-batch, without ``accumulate``; the loss is the same."""

    def build(steps: int, accum: int, precision: str, clock=None):
        accelerator = nbaccel.Accelerator(precision, gradient_accumulation_steps=accum, cpu=True)
        if clock is not None:
            clock.pace(accelerator.recorder)
        model, optimizer, loader = make_parts(steps)
        if "model" in parts:
            model = accelerator.prepare(model)  # in bf16 it autocasts its own forward
        if "optimizer" in parts:
            optimizer = accelerator.prepare(optimizer)
        if "loader" in parts:
            loader = accelerator.prepare(loader)
        if "bare loader" in parts:
            prepared = accelerator.prepare(loader)
            loader = PreparedDataLoader(prepared.loader, prepared.device, prepared.state)
        if precision == "bf16" and "model" not in parts:
            autocast = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731 (raw's)
        else:
            autocast = contextlib.nullcontext
        if "backward" in parts:
            backward = accelerator.backward  # divides by accum itself
        else:
            backward = lambda loss: (loss / accum if accum > 1 else loss).backward()  # noqa: E731
        while True:
            for i, (x, y) in enumerate(loader):
                with autocast():
                    loss = F.cross_entropy(model(x), y)
                backward(loss)
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
                yield loss

    return build


def inline(steps: int, accum: int, precision: str):
    """Raw PyTorch's loop doing nbaccel's bookkeeping inline (the module's docstring)."""
    model, optimizer, loader = make_parts(steps)
    clock, deadline_clock = time.perf_counter, time.monotonic
    data = compute = 0.0
    samples = optimizer_steps = micro = 0
    deadline = deadline_clock() + 0.25
    cpu = torch.device("cpu")
    while True:
        asked = clock()
        for x, y in loader:
            if x.device != cpu or y.device != cpu:
                raise AssertionError("the batch left the CPU")
            data += clock() - asked
            samples += x.shape[0] if x.dim() else 1
            if deadline_clock() >= deadline:
                deadline = deadline_clock() + 0.25
            micro += 1
            began = clock()
            if precision == "bf16":
                with torch.autocast("cpu", torch.bfloat16):
                    out = model(x)
                out = out.float()
            else:
                out = model(x)
            compute += clock() - began
            loss = F.cross_entropy(out, y)
            began = clock()
            (loss / accum if accum > 1 else loss).backward()
            compute += clock() - began
            if micro % accum == 0:
                began = clock()
                optimizer.step()
                compute += clock() - began
                optimizer_steps += 1
                if deadline_clock() >= deadline:
                    deadline = deadline_clock() + 0.25
                optimizer.zero_grad()
            yield loss
            asked = clock()


class Fused:
    """The least a step through Accelerate's calls could cost: ``inline``'s bookkeeping,
    reached through the calls a user's loop makes (``accumulate`` and its block, ``backward``,
    the optimizer's ``step`` and ``zero_grad``, the loader's ``next``, the model's forward),
    each one frame that does its part of the work itself, on one object's attributes. No
    separate window, recorder, breakdown or strategy: a sketch of a fused step, not nbaccel."""

    def __init__(
        self, model, optimizer, loader, accum: int, precision: str, read_ahead: bool = True
    ) -> None:
        self.optimizer, self.loader = optimizer, loader
        self.read_ahead = read_ahead  # False: the data's end from the loader's length
        self.accum, self.bf16 = accum, precision == "bf16"
        self.clock, self.deadline_clock = time.perf_counter, time.monotonic
        self.data = self.compute = 0.0
        self.samples = self.optimizer_steps = self.micro = 0
        self.deadline = self.deadline_clock() + 0.25
        self.cpu = torch.device("cpu")
        self.sync_gradients, self.holds_gradients, self.end = True, False, False
        self.forward, model.forward = model.forward, self.timed_forward

    def __iter__(self):  # one pass of the loader
        clock, cpu = self.clock, self.cpu
        asked = clock()
        batches = iter(self.loader)
        current = next(batches, None)
        left = len(self.loader)
        while current is not None:
            left -= 1
            if self.read_ahead:  # as Accelerate and nbaccel find the data's end
                following = next(batches, None)
                self.end = following is None
            else:  # counted: the next batch is made when it is asked for, as raw's is
                self.end = left == 0
            x = current[0]
            for t in current:
                if t.device != cpu:
                    raise AssertionError("the batch left the CPU")
            self.data += clock() - asked
            self.samples += x.shape[0] if x.dim() else 1
            if self.deadline_clock() >= self.deadline:
                self.deadline = self.deadline_clock() + 0.25
            yield current
            asked = clock()
            current = following if self.read_ahead else next(batches, None)

    def timed_forward(self, *args):
        began = self.clock()
        if self.bf16:
            with torch.autocast("cpu", torch.bfloat16):
                out = self.forward(*args)
            out = out.float() if out.is_floating_point() else out
        else:
            out = self.forward(*args)
        self.compute += self.clock() - began
        return out

    def accumulate(self, model):
        return self

    def __enter__(self) -> None:
        if self.end:
            self.micro, self.sync_gradients = 0, True
        else:
            self.micro += 1
            self.sync_gradients = self.micro % self.accum == 0

    def __exit__(self, *exc) -> None:
        return None

    def backward(self, loss) -> None:
        if not self.sync_gradients:
            self.holds_gradients = True
        began = self.clock()
        (loss / self.accum if self.accum > 1 else loss).backward()
        self.compute += self.clock() - began

    def step(self) -> None:
        if not self.sync_gradients:
            return
        began = self.clock()
        self.optimizer.step()
        self.compute += self.clock() - began
        self.holds_gradients = False
        self.optimizer_steps += 1
        if self.deadline_clock() >= self.deadline:
            self.deadline = self.deadline_clock() + 0.25

    def zero_grad(self) -> None:
        if not self.holds_gradients:
            self.optimizer.zero_grad()


def fused(read_ahead: bool = True):
    """``overhead.accelerator_steps``' loop, as its user writes it, on ``Fused``."""

    def build(steps: int, accum: int, precision: str):
        model, optimizer, loader = make_parts(steps)
        step = Fused(model, optimizer, loader, accum, precision, read_ahead)
        return accelerator_steps(step, model, step, step)  # the Accelerator, optimizer, loader

    return build


def python_chain(length: int):
    """``length`` calls, each a method of its own small class that reads three attributes of
    its object, makes one small object and calls the next: a wrapper's kind of Python."""
    source = []
    for i in range(length):
        source.append(
            f"class Made{i}:\n    __slots__ = ()\n"
            f"class Part{i}:\n"
            f"    def __init__(self, following):\n"
            f"        self.a, self.b, self.c, self.following = {i}, [{i}], {{}}, following\n"
            f"    def __call__(self, x):\n"
            f"        Made{i}()\n"
            f"        return self.following(x + self.a + self.b[0] + len(self.c))\n"
        )
    names: dict = {}
    exec("\n".join(source), names)  # distinct classes: distinct code and attribute lookups
    call = lambda x: x  # noqa: E731
    for i in reversed(range(length)):
        call = names[f"Part{i}"](call)
    return call


def with_python(length: int):
    """Raw PyTorch's loop plus ``python_chain(length)`` once a step."""

    def build(steps: int, accum: int, precision: str):
        chain = python_chain(length)
        for loss in raw(steps, accum, precision):
            chain(0)
            yield loss

    return build


def hot_us(length: int, calls: int = 20000, repeats: int = 7) -> float:
    """The chain's cost run hot, in microseconds: the median of ``repeats`` timings."""
    chain = python_chain(length)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            chain(0)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def variants() -> dict:
    return {
        "raw": raw,
        "raw again": raw,
        **{f"raw + {n} Python calls": with_python(n) for n in CALLS},
        "raw + nbaccel's bookkeeping inline": inline,
        "a fused step through Accelerate's calls": fused(),
        "the same, without reading ahead": fused(read_ahead=False),
        "prepared DataLoader": partly("loader"),
        "prepared DataLoader, no recorder or breakdown": partly("bare loader"),
        "prepared optimizer": partly("optimizer"),
        "prepared model": partly("model"),
        "accelerator.backward": partly("backward"),
        "all but accumulate": partly("loader", "optimizer", "model", "backward"),
        "nbaccel": nbaccel_loop,
    }


def added_us(result: dict, name: str) -> dict:
    """Microseconds a step that ``name`` adds to raw PyTorch's step, paired by round."""
    mine = result["variants"][name]["per_round_steps_per_s"]
    base = result["variants"]["raw"]["per_round_steps_per_s"]
    return stat([(1 / m - 1 / b) * 1e6 for m, b in zip(mine, base, strict=True)], 1)


def to_markdown(report: dict) -> str:
    m = report["machine"]
    step = f", {step_text(report['config'])}" if "config" in report else ""
    lines = [
        f"CPU: {m['cpu']}, {m['cores']} cores; torch.set_num_threads({m['threads']}); "
        f"torch {m['torch']}; Python {m['python']}; nbaccel {m['nbaccel']}; {m['date']}; "
        f"1-min load {report['load']['before']:.1f} before, {report['load']['after']:.1f} after.",
        f"{report['rounds']} rounds; `overhead.py`'s loop and method{step}. Median (IQR) over "
        "rounds.",
        "",
        "| mode | variant | ratio to raw | added per step, us |",
        "|---|---|---:|---:|",
    ]
    for mode, result in report["modes"].items():
        for name, r in result["variants"].items():
            added = "-" if name == "raw" else cell(result["added_us"][name], 1)
            lines.append(f"| {mode} | {name} | {cell(r['ratio'], 3)} | {added} |")
    mode = "plain" if "plain" in report["modes"] else next(iter(report["modes"]))
    chosen = report["modes"][mode]
    lines += ["", f"Python calibration: the same chain run hot, and in the loop ({mode}):", ""]
    lines += [
        "| calls | hot, us | in the loop, us | in the loop over hot |",
        "|---:|---:|---:|---:|",
    ]
    for n in CALLS:
        hot, in_loop = report["hot_us"][str(n)], chosen["added_us"][f"raw + {n} Python calls"]
        lines.append(f"| {n} | {hot:.1f} | {cell(in_loop, 1)} | {in_loop['median'] / hot:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", choices=list(overhead.SIZES), default="benchmark")
    parser.add_argument("--out", help="JSON file (default: results/overhead-parts[-SIZE]-cpu.json)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2, for a median and quartiles")
    overhead.SIZE = args.size  # make_parts' step
    torch.set_num_threads(args.threads)
    report = {"machine": machine(args.threads), "rounds": args.rounds, "modes": {}}
    report["config"] = step_config(args.size)
    report["load"] = {"before": os.getloadavg()[0]}
    report["hot_us"] = {str(n): round(hot_us(n), 2) for n in CALLS}
    for mode in args.modes:
        result = run_lockstep(mode, variants(), args.rounds, None)
        result["added_us"] = {name: added_us(result, name) for name in result["variants"]}
        report["modes"][mode] = result
    report["load"]["after"] = os.getloadavg()[0]
    size = "" if args.size == "benchmark" else f"-{args.size}"
    out = Path(args.out or f"benchmarks/results/overhead-parts{size}-cpu.json")
    write(out, report, to_markdown(report), "Per-step cost, part by part,")


if __name__ == "__main__":
    main()
