"""What does the Accelerator cost per training step? Raw PyTorch versus nbaccel, on one CPU.

One small training loop (an MLP 512 wide, batch 64, SGD, synthetic data in memory, iterated
through a DataLoader) is written once per framework, as its user would write it, and timed in
three modes: "plain" (float32), "accumulation 4" (a real step every 4th micro-batch) and "bf16"
(autocast). HF Accelerate and Lightning Fabric join as extra columns when they are installed
(`pip install -c constraints.txt -e '.[bench]'`). ``--size lesson`` times the same modes on
lesson 5's step instead (``MLP(64, 256, 10)``, batch 32, SGD with momentum 0.9; about a quarter
of the benchmark's step on a CPU): the steps the lessons train, where a fixed cost per step is a
larger share.

The machine may be shared and noisy, so every variant runs in this one process, and the
variants take turns a few steps at a time. Each round builds every variant afresh (the same
weights and data), then runs N steps of each, 4 at a turn (one accumulation window), in an order
shuffled anew for every turn: none always follows the same variant, and a slow moment of the
machine falls on all of them alike. Each round gives a paired ratio: a variant's steps/s over
raw PyTorch's in the same round. We report the median ratio, the median steps/s, and the
interquartile range (IQR) of both, in wall time (``perf_counter``) and in this thread's CPU time
(``thread_time``: the loop runs on one thread, and its CPU time leaves out the time other
programs held the core). "raw again", a second copy of the raw loop, shows how far from 1 a
ratio strays with no difference in the code at all. nbaccel's recorder does its periodic work
(the counters and the progress line, every quarter second) on the variant's own running time
(``OwnClock.pace``), as it would in a loop that runs alone: on the wall clock, the other variants'
turns would bring that work round about as many times as often per step as there are variants.

The time breakdown (``nbaccel.observe.breakdown``, on by default) is measured as a pair: "nbaccel"
with it and "nbaccel, no breakdown" (``NBACCEL_BREAKDOWN=0``), and the paired ratio of the two in
each round is the breakdown's cost (reported below the table).

The experiment trackers are measured in whole passes, in the "plain" mode (a tracker's
background work is waited for at a pass's end): nbaccel's loop logging
its loss every step, as the live view's users do (``accelerator.log({"loss": loss})``), with
``log_with`` one tracker (TensorBoard, MLflow, wandb offline: those installed, each writing into
a temporary folder) against the same loop without one ("no tracker"; "no tracker again" is its
noise floor). The variants take turns a pass each, the first one rotating each round; each
pass ends by waiting for the tracker's background work on it (TensorBoard's writer thread,
MLflow's queue), so that work is counted in its own trial. The loop also times its
``log`` calls: what a tracker adds to one call, in microseconds, and as a share of a step.

    python benchmarks/overhead.py [--rounds 25] [--steps N] [--threads 1] [--out FILE.json]
    python benchmarks/overhead.py --only trackers   # the trackers alone: results/trackers-cpu
    python benchmarks/overhead.py --only modes --before REV  # nbaccel at REV beside this one
    python benchmarks/overhead.py --only modes --size lesson  # lesson 5's smaller step
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import functools
import importlib
import inspect
import io
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
from nbaccel.env import BREAKDOWN_VAR
from nbaccel.lessons import MLP
from nbaccel.observe.trackers.general import installed

MODES = {"plain": (1, "no"), "accumulation 4": (4, "no"), "bf16": (1, "bf16")}  # accum, precision
WIDTH, BATCH, LR = 512, 64, 1e-3
SIZES = {  # the step measured: inputs, hidden width, batch, SGD's lr and momentum
    "benchmark": (WIDTH, WIDTH, BATCH, LR, 0.0),  # the loop issue 36's 0.99 is judged on
    "lesson": (64, 256, 32, 0.05, 0.9),  # lesson 5's: MLP(64, 256, 10) on the digits' shape
}
SIZE = "benchmark"  # main's --size
REBUILD = 5  # rounds between fresh models, optimizers and loaders (the trackers' trials)
BLOCK = 4  # steps a variant runs at each of its turns: one window of accumulation 4


def make_parts(steps: int):
    """The same model (same initial weights), optimizer and data for every variant."""
    inputs, width, batch, lr, momentum = SIZES[SIZE]
    torch.manual_seed(0)
    model = MLP(inputs, width, 10)  # Linear, ReLU, Linear, ReLU, Linear
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    data = TensorDataset(torch.randn(steps * batch, inputs), torch.randint(0, 10, (steps * batch,)))
    return model, optimizer, DataLoader(data, batch_size=batch)


def step_config(size: str) -> dict:
    """What ``make_parts`` builds at ``size``, as a result records it."""
    inputs, width, batch, lr, momentum = SIZES[size]
    optimizer = f"SGD(lr={lr}, momentum={momentum})" if momentum else f"SGD(lr={lr})"
    return {"size": size, "inputs": inputs, "width": width, "batch": batch, "optimizer": optimizer}


def step_text(c: dict) -> str:
    """``step_config``'s step in words, for a result's header."""
    return (
        f"MLP {c['width']} wide, {c['inputs']} inputs ({c['size']}'s step), batch {c['batch']}, "
        f"{c['optimizer']}"
    )


def raw(steps: int, accum: int, precision: str):
    """Raw PyTorch's loop, one micro-batch per ``next``, which returns its loss; the loader's
    passes follow each other without end (a pass is ``steps`` micro-batches)."""
    model, optimizer, loader = make_parts(steps)
    # No autocast at all in float32: even a disabled one costs ~10 us per step.
    bf16 = precision == "bf16"
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16)) if bf16 else contextlib.nullcontext
    while True:
        for i, (x, y) in enumerate(loader):
            with autocast():
                loss = F.cross_entropy(model(x), y)
            (loss / accum if accum > 1 else loss).backward()
            if (i + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
            yield loss


def accelerator_steps(accelerator, model, optimizer, loader):
    """One loop for nbaccel and HF Accelerate (that is the point of sharing the API), one
    micro-batch per ``next``, without end."""
    while True:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            yield loss


def accelerator_epoch(accelerator, model, optimizer, loader):
    """``accelerator_steps`` a pass at a time: a call runs one pass and returns its last loss
    (``gpu.py`` times passes)."""
    steps = accelerator_steps(accelerator, model, optimizer, loader)

    def epoch() -> float:
        for _ in range(len(loader)):
            loss = next(steps)
        return loss.item()

    return epoch


def nbaccel_loop(steps: int, accum: int, precision: str, clock=None, package=nbaccel):
    """nbaccel's loop; ``clock`` (an ``OwnClock``) paces its recorder's quarter-second work.
    ``package``: another copy of nbaccel (``nbaccel_at``)."""
    accelerator = package.Accelerator(precision, gradient_accumulation_steps=accum, cpu=True)
    if clock is not None:
        clock.pace(accelerator.recorder)
    return accelerator_steps(accelerator, *accelerator.prepare(*make_parts(steps)))


class OwnClock:
    """A variant's own running time: it advances only inside ``with clock:`` (the variant's
    turns). nbaccel's recorder does its periodic work (the counters, the progress line) every
    quarter second; on the wall clock, in turns with N variants, that work would fall on a
    loop's steps about N times as often as it does when the loop runs alone. ``pace`` keeps a
    recorder to its variant's own time."""

    def __init__(self) -> None:
        self.elapsed, self._since, self._left = 0.0, None, None
        self._recorder, self._deadline = None, "next_tick"

    def __call__(self) -> float:
        running = 0.0 if self._since is None else time.monotonic() - self._since
        return self.elapsed + running

    def pace(self, recorder) -> None:
        """Hold ``recorder``'s next periodic work back by the time spent outside this clock's
        turns. Its clock stays ``time.monotonic``, as in a user's loop: a Python clock in its
        place would add two Python calls to every step that a user's loop does not make."""
        assert recorder.clock is time.monotonic
        if not hasattr(recorder, "next_tick"):  # nbaccel before c0f79f7 (--before)
            self._deadline = "_next_counters"
        assert hasattr(recorder, self._deadline)
        self._recorder = recorder

    def __enter__(self) -> None:
        self._since = time.monotonic()
        if self._recorder is not None and self._left is not None:
            held = getattr(self._recorder, self._deadline) + self._since - self._left
            setattr(self._recorder, self._deadline, held)  # the others' turns

    def __exit__(self, *exc: object) -> None:
        self._left = time.monotonic()
        self.elapsed += self._left - self._since
        self._since = None


