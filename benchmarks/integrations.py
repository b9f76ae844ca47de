"""What do nbaccel's integrations for loops that are not nbaccel's cost a training step?

Two loops that nbaccel does not run, each timed with and without its integration, in this one
process (no launcher: world size 1, on the CPU):

* **HF Accelerate**: ``accelerate.Accelerator(cpu=True)``, ``prepare(model, optimizer, loader)``,
  ``accumulate``, ``backward`` and ``accelerator.log({"loss": loss.item()})`` every step, on
  ``overhead.py``'s MLP (512-512-10, batch 64, SGD). "accelerate" has no tracker;
  "accelerate + LiveTracker + watch" has ``log_with=LiveTracker()``, ``init_trackers`` and,
  after ``prepare``, ``loader = LiveTracker.watch(accelerator, model, optimizer, loader)``.
* **transformers' Trainer**: a tiny BERT built from a config (2 layers, 32 wide, sequences of
  32 tokens, vocabulary 100, batch 8, synthetic token ids from a seeded generator), Trainer
  logging every step; "Trainer" has no callback of ours, "Trainer + LiveCallback" has
  ``callbacks=[LiveCallback()]``.

Both integrations run as a script's user gets them: with no launcher, the recorder keeps the
run and draws nbaccel's progress line on stderr (the time breakdown on, its default).

Method, as in ``overhead.py``: the variants take turns round-robin, the first one rotating each
round, and a second copy of the plain loop ("... again") is the noise floor. The figure of
merit is the median of per-round paired ratios (a variant's steps/s over the plain loop's in
the same round) with its interquartile range (IQR), in wall time and in process CPU time.

* Accelerate: a trial is one pass over the loader (N steps); every 5 rounds all variants are
  built afresh (Accelerate's process-wide state reset first), each followed by one untimed
  pass. The loop also reads the clock at each step's end (every variant alike), for the median
  step, and around ``accelerator.log``, for what the tracker adds to a call.
* Trainer: every trial builds its Trainer afresh, untimed; a callback of the benchmark's own,
  first in every variant's list, reads the clocks at each ``on_step_end``, and steps/s is over
  the steps after the first few (so neither Trainer's start-up nor its end is in it).

Steps/s is the whole timed span over its steps, so work done every quarter second (the
recorder's counters, the progress line) is in it; the median step (wall, and this thread's CPU
time) leaves that out. Trainer's own printing of its logs goes to /dev/null in every variant.

A cost of 1% of a step is smaller than what a step's speed varies by on a shared machine (and
between two builds of the same model: where its memory lies), so each part ends with a direct
measure, in extra runs that are in no ratio: the CPU time this thread spends inside the
integration's own code, each part of it wrapped with a timer (the watch's hooks, its loader's
``next`` less the prepared loader's, ``LiveTracker.log``; ``LiveCallback``'s methods and its
forward pre-hook), per step and as a share of the plain loop's median step. It is a lower
bound: what having a hook at all costs torch's or Trainer's dispatch is not in it.

    python benchmarks/integrations.py [--rounds 50] [--trainer-rounds 30] [--only accelerate]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import inspect
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import REBUILD, cell, machine, make_parts, stat, write  # the same loop and machine

import nbaccel

STEPS, TRAINER_STEPS, TRAINER_SKIP = 80, 60, 10  # Trainer: steps per run, first ones untimed
ATTRIBUTION_PASSES, ATTRIBUTION_RUNS = 10, 5  # Accelerate's passes, Trainer's runs
BERT = {
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}
SEQUENCE, TRAINER_BATCH = 32, 8


def reset_accelerate() -> None:
    """Accelerate keeps its state in process-wide singletons: forget it before a new build."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class AccelerateLoop:
    """One variant's Accelerate loop; a call is one pass over the loader, returning its
    clocks: wall and this thread's CPU at the start and at each step's end, and the time in
    ``accelerator.log`` calls."""

    def __init__(self, steps: int, live: bool) -> None:
        from accelerate import Accelerator

        from nbaccel import LiveTracker

        self.accelerator = Accelerator(cpu=True, log_with=LiveTracker() if live else None)
        try:
            if live:
                self.accelerator.init_trackers("bench")
            model, optimizer, loader = self.accelerator.prepare(*make_parts(steps))
            if live:
                loader = LiveTracker.watch(self.accelerator, model, optimizer, loader)
        except BaseException:
            self.close()
            raise
        self.parts = model, optimizer, loader

    def __call__(self) -> dict:
        accelerator, (model, optimizer, loader) = self.accelerator, self.parts
        clock, cpu_clock = time.perf_counter, time.thread_time
        wall, cpu = [clock()], [cpu_clock()]
        log_seconds = log_cpu_seconds = 0.0
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            value = loss.item()
            start, cpu_start = clock(), cpu_clock()
            accelerator.log({"loss": value})
            end, cpu_end = clock(), cpu_clock()
            log_seconds += end - start
            log_cpu_seconds += cpu_end - cpu_start
            wall.append(end)
            cpu.append(cpu_end)
        return {"wall": wall, "cpu": cpu, "log": log_seconds, "log_cpu": log_cpu_seconds,
                "loss": value}  # fmt: skip

    def close(self) -> None:
        self.accelerator.end_training()  # the tracker's finish: the recorder's last line