def nbaccel_at(revision: str):
    """nbaccel's loop as it was at git ``revision``, to run beside this one in the same rounds
    (``--before``): its package, taken from git into a temporary folder, is imported as
    ``nbaccel_before`` (the Accelerator's modules import each other relatively)."""
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-before-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    archive = subprocess.run(
        ["git", "archive", revision, "nbaccel"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "nbaccel").rename(folder / "nbaccel_before")
    sys.path.insert(0, str(folder))
    return functools.partial(nbaccel_loop, package=importlib.import_module("nbaccel_before"))


def breakdown_off(off: bool = True):
    """``NBACCEL_BREAKDOWN=0`` while an Accelerator is made (it reads it then), if ``off``;
    the variable as it was afterwards."""
    return mock.patch.dict(os.environ, {BREAKDOWN_VAR: "0"}) if off else contextlib.nullcontext()


def nbaccel_without_breakdown(steps: int, accum: int, precision: str, clock=None):
    """nbaccel with its time breakdown switched off, as ``NBACCEL_BREAKDOWN=0`` does."""
    with breakdown_off():
        return nbaccel_loop(steps, accum, precision, clock)


def accelerate_loop(steps: int, accum: int, precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # its process-wide singletons
    GradientState._reset_state()  # would refuse a new mode
    accelerator = Accelerator(
        mixed_precision=precision, gradient_accumulation_steps=accum, cpu=True
    )
    return accelerator_steps(accelerator, *accelerator.prepare(*make_parts(steps)))


def fabric_loop(steps: int, accum: int, precision: str):
    from lightning.fabric import Fabric

    fabric_precision = "bf16-mixed" if precision == "bf16" else "32-true"
    fabric = Fabric(accelerator="cpu", devices=1, precision=fabric_precision)
    model, optimizer, loader = make_parts(steps)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)

    while True:  # Fabric leaves accumulation to the user, as raw PyTorch does
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0
            with fabric.no_backward_sync(model, enabled=not last):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / accum if accum > 1 else loss)
            if last:
                optimizer.step()
                optimizer.zero_grad()
            yield loss


# The trackers, each by its log_with name, with its init_kwargs: wandb offline, as without an
# account (nothing is sent anywhere).
TRACKERS = {"tensorboard": {}, "mlflow": {}, "wandb": {"mode": "offline"}}
NO_TRACKER = "no tracker"


class LoggingLoop:
    """nbaccel's loop logging its loss every step to the live view and to the ``log_with``
    tracker, in a temporary folder that ``close`` removes. A pass is one epoch, as for the other
    variants; ``log_seconds`` is the time its ``log`` calls took, ``log_cpu_seconds`` the CPU
    time this thread spent in them (which other programs on the machine do not inflate)."""

    def __init__(self, steps: int, accum: int, precision: str, log_with: str | None = None):
        self.folder = tempfile.mkdtemp(prefix="nbaccel-trackers-")
        self.log_with, self.log_seconds, self.log_cpu_seconds = log_with, 0.0, 0.0
        self.accelerator = None
        try:
            self.accelerator = nbaccel.Accelerator(
                precision, gradient_accumulation_steps=accum, cpu=True, log_with=log_with,
                project_dir=self.folder,
            )  # fmt: skip
            with unset("MLFLOW_TRACKING_URI"):  # a local store in the folder, never a server
                self.accelerator.init_trackers(
                    "overhead", config={"width": WIDTH, "batch": BATCH, "lr": LR},
                    init_kwargs={log_with: TRACKERS[log_with]} if log_with else None,
                )  # fmt: skip
            self.parts = self.accelerator.prepare(*make_parts(steps))
        except BaseException:
            self.close()
            raise

    def __call__(self) -> float:
        accelerator, (model, optimizer, loader) = self.accelerator, self.parts
        self.log_seconds = self.log_cpu_seconds = 0.0
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            start, cpu_start = time.perf_counter(), time.thread_time()
            accelerator.log({"loss": loss})
            self.log_seconds += time.perf_counter() - start
            self.log_cpu_seconds += time.thread_time() - cpu_start
        self.drain()
        return loss.item()

    def drain(self) -> None:
        """Wait for the tracker's background work on this pass, so that it counts here and not
        in the next variant's trial. (wandb's work is in its own service process.)"""
        if self.log_with in ("tensorboard", "mlflow"):  # what it keeps back, written now
            self.accelerator.get_tracker(self.log_with).flush()  # (more often than once a second)
        if self.log_with == "mlflow":  # the queue is the client's store's (no public call)
            client = self.accelerator.get_tracker("mlflow", unwrap=True)
            client._tracking_client.store.flush_async_logging()

    def close(self) -> None:
        try:
            if self.accelerator is not None:
                self.accelerator.end_training()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def unset(name: str):
    """``os.environ`` without ``name`` for the block, then as it was."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def tracker_variants() -> dict:
    variants = {NO_TRACKER: LoggingLoop, f"{NO_TRACKER} again": LoggingLoop}
    for name in TRACKERS:
        if installed(name):
            variants[name] = functools.partial(LoggingLoop, log_with=name)
        else:
            print(f"({name} is not installed: its tracker is skipped)")
    return variants


def calibrate(accum: int, precision: str, seconds: float = 0.3) -> int:
    """Steps (a multiple of ``BLOCK``, at least two turns) for raw PyTorch to take about
    ``seconds``."""
    steps = raw(8, accum, precision)
    for _ in range(8):
        next(steps)
    start = time.perf_counter()
    for _ in range(8):
        next(steps)
    return max(2 * BLOCK, BLOCK * round(seconds / ((time.perf_counter() - start) / 8) / BLOCK))


def stat(xs: list[float], digits: int) -> dict:
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": round(median, digits), "iqr": [round(q1, digits), round(q3, digits)]}


def run_lockstep(mode: str, variants: dict, rounds: int, steps: int | None) -> dict:
    """The three modes, each round's variants built afresh and run in ``turns``. A round
    gives each variant its steps/s, in wall time and in this thread's CPU time."""
    accum, precision = MODES[mode]
    steps = steps or calibrate(accum, precision)
    order = random.Random(0)  # the same order in every run
    wall: dict[str, list[float]] = {name: [] for name in variants}  # steps/s, one per round
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    last = {}
    for _ in range(rounds):
        clocks = {name: OwnClock() for name in variants}
        runs = {name: build_with(build, clocks[name], steps, accum, precision)
                for name, build in variants.items()}  # fmt: skip
        warm_up(runs)
        seconds = dict.fromkeys(runs, 0.0)
        cpu_seconds = dict.fromkeys(runs, 0.0)
        for name in turns(runs, steps, order):
            run = runs[name]
            start, cpu_start = time.perf_counter(), time.thread_time()
            with clocks[name]:
                for _ in range(BLOCK):
                    last[name] = next(run)
            seconds[name] += time.perf_counter() - start
            cpu_seconds[name] += time.thread_time() - cpu_start
        for name in variants:
            wall[name].append(steps / seconds[name])
            cpu[name].append(steps / cpu_seconds[name])
    loss = {name: value.item() for name, value in last.items()}  # after the same steps
    return summarize(variants, steps, "raw", wall, cpu, loss)