ACCELERATE = {
    "accelerate": False,
    "accelerate again": False,
    "accelerate + LiveTracker + watch": True,
}


def run_accelerate(rounds: int, steps: int) -> dict:
    names = list(ACCELERATE)
    trials: dict[str, list[dict]] = {name: [] for name in names}
    loops: dict[str, AccelerateLoop] = {}
    try:
        for r in range(rounds):
            if r % REBUILD == 0:  # fresh objects: where their memory lies moves speed by ~1%
                close_all(loops)
                loops = {}
                reset_accelerate()
                for name in names:
                    loops[name] = AccelerateLoop(steps, ACCELERATE[name])
                for loop in loops.values():
                    loop()  # warm-up: allocator, autograd graph, the live view's imports
            for name in names[r % len(names) :] + names[: r % len(names)]:
                gc.collect()  # the last trial's garbage, collected outside every timer
                start, cpu_start = time.perf_counter(), time.process_time()
                clocks = loops[name]()
                trial = {
                    "steps_per_s": steps / (time.perf_counter() - start),
                    "cpu_steps_per_s": steps / (time.process_time() - cpu_start),
                    **step_medians(clocks["wall"], clocks["cpu"]),
                    "log_us": 1e6 * clocks["log"] / steps,
                    "log_cpu_us": 1e6 * clocks["log_cpu"] / steps,
                    "loss": clocks["loss"],
                }
                trials[name].append(trial)
    finally:
        close_all(loops)
        reset_accelerate()
    result = summarise(trials)
    base = trials[names[0]]
    for name in names:
        for key in ("log_us", "log_cpu_us"):
            result["variants"][name][key] = stat([t[key] for t in trials[name]], 1)
            added = [t[key] - b[key] for t, b in zip(trials[name], base, strict=True)]
            result["variants"][name][key.replace("_us", "_added_us")] = stat(added, 1)
    return {"steps_per_trial": steps, **result}


def close_all(loops: dict) -> None:
    with contextlib.ExitStack() as stack:  # every one, even when one fails
        for loop in loops.values():
            stack.callback(loop.close)


def step_medians(wall: list[float], cpu: list[float]) -> dict:
    """The median step, in wall time and in this thread's CPU time: what every step pays,
    without what a few pay (a quarter-second tick, a collection, another program's turn)."""
    return {
        "step_ms": 1e3 * statistics.median(b - a for a, b in itertools.pairwise(wall)),
        "step_cpu_us": 1e6 * statistics.median(b - a for a, b in itertools.pairwise(cpu)),
    }