def build_with(build, clock: OwnClock, steps: int, accum: int, precision: str):
    """``build``'s loop, paced by ``clock`` where it does periodic work (takes a ``clock``)."""
    if "clock" in inspect.signature(build).parameters:
        return build(steps, accum, precision, clock=clock)
    return build(steps, accum, precision)


def warm_up(runs: dict) -> None:
    """Two turns of each run, not timed: the allocator, autograd's graph, autocast's caches."""
    for run in runs.values():
        for _ in range(2 * BLOCK):
            next(run)


def turns(runs: dict, steps: int, order: random.Random) -> Iterator[str]:
    """The method for a noisy machine: each run's name at each of its ``steps // BLOCK`` turns
    (the caller runs ``BLOCK`` steps of it), in an order shuffled anew for every turn. No run
    always follows the same one (what ran before leaves the caches in its own state), and each
    one's steps are spread over the whole round, so a slow moment of the machine falls on all
    of them alike. The callers build the runs afresh for every round: where their memory lies
    moves a loop's speed by 1-3%, so a round is one draw of that luck for each."""
    names = list(runs)
    for _ in range(steps // BLOCK):
        order.shuffle(names)
        yield from names


def run_trials(
    mode: str, variants: dict, rounds: int, steps: int | None, baseline: str = NO_TRACKER
) -> dict:
    """The trackers: every variant runs a pass over its loader once a round, round-robin (a
    pass ends by waiting for the tracker's background work); ratios are over ``baseline`` in
    the same round, and the variants' ``log`` calls are timed too (``log_seconds``)."""
    accum, precision = MODES[mode]
    steps = steps or calibrate(accum, precision)
    wall: dict[str, list[float]] = {name: [] for name in variants}  # steps/s, one per round
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    log_us: dict[str, list[float]] = {name: [] for name in variants}  # per log call
    log_cpu_us: dict[str, list[float]] = {name: [] for name in variants}
    loss, epochs = {}, {}
    try:
        for r in range(rounds):
            if r % REBUILD == 0:  # fresh objects: where their memory lies moves speed by ~1%
                close(epochs)
                epochs = {}
                for name, build in variants.items():
                    epochs[name] = build(steps, accum, precision)
                for epoch in epochs.values():
                    epoch()  # warm-up: allocator, autograd graph, autocast caches
            for name in list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]:
                start, cpu_start = time.perf_counter(), time.process_time()
                loss[name] = epochs[name]()
                wall[name].append(steps / (time.perf_counter() - start))
                cpu[name].append(steps / (time.process_time() - cpu_start))
                log_us[name].append(epochs[name].log_seconds / steps * 1e6)
                log_cpu_us[name].append(epochs[name].log_cpu_seconds / steps * 1e6)
    finally:
        close(epochs)
    return summarize(variants, steps, baseline, wall, cpu, loss, log_us, log_cpu_us)


def summarize(
    variants: dict,
    steps: int,
    baseline: str,
    wall: dict,
    cpu: dict,
    loss: dict,
    log_us: dict | None = None,
    log_cpu_us: dict | None = None,
) -> dict:
    """Per variant: medians and IQRs of its steps/s and of its paired ratios to ``baseline``;
    the breakdown's cost (on over off); nbaccel over nbaccel at ``--before``; and for the
    trackers what each adds to a log call."""
    log_us, log_cpu_us = log_us or {}, log_cpu_us or {}

    def over_base(xs: dict, name: str) -> list[float]:
        return [x / b for x, b in zip(xs[name], xs[baseline], strict=True)]

    def added(xs: dict, name: str) -> list[float]:
        return [x - b for x, b in zip(xs[name], xs[baseline], strict=True)]

    results = {}
    for name in variants:
        results[name] = {
            "steps_per_s": stat(wall[name], 1),
            "ratio": stat(over_base(wall, name), 4),
            "cpu_time_ratio": stat(over_base(cpu, name), 4),
            "last_loss": round(loss[name], 4),  # equal across variants: the same math
            "per_round_steps_per_s": [round(x, 1) for x in wall[name]],
        }
        if log_us.get(name):
            results[name]["log_call_us"] = stat(log_us[name], 1)
            results[name]["log_call_cpu_us"] = stat(log_cpu_us[name], 1)
    pair = "nbaccel", "nbaccel, no breakdown"
    out = {"steps_per_trial": steps, "baseline": baseline, "variants": results}
    if all(name in variants for name in pair):  # the breakdown's cost: on over off, paired
        out["breakdown_on_over_off"] = paired(wall, *pair)
        out["breakdown_cpu_on_over_off"] = paired(cpu, *pair)
    for before in [name for name in variants if name.startswith("nbaccel at ")]:  # --before
        out["now_over_before"] = {"before": before, "wall": paired(wall, "nbaccel", before),
                                  "cpu": paired(cpu, "nbaccel", before)}  # fmt: skip
    # what each variant adds to a log call, paired, and its share of a step
    if log_us.get(baseline):
        out["log_call_cost"] = {
            name: {
                "extra_us": stat(added(log_us, name), 1),
                "extra_cpu_us": stat(added(log_cpu_us, name), 1),
                # in CPU time, which the machine's other programs do not inflate
                "share_of_step": stat(
                    [
                        x * 1e-6 * s
                        for x, s in zip(added(log_cpu_us, name), cpu[baseline], strict=True)
                    ],
                    4,
                ),
            }
            for name in variants
            if log_us.get(name) and name != baseline
        }
    return out