class TokenData(torch.utils.data.Dataset):
    """Synthetic sequences and labels, the same for every variant (a seeded generator)."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, BERT["vocab_size"], (n, SEQUENCE), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def trainer_trial(callback, steps: int, folder: str) -> dict:
    """One Trainer built afresh (untimed), with ``callback`` (or none) after the benchmark's
    own, trained for ``steps`` steps; the clocks at each ``on_step_end``, read by that own
    callback, first in every variant's list."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.process: list[float] = []
            self.thread: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.wall.append(time.perf_counter())
            self.process.append(time.process_time())
            self.thread.append(time.thread_time())

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**BERT))
    args = TrainingArguments(
        output_dir=folder, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_steps=1, dataloader_num_workers=0, per_device_train_batch_size=TRAINER_BATCH,
        seed=0, max_steps=steps,
    )  # fmt: skip
    clock = StepClock()
    callbacks = [clock] if callback is None else [clock, callback]
    trainer = Trainer(
        model=model, args=args, train_dataset=TokenData(steps * TRAINER_BATCH), callbacks=callbacks
    )
    gc.collect()  # the last trial's Trainer, collected before this one's steps
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        out = trainer.train()  # Trainer prints its logs: the same in every variant
    timed, first = steps - TRAINER_SKIP, TRAINER_SKIP - 1
    return {
        "steps_per_s": timed / (clock.wall[-1] - clock.wall[first]),
        "cpu_steps_per_s": timed / (clock.process[-1] - clock.process[first]),
        **step_medians(clock.wall[first:], clock.thread[first:]),
        "loss": out.training_loss,
    }


TRAINER = {"Trainer": False, "Trainer again": False, "Trainer + LiveCallback": True}


def run_trainer(rounds: int, steps: int) -> dict:
    from nbaccel import LiveCallback

    def callback(name: str):
        return LiveCallback() if TRAINER[name] else None

    names = list(TRAINER)
    trials: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="nbaccel-integrations-") as folder:
        for name in names:
            trainer_trial(callback(name), steps, folder)  # warm-up: imports, first allocations
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                trials[name].append(trainer_trial(callback(name), steps, folder))
    reset_accelerate()
    timed = {"steps_per_run": steps, "timed_steps": steps - TRAINER_SKIP}
    return {**timed, **summarise(trials)}


def summarise(trials: dict[str, list[dict]]) -> dict:
    """Each variant against the first (the plain loop), paired round by round."""
    names = list(trials)
    base = trials[names[0]]

    def series(name: str, key: str) -> list[float]:
        return [t[key] for t in trials[name]]

    def over_base(name: str, key: str) -> list[float]:
        return [t[key] / b[key] for t, b in zip(trials[name], base, strict=True)]

    def added(name: str) -> list[float]:  # median step CPU, variant minus baseline
        return [
            t["step_cpu_us"] - b["step_cpu_us"] for t, b in zip(trials[name], base, strict=True)
        ]

    return {
        "baseline": names[0],
        "variants": {
            name: {
                "steps_per_s": stat(series(name, "steps_per_s"), 1),
                "ratio": stat(over_base(name, "steps_per_s"), 4),
                "cpu_time_ratio": stat(over_base(name, "cpu_steps_per_s"), 4),
                "median_step_ms": stat(series(name, "step_ms"), 3),
                "median_step_cpu_us": stat(series(name, "step_cpu_us"), 1),
                "median_step_cpu_added_us": stat(added(name), 1),
                "median_step_cpu_added_share": stat(
                    [a / b["step_cpu_us"] for a, b in zip(added(name), base, strict=True)], 4
                ),
                "last_loss": round(trials[name][-1]["loss"], 4),  # equal: the same math
                "per_round_steps_per_s": [round(x, 1) for x in series(name, "steps_per_s")],
                "per_round_cpu_steps_per_s": [round(x, 1) for x in series(name, "cpu_steps_per_s")],
                "per_round_step_cpu_us": [round(x, 1) for x in series(name, "step_cpu_us")],
            }
            for name in names
        },
    }


class CpuTally:
    """This thread's CPU time in each call of wrapped callables, by name: where an
    integration's own code runs (its hooks, its tracker's ``log``, its loader's ``next``)."""

    def __init__(self) -> None:
        self.readings: dict[str, list[float]] = {}
        self.inside, self.whole = self._timer_cost()

    def wrap(self, name: str, fn):
        readings = self.readings.setdefault(name, [])

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                readings.append(time.thread_time() - start)

        return timed

    def reset(self) -> None:
        for readings in self.readings.values():
            readings.clear()

    def calls(self, name: str) -> list[float]:
        """Seconds in each call of ``name``, less what the timer itself reads."""
        return [x - self.inside for x in self.readings[name]]

    def _timer_cost(self, n: int = 20000) -> tuple[float, float]:
        """Seconds a wrapped empty call reads from inside, and costs as a whole."""
        probe = CpuTally.__new__(CpuTally)
        probe.readings = {}
        empty = probe.wrap("empty", lambda: None)
        start = time.thread_time()
        for _ in range(n):
            empty()
        return statistics.fmean(probe.readings["empty"]), (time.thread_time() - start) / n