def close(epochs: dict) -> None:
    """Finish the variants that hold something (a tracker's run, its folder): all of them,
    even when one fails."""
    with contextlib.ExitStack() as stack:
        for epoch in epochs.values():
            if hasattr(epoch, "close"):
                stack.callback(epoch.close)


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


def paired(rates: dict[str, list[float]], name: str, other: str) -> dict:
    """``name``'s steps/s over ``other``'s, round by round: their median and IQR."""
    return stat([a / b for a, b in zip(rates[name], rates[other], strict=True)], 4)


def paired_cells(modes: dict, wall: str | tuple, cpu: str | tuple) -> list[str]:
    """ "<mode> <median (IQR)> wall, <...> CPU time" for each mode whose results hold the paired
    statistics at keys ``wall`` and ``cpu`` (a key, or a path of keys)."""

    def at(result: dict, key: str | tuple) -> dict | None:
        for k in (key,) if isinstance(key, str) else key:
            result = result.get(k) if result is not None else None
        return result

    return [
        f"{mode} {cell(at(r, wall), 4)} wall, {cell(at(r, cpu), 4)} CPU time"
        for mode, r in modes.items()
        if at(r, wall) is not None
    ]


def cell(s: dict, digits: int) -> str:
    (q1, q3), f = s["iqr"], f".{digits}f"
    return f"{s['median']:{f}} ({q1:{f}}-{q3:{f}})"


def to_markdown(report: dict) -> str:
    m, c, load = report["machine"], report["config"], report["load"]
    lines = [
        f"CPU: {m['cpu']}, {m['cores']} cores; torch.set_num_threads({m['threads']}); "
        f"torch {m['torch']}; Python {m['python']}; nbaccel {m['nbaccel']}; {m['date']}; "
        f"1-min load {load['before']:.1f} before, {load['after']:.1f} after.",
        f"{step_text(c)}; {c['rounds']} rounds of N steps per variant. Ratio: variant / "
        "baseline steps/s in the same round. Median (IQR).",
    ]
    if report["modes"]:
        lines.append(
            f"Modes: each round builds every variant afresh; they take turns {BLOCK} steps at a "
            "time, in an order shuffled for every turn. Ratio in wall time; CPU-time ratio in "
            "this thread's CPU time (the loop's one thread)."
        )
    if report["modes"]:
        lines += ["", *table(report["modes"], "raw")]
        modes = report["modes"]
        costs = paired_cells(modes, "breakdown_on_over_off", "breakdown_cpu_on_over_off")
        if costs:
            heading = "Time breakdown, steps/s with it over without (paired): "
            lines += ["", heading + "; ".join(costs)]
        changes = paired_cells(modes, ("now_over_before", "wall"), ("now_over_before", "cpu"))
        if changes:
            before = next(iter(modes.values()))["now_over_before"]["before"]
            lines += ["", f"This nbaccel over {before}, steps/s (paired): " + "; ".join(changes)]
    if "trackers" in report:
        lines += ["", *trackers_markdown(report["trackers"], report.get("versions", {}))]
    return "\n".join(lines) + "\n"