class TimedLoader:
    """A loader whose every ``next`` (the last one, that ends the pass, too) is tallied."""

    def __init__(self, loader, tally: CpuTally, name: str) -> None:
        self.loader, self.tally, self.name = loader, tally, name

    def __iter__(self):
        step = self.tally.wrap(self.name, next)
        batches = iter(self.loader)
        while True:
            try:
                yield step(batches)
            except StopIteration:
                return

    def __len__(self) -> int:
        return len(self.loader)


def accelerate_attribution(passes: int, steps: int) -> dict:
    """Where ``LiveTracker`` and the watch spend their CPU time in the Accelerate loop: their
    hooks and the tracker's ``log`` wrapped with a timer, and the watched loader's ``next``
    less the prepared loader's inside it (extra passes, in none of the ratios above)."""
    reset_accelerate()
    loop = AccelerateLoop(steps, live=True)
    try:
        tally = CpuTally()
        model, optimizer, watched = loop.parts
        inner = getattr(optimizer, "optimizer", optimizer)
        hooks_by_part = {
            "forward pre-hook": model._forward_pre_hooks,
            "optimizer step post-hook": inner._optimizer_step_post_hooks,
        }
        for label, hooks in hooks_by_part.items():
            for key, hook in hooks.items():
                hooks[key] = tally.wrap(label, hook)
        (tracker,) = loop.accelerator.trackers
        tracker.log = tally.wrap("LiveTracker.log", tracker.log)
        watched.loader = TimedLoader(watched.loader, tally, "prepared loader's next")
        loop.parts = model, optimizer, TimedLoader(watched, tally, "watched loader's next")
        loop()  # warm-up
        tally.reset()
        for _ in range(passes):
            gc.collect()
            loop()
    finally:
        loop.close()
        reset_accelerate()
    # each outer reading holds an inner one, and the inner timer's whole cost
    outer, inner = tally.calls("watched loader's next"), tally.calls("prepared loader's next")
    own = [o - i - tally.whole for o, i in zip(outer, inner, strict=True)]
    parts = {"watched loader (its next, less the prepared loader's)": own}
    for name in ("forward pre-hook", "optimizer step post-hook", "LiveTracker.log"):
        parts[name] = tally.calls(name)
    return attribution(parts, tally, passes * steps)


LIVE_CALLBACK_METHODS = ("on_epoch_begin", "on_step_begin", "on_step_end", "on_log", "on_save",
                         "on_evaluate", "on_epoch_end", "_count")  # fmt: skip


def trainer_attribution(runs: int, steps: int) -> dict:
    """Where ``LiveCallback`` spends its CPU time: each of its per-step methods (and its forward
    pre-hook, ``_count``) wrapped with a timer, in extra runs that are in none of the ratios
    above. Trainer's start and end (``on_train_begin``, ``on_train_end``) are left out."""
    from nbaccel import LiveCallback

    tally = CpuTally()

    def timed_callback() -> LiveCallback:
        callback = LiveCallback()
        for name in LIVE_CALLBACK_METHODS:  # on the instance: on_train_begin hooks its _count
            setattr(callback, name, tally.wrap(name, getattr(callback, name)))
        return callback

    with tempfile.TemporaryDirectory(prefix="nbaccel-integrations-") as folder:
        trainer_trial(timed_callback(), steps, folder)  # warm-up
        tally.reset()
        for _ in range(runs):
            trainer_trial(timed_callback(), steps, folder)
    reset_accelerate()
    parts = {name: tally.calls(name) for name in LIVE_CALLBACK_METHODS}
    return attribution({k: v for k, v in parts.items() if v}, tally, runs * steps)


def attribution(parts: dict[str, list[float]], tally: CpuTally, steps: int) -> dict:
    """Each part's calls a step, its median call and its time a step (all calls: those that
    also did the quarter-second work included), in microseconds."""
    out = {
        name: {
            "calls_per_step": round(len(calls) / steps, 3),
            "median_call_us": round(1e6 * statistics.median(calls), 2),
            "us_per_step": round(1e6 * sum(calls) / steps, 2),
        }
        for name, calls in parts.items()
    }
    return {
        "steps": steps,
        "timer_us": {"read_inside": 1e6 * tally.inside, "whole": 1e6 * tally.whole},
        "parts": out,
        "total_us_per_step": round(sum(p["us_per_step"] for p in out.values()), 2),
        "total_of_medians_us": round(
            sum(p["median_call_us"] * p["calls_per_step"] for p in out.values()), 2
        ),
    }


def integration_files() -> dict:
    """The measured integrations' source files by content (the tree may be ahead of its
    commit): the package that holds ``LiveTracker``, and the files of ``LiveCallback`` and of
    the ``Recorder`` they share."""
    from nbaccel import LiveCallback, LiveTracker, Recorder

    root = Path(nbaccel.__file__).resolve().parent
    files = [Path(inspect.getsourcefile(c)).resolve() for c in (LiveCallback, Recorder)]
    files += Path(inspect.getsourcefile(LiveTracker)).resolve().parent.glob("*.py")
    return {
        str(path.relative_to(root)): hashlib.sha1(path.read_bytes()).hexdigest()[:12]
        for path in sorted(set(files))
    }