def table(modes: dict, baseline: str) -> list[str]:
    lines = [
        f"| mode | variant | steps/s | ratio to {baseline} | CPU-time ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for mode, result in modes.items():
        for name, r in result["variants"].items():
            lines.append(
                f"| {mode} (N={result['steps_per_trial']}) | {name} | {cell(r['steps_per_s'], 1)}"
                f" | {cell(r['ratio'], 3)} | {cell(r['cpu_time_ratio'], 3)} |"
            )
    return lines


def trackers_markdown(result: dict, versions: dict) -> list[str]:
    libraries = ", ".join(f"{name} {version}" for name, version in versions.items())
    lines = [
        f"Experiment trackers ({libraries}): the plain loop with "
        '`accelerator.log({"loss": loss})` every step, with `log_with` one tracker or none. '
        "A pass ends when the tracker's background work on it is done (TensorBoard, MLflow).",
        "",
        *table({"plain": result}, NO_TRACKER),
        "",
        "Time in the `log` calls alone, per call (wall, and this thread's CPU), and what the "
        "tracker adds to it, paired by round; its share: the added CPU time over a step's CPU "
        "time without a tracker. Background work (writer threads, wandb's service) is not in it.",
        "",
        "| variant | one `log` call, us | its CPU, us | added, us | added CPU, us | added CPU, "
        "share of a step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    cost = result["log_call_cost"]
    for name, r in result["variants"].items():
        added = cost.get(name)
        lines.append(
            f"| {name} | {cell(r['log_call_us'], 1)} | {cell(r['log_call_cpu_us'], 1)} | "
            + (f"{cell(added['extra_us'], 1)} | {cell(added['extra_cpu_us'], 1)} | "
               f"{cell(added['share_of_step'], 4)} |" if added else "- | - | - |")
        )  # fmt: skip
    return lines


def mode_variants(before: str | None = None) -> dict:
    # "raw again" is a second, identical raw loop: how far its ratio strays from 1 is the noise.
    variants = {
        "raw": raw,
        "raw again": raw,
        "nbaccel": nbaccel_loop,
        "nbaccel, no breakdown": nbaccel_without_breakdown,
    }
    if before is not None:
        variants[f"nbaccel at {before}"] = nbaccel_at(before)
    for name, module, loop in [("accelerate", "accelerate", accelerate_loop),
                               ("fabric", "lightning.fabric", fabric_loop)]:  # fmt: skip
        try:
            __import__(module)
            variants[name] = loop
        except ImportError:
            print(f"({name} is not installed: column skipped)")
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds per mode")
    parser.add_argument("--steps", type=int, help="steps per trial (default: ~0.3 s of raw)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--only", choices=["modes", "trackers"], help="one part: the three modes, or the trackers"
    )
    parser.add_argument(
        "--out", help="JSON file (default: results/overhead-cpu.json, or trackers-cpu.json)"
    )
    parser.add_argument(
        "--before", metavar="REV", help="the modes: also nbaccel at git revision REV, paired"
    )
    parser.add_argument(
        "--size", choices=list(SIZES), default="benchmark",
        help="the modes' step: the benchmark's, or lesson 5's (results/overhead-lesson-cpu)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2, for a median and quartiles")
    if args.steps is not None and (args.steps < BLOCK or args.steps % BLOCK):
        parser.error(
            f"--steps must be a multiple of {BLOCK}: the variants take turns {BLOCK} steps at a "
            "time, and every accumulation window is full"
        )
    if args.size != "benchmark" and args.only != "modes":
        parser.error(f"--size {args.size} measures the modes alone: add --only modes")
    global SIZE
    SIZE = args.size
    torch.set_num_threads(args.threads)
    config = {**step_config(SIZE), "rounds": args.rounds}
    load = {"before": os.getloadavg()[0]}
    report = {"machine": machine(args.threads), "config": config, "load": load, "modes": {}}
    if args.only != "trackers":
        variants = mode_variants(args.before)
        for mode in MODES:
            report["modes"][mode] = run_lockstep(mode, variants, args.rounds, args.steps)
    if args.only != "modes":
        trackers = tracker_variants()
        report["versions"] = {n: __import__(n).__version__ for n in TRACKERS if n in trackers}
        report["trackers"] = run_trials("plain", trackers, args.rounds, args.steps)
    load["after"] = os.getloadavg()[0]
    name = "trackers-cpu.json" if args.only == "trackers" else "overhead-cpu.json"
    if SIZE != "benchmark":
        name = f"overhead-{SIZE}-cpu.json"
    title = "Experiment trackers' cost" if args.only == "trackers" else "Training-loop overhead"
    write(Path(args.out or Path("benchmarks/results") / name), report, to_markdown(report), title)


def write(out: Path, report: dict, text: str, title: str) -> None:
    """Print the Markdown table, and write the report as JSON to ``out`` and the table, under
    ``title``, beside it (``.md``)."""
    print("\n" + text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"# {title} on CPU\n\n" + text)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