def table(result: dict, steps: str) -> list[str]:
    base = result["baseline"]
    lines = [
        f"| variant | steps/s | ratio to {base} | CPU-time ratio | median step, ms | "
        "its CPU, us | CPU added, us (paired) | added, share of a step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["variants"].items():
        lines.append(
            f"| {name} ({steps}) | {cell(r['steps_per_s'], 1)} | {cell(r['ratio'], 3)} | "
            f"{cell(r['cpu_time_ratio'], 3)} | {cell(r['median_step_ms'], 2)} | "
            f"{cell(r['median_step_cpu_us'], 0)} | {cell(r['median_step_cpu_added_us'], 1)} | "
            f"{cell(r['median_step_cpu_added_share'], 4)} |"
        )
    return lines


def attribution_table(result: dict, who: str) -> list[str]:
    a = result["attribution"]
    step = result["variants"][result["baseline"]]["median_step_cpu_us"]["median"]
    lines = [
        f"CPU time inside {who}'s own code: its parts wrapped with a timer, in {a['steps']} "
        f"extra steps that are in no ratio above (the timer's own reading, "
        f"{a['timer_us']['read_inside']:.2f} us a call, taken off). A step: all calls, the ones "
        "that also did the quarter-second work (counters, progress line) included; the median call "
        f"leaves those out. Share: of the baseline's median step CPU ({step:.0f} us). Not in "
        "it: what having a hook or callback at all costs the library's dispatch.",
        "",
        "| part | calls a step | median call, us | us a step | share of a step |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, p in a["parts"].items():
        lines.append(
            f"| {name} | {p['calls_per_step']:.3g} | {p['median_call_us']:.1f} | "
            f"{p['us_per_step']:.1f} | {p['us_per_step'] / step:.4f} |"
        )
    total, medians = a["total_us_per_step"], a["total_of_medians_us"]
    lines.append(f"| total | | {medians:.1f} | {total:.1f} | {total / step:.4f} |")
    return lines


def to_markdown(report: dict) -> str:
    m, load, c = report["machine"], report["load"], report["config"]
    versions = ", ".join(f"{k} {m[k]}" for k in ("accelerate", "transformers") if k in m)
    files = ", ".join(f"{k} {v}" for k, v in report["integration_files"].items())
    stderr = "a terminal" if c["stderr_tty"] else "not a terminal"
    lines = [
        f"CPU: {m['cpu']}, {m['cores']} cores; torch.set_num_threads({m['threads']}); "
        f"torch {m['torch']}; Python {m['python']}; {versions}; nbaccel {m['nbaccel']} "
        f"(sha1 of the integrations' files: {files}); {m['date']}; 1-min load "
        f"{load['before']:.1f} before, {load['after']:.1f} after. stderr was {stderr}: "
        "nbaccel's progress line is rewritten there in place (on a terminal) or written every "
        "10 s (elsewhere); no launcher, so the recorder keeps the run and draws it in this "
        "process; the time breakdown on.",
        "",
        "Ratio: a variant's steps/s over the baseline's in the same round (the whole timed span, "
        "quarter-second work included). Median step: of each trial's steps, in wall time and in "
        "this thread's CPU time; CPU added: the variant's median step CPU minus the baseline's "
        "in the same round, and that over the baseline's. Median (IQR) over rounds.",
    ]
    if "accelerate" in report:
        a = report["accelerate"]
        lines += [
            "",
            f"## HF Accelerate ({c['accelerate_rounds']} rounds)",
            "",
            f"MLP {c['width']} wide, batch {c['batch']}, SGD; one pass of "
            f"N={a['steps_per_trial']} steps a trial; `accelerator.log` every step.",
            "",
            *table(a, f"N={a['steps_per_trial']}"),
            "",
            "Time in `accelerator.log` alone, per call (wall, and this thread's CPU), and what "
            "the tracker adds to it, paired by round:",
            "",
            "| variant | `log` call, us | its CPU, us | added, us | added CPU, us |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {name} | {cell(r['log_us'], 1)} | {cell(r['log_cpu_us'], 1)} | "
                f"{cell(r['log_added_us'], 1)} | {cell(r['log_cpu_added_us'], 1)} |"
                for name, r in a["variants"].items()
            ),
            "",
            *attribution_table(a, "`LiveTracker` and the watch"),
        ]
    if "trainer" in report:
        t = report["trainer"]
        lines += [
            "",
            f"## transformers' Trainer ({c['trainer_rounds']} rounds)",
            "",
            f"BERT from a config ({c['bert']}), sequences of {SEQUENCE}, batch {TRAINER_BATCH}, "
            f"`logging_steps=1`; a trial is a fresh Trainer's run of {t['steps_per_run']} steps, "
            f"timed over its last {t['timed_steps']}.",
            "",
            *table(t, f"{t['timed_steps']} steps"),
            "",
            *attribution_table(t, "`LiveCallback`"),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=50, help="Accelerate's rounds")
    parser.add_argument("--trainer-rounds", type=int, default=30, help="Trainer's rounds")
    parser.add_argument("--steps", type=int, default=STEPS, help="Accelerate: steps per trial")
    parser.add_argument("--trainer-steps", type=int, default=TRAINER_STEPS, help="Trainer's run")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--only", choices=["accelerate", "trainer"], help="one part")
    parser.add_argument("--out", default="benchmarks/results/integrations-cpu.json")
    args = parser.parse_args()
    if min(args.rounds, args.trainer_rounds) < 2:
        parser.error("rounds must be at least 2, for a median and quartiles")
    if args.trainer_steps < TRAINER_SKIP + 5:
        parser.error(f"--trainer-steps must be at least {TRAINER_SKIP + 5}")
    torch.set_num_threads(args.threads)
    load = {"before": os.getloadavg()[0]}
    info = machine(args.threads)
    with contextlib.suppress(ImportError):
        info["transformers"] = __import__("transformers").__version__
    config = {
        "width": 512, "batch": 64, "accelerate_rounds": args.rounds,
        "trainer_rounds": args.trainer_rounds, "stderr_tty": sys.stderr.isatty(),
        "bert": ", ".join(f"{k}={v}" for k, v in BERT.items()),
    }  # fmt: skip
    report = {"machine": info, "integration_files": integration_files(), "config": config}
    report["load"] = load
    if args.only != "trainer":
        report["accelerate"] = run_accelerate(args.rounds, args.steps)
        report["accelerate"]["attribution"] = accelerate_attribution(ATTRIBUTION_PASSES, args.steps)
    if args.only != "accelerate":
        report["trainer"] = run_trainer(args.trainer_rounds, args.trainer_steps)
        report["trainer"]["attribution"] = trainer_attribution(ATTRIBUTION_RUNS, args.trainer_steps)
    load["after"] = os.getloadavg()[0]
    write(Path(args.out), report, to_markdown(report), "What the integrations cost a step,")


if __name__ == "__main__":
    main()
