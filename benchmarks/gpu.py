"""The GPU benchmarks of ``make gpu-check``: overhead, AMP, launch and the projection on CUDA.

Five parts, each with fixed round counts sized so that all five take about 4-6 minutes on one
H200 (the sizing is in ``ROUNDS`` and ``TRIAL_SECONDS`` below):

* ``overhead``: one training loop per framework (raw PyTorch, nbaccel, HF Accelerate when it
  imports; "raw again" is the noise floor), the MLP of ``benchmarks/overhead.py`` (512 wide,
  batch 64, SGD, a DataLoader), in four modes: plain, accumulation 4, bf16 and fp16 (autocast
  and a GradScaler). The ratio is a variant's steps/s over raw PyTorch's in the same round.
* ``amp``: samples/s of fp32, bf16 and fp16 training steps (nbaccel's Accelerator, AdamW, a
  synthetic batch already on the GPU) of the lessons' models and of a ~110M-parameter
  transformer, and each one's peak memory (``torch.cuda.max_memory_allocated``), measured
  alone, with nothing else on the GPU.
* ``launch``: ``notebook_launcher`` on one GPU from a process that has initialised CUDA
  (``torch.cuda.init()`` and a tensor on the GPU, as a notebook kernel that trained): the
  worker in this process (the default for one process), and a worker forked from the fork
  server (``start_method="forkserver"``); the first fork-server launch, which starts the
  server, is reported apart. With 2 GPUs or more, also 2 workers on NCCL.
* ``projection``: one training step of lesson 5's model and batch (``MLP(64, 1024, 10)``,
  batch 32, SGD with momentum), plain PyTorch and through nbaccel, on one GPU: the compute
  that ``nbaccel.lab.projection`` takes as its input; then the projection it gives for 1-8 GPUs
  on each preset link. With 2 GPUs or more, ``projection.calibrate`` (2 workers, NCCL)
  checks the projected DDP step against a measured one.
* ``step``: what a small step pays on CUDA, cause by cause: lesson 5's step with nbaccel's
  breakdown on (its CUDA events: two a step, one interval sampled), off, and
  overhead.py's loop with the batch copied to the
  device blocking or not (``DataLoaderConfiguration(non_blocking=True)``), nbaccel and HF
  Accelerate beside raw PyTorch.

Method: every variant of a part runs in this one process, round-robin (the first variant
rotates each round), the same number of steps per trial, on objects rebuilt every few rounds;
``torch.cuda.synchronize`` brackets each trial. Medians and interquartile ranges (IQR) over
rounds; ratios are paired (variant over baseline in the same round). nbaccel's recorder does
its quarter-second work on its variant's own running time (``paced``), as in ``overhead.py``.

    PYTHONPATH=. python3 benchmarks/gpu.py [--parts overhead amp launch projection step]
    PYTHONPATH=. python3 benchmarks/gpu.py --device cpu --smoke   # every part, once, on CPU

Without CUDA it says in one line that it measured nothing and exits 0. ``--device cpu
--smoke`` runs every part for one tiny round on the CPU and writes into a temporary folder
(never into ``benchmarks/results``), labelled as a CPU run: a test of this script, no figure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, by name
from overhead import (
    BATCH,
    LR,
    WIDTH,
    OwnClock,
    accelerator_epoch,
    breakdown_off,
    make_parts,
    revision,
)

import nbaccel
from nbaccel import projection
from nbaccel.lessons import MLP, gradient_bytes

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("overhead", "amp", "launch", "projection", "step")
# Rounds per part and seconds of the slowest (fp32) or baseline variant per trial. On an H200:
# overhead 4 modes x 4 variants x 15 rounds x ~0.25 s ~ 60 s + rebuilds and warm-ups ~ 90 s;
# amp 5 models x 3 precisions x 7 rounds x <= 0.25 s ~ 30 s + memory passes and warm-ups ~ 60 s;
# launch ~2 variants x 7 rounds x ~1-2 s (CUDA starts in each forked worker) ~ 30 s;
# projection 2 variants x 15 rounds x 0.2 s ~ 6 s (+ ~30 s for calibrate with 2+ GPUs);
# step (4 + 7 variants) x 15 rounds x ~0.25 s ~ 40 s + rebuilds and warm-ups ~ 50 s.
ROUNDS = {"overhead": 15, "amp": 7, "launch": 7, "projection": 15, "step": 15}
TRIAL_SECONDS = {"overhead": 0.25, "amp": 0.25, "projection": 0.2, "step": 0.2}
REBUILD = 5  # rounds between fresh models, optimizers and loaders
PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
OVERHEAD_MODES = {"plain": (1, "no"), "accumulation 4": (4, "no"), "bf16": (1, "bf16"),
                  "fp16": (1, "fp16")}  # fmt: skip
LESSON5 = {"hidden": 1024, "batch": 32, "lr": 0.05, "momentum": 0.9}  # lesson 5, SIZE="large"
MIB = 2**20


# -- measuring ----------------------------------------------------------------------------------
def stat(xs: list[float], digits: int) -> dict:
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": round(median, digits), "iqr": [round(q1, digits), round(q3, digits)]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def interleaved(builders: dict, steps: int, rounds: int, device: torch.device) -> dict:
    """Seconds of one trial of ``steps`` steps per variant and round, round-robin; every
    ``REBUILD`` rounds each ``builders[name](steps)`` makes a fresh trial, run once to warm up."""
    times: dict[str, list[float]] = {name: [] for name in builders}
    names, trials = list(builders), {}
    for r in range(rounds):
        if r % REBUILD == 0:
            trials.clear()
            free(device)
            trials = {name: build(steps) for name, build in builders.items()}
            for trial in trials.values():
                trial()  # warm-up: allocator, autograd graph, autocast caches, cuBLAS handles
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            trials[name]()
            sync(device)
            times[name].append(time.perf_counter() - start)
    trials.clear()
    free(device)
    return times


def steps_for(build, seconds: float, device: torch.device, least: int, multiple: int = 1) -> int:
    """Steps (a multiple of ``multiple``, at least ``least``) for one trial to last about
    ``seconds``, from a timed trial of ``least`` steps after a warm-up."""
    trial = build(least)
    trial()
    sync(device)
    start = time.perf_counter()
    trial()
    sync(device)
    per_step = (time.perf_counter() - start) / least
    del trial
    free(device)
    return max(least, multiple * round(seconds / per_step / multiple))


# -- part 1: overhead against raw PyTorch -------------------------------------------------------
def raw_loop(device: torch.device, accum: int, precision: str, non_blocking: bool = True):
    def build(steps: int):
        model, optimizer, loader = make_parts(steps)
        model.to(device)  # before any step: SGD holds the same parameters, moved in place
        dtype = DTYPE.get(precision)
        autocast = (lambda: torch.autocast(device.type, dtype)) if dtype else contextlib.nullcontext
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

        def epoch() -> float:
            for i, (x, y) in enumerate(loader):
                x, y = (
                    x.to(device, non_blocking=non_blocking),
                    y.to(device, non_blocking=non_blocking),
                )
                with autocast():
                    loss = F.cross_entropy(model(x), y)
                scaled = loss / accum if accum > 1 else loss
                (scaler.scale(scaled) if scaler else scaled).backward()
                if (i + 1) % accum == 0:
                    if scaler:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    optimizer.zero_grad()
            return loss.item()

        return epoch

    return build


def nbaccel_loop(device: torch.device, accum: int, precision: str, breakdown: bool = True,
                 **options):  # fmt: skip
    """``options``: more of the Accelerator's arguments (``dataloader_config``); ``breakdown=
    False``: built with ``NBACCEL_BREAKDOWN=0``."""

    def build(steps: int):
        with breakdown_off(not breakdown):
            accelerator = nbaccel.Accelerator(
                precision, gradient_accumulation_steps=accum, cpu=device.type == "cpu", **options
            )
        return paced(
            accelerator, accelerator_epoch(accelerator, *accelerator.prepare(*make_parts(steps)))
        )

    return build


def paced(accelerator, trial):
    """``trial``, with ``accelerator``'s recorder paced on the trial's own running time
    (``overhead.OwnClock``): on the wall clock, in turns with N variants, its quarter-second work
    would fall on its steps about N times as often as in a loop that runs alone."""
    clock = OwnClock()
    clock.pace(accelerator.recorder)

    def run():
        with clock:
            return trial()

    return run


def accelerate_loop(device: torch.device, accum: int, precision: str, **options):
    def build(steps: int):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)  # its process-wide singletons
        GradientState._reset_state()  # would refuse a new mode
        accelerator = Accelerator(
            mixed_precision=precision, gradient_accumulation_steps=accum,
            cpu=device.type == "cpu", **options,
        )  # fmt: skip
        return accelerator_epoch(accelerator, *accelerator.prepare(*make_parts(steps)))

    return build


def overhead_part(device: torch.device, rounds: int, smoke: bool) -> dict:
    variants = {"raw": raw_loop, "raw again": raw_loop, "nbaccel": nbaccel_loop}
    skipped = {}
    try:
        import accelerate  # noqa: F401

        variants["accelerate"] = accelerate_loop
    except ImportError as err:
        skipped["accelerate"] = f"not importable here ({err})"
        print(f"(accelerate is not importable: its column is skipped: {err})")
    modes = {}
    for mode, (accum, precision) in OVERHEAD_MODES.items():
        builders = {name: loop(device, accum, precision) for name, loop in variants.items()}
        steps = 4 if smoke else steps_for(builders["raw"], TRIAL_SECONDS["overhead"], device, 8, 4)
        times = interleaved(builders, steps, rounds, device)
        rates = {name: [steps / t for t in ts] for name, ts in times.items()}
        base = rates["raw"]
        modes[mode] = {
            "steps_per_trial": steps,
            "baseline": "raw",
            "variants": {
                name: {
                    "steps_per_s": stat(rates[name], 1),
                    "ratio": stat([a / b for a, b in zip(rates[name], base, strict=True)], 4),
                    "per_round_steps_per_s": [round(x, 1) for x in rates[name]],
                }
                for name in variants
            },
        }
        print(f"overhead, {mode}: {steps} steps a trial, done", flush=True)
    config = {"width": WIDTH, "batch": BATCH, "optimizer": f"SGD(lr={LR})", "rounds": rounds}
    return {"config": config, "skipped": skipped, "modes": modes}


def overhead_markdown(result: dict) -> list[str]:
    c = result["config"]
    lines = [
        f"MLP {c['width']} wide (overhead.py's), batch {c['batch']}, {c['optimizer']}, a "
        f"DataLoader of CPU tensors moved to the device each step; {c['rounds']} rounds of N "
        "steps per variant. Ratio: variant / raw steps/s in the same round. Median (IQR).",
        *[f"Skipped: {name}: {why}." for name, why in result["skipped"].items()],
        "",
        "| mode | variant | steps/s | ratio to raw |",
        "|---|---|---:|---:|",
    ]
    for mode, r in result["modes"].items():
        for name, v in r["variants"].items():
            lines.append(
                f"| {mode} (N={r['steps_per_trial']}) | {name} | {cell(v['steps_per_s'], 1)} | "
                f"{cell(v['ratio'], 3)} |"
            )
    return lines


# -- part 2: AMP throughput and memory ----------------------------------------------------------
class TinyLM(nn.Module):
    """A decoder-only transformer (pre-norm, causal), its output head tied to the embedding."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(tokens) + self.position, mask=self.mask, is_causal=True)
        return self.norm(h) @ self.embed.weight.T


def amp_models(smoke: bool) -> dict:
    """name -> (description, model factory, batch size, make a batch on a device). The lessons'
    sizes are their ``SIZE = "large"`` ones (for GPUs); ``smoke`` shrinks each to seconds."""

    def mlp(lesson: str, hidden: int, depth: int, batch: int):
        if smoke:
            hidden, batch = min(hidden, 64), min(batch, 16)
        shape = f"MLP(64, {hidden}, 10{', depth=' + str(depth) if depth != 2 else ''})"

        def data(device):
            return (torch.rand(batch, 64, device=device),
                    torch.randint(0, 10, (batch,), device=device))  # fmt: skip

        return f"{lesson}: {shape}, batch {batch}", lambda: MLP(64, hidden, 10, depth), batch, data

    vocab, width, layers, heads, seq, batch = 32000, 768, 12, 12, 256, 32
    if smoke:
        vocab, width, layers, heads, seq, batch = 256, 32, 2, 2, 16, 2

    def tokens(device):
        t = torch.randint(0, vocab, (batch, seq + 1), device=device)
        return t[:, :-1], t[:, 1:]

    return {
        "lesson1-mlp": mlp("lesson 1", 1024, 2, 512),
        "lesson3-bench": mlp("lesson 3 benchmark", 4096, 3, 8192),
        "lesson5-mlp": mlp("lesson 5", 1024, 2, 32),
        "lesson6-mlp": mlp("lesson 6", 1024, 8, 128),
        "transformer": (
            f"transformer: {layers} layers x {width} wide, {heads} heads, vocabulary {vocab} "
            f"(tied head), sequence {seq}, batch {batch}",
            lambda: TinyLM(vocab, width, layers, heads, seq), batch, tokens,
        ),
    }  # fmt: skip


def amp_trial(factory, data, precision: str, device: torch.device):
    def build(steps: int):
        torch.manual_seed(0)
        accelerator = nbaccel.Accelerator(PRECISION[precision], cpu=device.type == "cpu")
        model = factory()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        x, y = data(accelerator.device)

        def trial() -> float:
            for _ in range(steps):
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
                accelerator.backward(loss)  # fp16: scaled; a step with inf/NaN is skipped
                optimizer.step()
                optimizer.zero_grad()
            return loss.item()

        return trial

    return build


def peak_mib(build, device: torch.device) -> tuple[float | None, float | None]:
    """The peak of ``torch.cuda.max_memory_allocated`` over a step (after one to warm up: the
    optimizer's state exists), above what was allocated before the model was built (nothing,
    unless something earlier was never freed: that is the second value). None off CUDA."""
    if device.type != "cuda":
        return None, None
    free(device)
    before = torch.cuda.memory_allocated(device)
    trial = build(1)
    trial()
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    trial()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del trial
    free(device)
    return round(peak / MIB, 1), round(before / MIB, 1)


def amp_part(device: torch.device, rounds: int, smoke: bool) -> dict:
    models, info = {}, {}
    for name, (description, factory, batch, data) in amp_models(smoke).items():
        builders = {p: amp_trial(factory, data, p, device) for p in PRECISION}
        memory = {p: peak_mib(build, device) for p, build in builders.items()}
        allocated_before = {p: m[1] for p, m in memory.items()}
        steps = 1 if smoke else steps_for(builders["fp32"], TRIAL_SECONDS["amp"], device, 3)
        times = interleaved(builders, steps, rounds, device)
        models[name] = {
            p: {
                **stat([steps * batch / t for t in times[p]], 1),
                "peak_mib": memory[p][0],
            }
            for p in PRECISION
        }
        for p in PRECISION:  # the schema's names: samples_per_s, iqr, peak_mib
            models[name][p] = {"samples_per_s": models[name][p].pop("median"), **models[name][p]}
        info[name] = {
            "description": description,
            "parameters": sum(p.numel() for p in factory().parameters()),
            "batch": batch,
            "steps_per_trial": steps,
            "allocated_before_mib": allocated_before,  # not in peak_mib; 0 unless a leak
        }
        print(f"amp, {name}: {steps} steps a trial, done", flush=True)
    # "highest": float32 matmuls in float32, no TF32 (torch's default; the fp32 column is that)
    matmul = torch.get_float32_matmul_precision()
    return {"rounds": rounds, "fp32_matmul_precision": matmul, "models": models, "model_info": info}


def amp_markdown(result: dict) -> list[str]:
    lines = [
        "Training steps through nbaccel's Accelerator (`mixed_precision` no / bf16 / fp16 with "
        "its GradScaler), AdamW, one synthetic batch already on the device; "
        f"{result['rounds']} interleaved rounds of N steps. samples/s: median (IQR). Peak: "
        "`torch.cuda.max_memory_allocated` over a step, the model measured alone (weights, "
        "gradients, AdamW's state, activations). fp32 matmuls: "
        f"`torch.get_float32_matmul_precision()` = {result['fp32_matmul_precision']!r} "
        "('highest': no TF32). fp16's first steps may be skipped by the GradScaler (inf/NaN "
        "at its initial scale); they are timed as they run.",
        "",
        "| model | parameters | N | fp32 samples/s | bf16 samples/s | fp16 samples/s "
        "| fp32 peak MiB | bf16 peak MiB | fp16 peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["models"].items():
        i = result["model_info"][name]
        speeds = " | ".join(
            f"{r[p]['samples_per_s']:,.0f} ({r[p]['iqr'][0]:,.0f}-{r[p]['iqr'][1]:,.0f})"
            for p in PRECISION
        )
        peaks = " | ".join("-" if r[p]["peak_mib"] is None else f"{r[p]['peak_mib']:,.0f}"
                           for p in PRECISION)  # fmt: skip
        lines.append(
            f"| {i['description']} | {i['parameters']:,} | {i['steps_per_trial']} | {speeds} "
            f"| {peaks} |"
        )
    return lines


# -- part 3: launch time with CUDA initialised here ---------------------------------------------
def launch_job() -> str:
    """The launched function: an Accelerator, one all-reduce (a sum on one process) on its
    device, the end. Returns the device, to check where it ran."""
    import torch as worker_torch

    from nbaccel import Accelerator

    accelerator = Accelerator(live=False)
    accelerator.reduce(worker_torch.ones(1, device=accelerator.device)).item()
    accelerator.end_training()
    return str(accelerator.device)


def launch_part(device: torch.device, rounds: int, smoke: bool) -> dict:
    from nbaccel import notebook_launcher

    cpu = device.type == "cpu"
    if not cpu:  # as a notebook kernel that trained on the GPU (the parts before did, too)
        torch.cuda.init()
        torch.ones(1, device=device).sum().item()
    variants = {
        "1 process, in this process": dict(num_processes=1),
        "1 process, fork-server worker": dict(num_processes=1, start_method="forkserver"),
    }
    skipped = {}
    if not cpu and torch.cuda.device_count() >= 2:
        variants["2 processes, NCCL"] = dict(num_processes=2)
    else:
        skipped["2 processes, NCCL"] = "needs 2 GPUs"

    def launch(options: dict) -> tuple[float, str]:
        start = time.perf_counter()
        where = notebook_launcher(launch_job, cpu=cpu, live=False, timeout=120, **options)
        return time.perf_counter() - start, where

    first, where = launch(variants["1 process, fork-server worker"])  # starts the server
    devices = {where}
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, where = launch(variants[name])
            times[name].append(seconds)
            devices.add(where)
    expected = "cpu" if cpu else "cuda"
    if any(not d.startswith(expected) for d in devices):
        raise RuntimeError(f"launched workers ran on {sorted(devices)}, not on {expected}")
    print("launch: done", flush=True)
    return {
        "rounds": rounds,
        "cuda_initialised_here": not cpu,
        "first_forkserver_launch_s": round(first, 4),
        "worker_devices": sorted(devices),
        "skipped": skipped,
        "variants": {
            name: {**stat(ts, 4), "min": round(min(ts), 4), "max": round(max(ts), 4)}
            for name, ts in times.items()
        },
    }


def launch_markdown(result: dict) -> list[str]:
    here = "with CUDA initialised in the launching process" if result["cuda_initialised_here"] \
        else "on the CPU"  # fmt: skip
    lines = [
        f"`notebook_launcher` of a trivial job (Accelerator, one reduce, end) {here}, timed from "
        f"the call to the return; {result['rounds']} interleaved rounds; seconds, median (IQR) "
        f"[min-max]. The first fork-server launch (it starts the server): "
        f"{result['first_forkserver_launch_s']:.2f} s. Workers ran on "
        f"{', '.join(result['worker_devices'])}.",
        *[f"Skipped: {name}: {why}." for name, why in result["skipped"].items()],
        "",
        "| launch | seconds |",
        "|---|---:|",
    ]
    for name, s in result["variants"].items():
        lines.append(f"| {name} | {cell(s, 3)} [{s['min']:.3f}-{s['max']:.3f}] |")
    return lines


# -- part 4: the projection's input, measured on one GPU ----------------------------------------
def lesson5_trial(device: torch.device, through_nbaccel: bool, breakdown: bool = True):
    """Lesson 5's step on a batch already on the device: plain PyTorch, or through nbaccel's
    Accelerator (with its breakdown, or built without it)."""
    hidden, batch = LESSON5["hidden"], LESSON5["batch"]

    def build(steps: int):
        torch.manual_seed(0)
        model = MLP(64, hidden, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=LESSON5["lr"],
                                    momentum=LESSON5["momentum"])  # fmt: skip
        if through_nbaccel:
            with breakdown_off(not breakdown):
                accelerator = nbaccel.Accelerator(cpu=device.type == "cpu")
            model, optimizer = accelerator.prepare(model, optimizer)
            backward, on = accelerator.backward, accelerator.device
        else:
            model.to(device)
            backward, on = torch.Tensor.backward, device
        x = torch.rand(batch, 64, device=on)
        y = torch.randint(0, 10, (batch,), device=on)

        def trial() -> float:
            for _ in range(steps):
                backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            return 0.0

        return paced(accelerator, trial) if through_nbaccel else trial

    return build


def projection_part(device: torch.device, rounds: int, smoke: bool) -> dict:
    builders = {"plain PyTorch": lesson5_trial(device, False),
                "nbaccel": lesson5_trial(device, True)}  # fmt: skip
    steps = 2 if smoke else steps_for(builders["plain PyTorch"], TRIAL_SECONDS["projection"],
                                      device, 20)  # fmt: skip
    times = interleaved(builders, steps, rounds, device)
    step_s = {name: [t / steps for t in ts] for name, ts in times.items()}
    measured = {name: stat(xs, 7) for name, xs in step_s.items()}
    compute = measured["nbaccel"]["median"]  # what lesson 5's one worker spends on a step
    grad_bytes = gradient_bytes(MLP(64, LESSON5["hidden"], 10))
    counts = (1, 2, 4, 8)

    def points(overlap: bool) -> dict:
        return {
            link.name: [
                {
                    "workers": p.workers,
                    "step_s": p.step_seconds,
                    "samples_per_s": p.samples_per_s,
                    "efficiency": p.efficiency,
                    "allreduce_s": p.allreduce_seconds,
                }
                for p in projection.curve(
                    compute, grad_bytes, LESSON5["batch"], link, counts, overlap
                )
            ]
            for link in projection.PRESETS.values()
        }

    result = {
        "model": f"lesson 5: MLP(64, {LESSON5['hidden']}, 10), batch {LESSON5['batch']}, "
        f"SGD(lr={LESSON5['lr']}, momentum={LESSON5['momentum']}), a batch on the device",
        "rounds": rounds,
        "steps_per_trial": steps,
        "step_s": measured,
        "calibrated": {
            "compute_seconds": compute,
            "gradient_bytes": grad_bytes,
            "batch_size": LESSON5["batch"],
            "samples_per_s_one_gpu": LESSON5["batch"] / compute,
        },
        "projected": points(overlap=True),  # as on GPUs, where NCCL overlaps the backward pass
        "projected_no_overlap": points(overlap=False),
    }
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        c = projection.calibrate(hidden=LESSON5["hidden"], num_processes=2, cpu=False)
        result["calibrate_2_gpus"] = {
            **{k: v for k, v in vars(c).items() if k != "link"},
            "bandwidth": c.link.bandwidth, "latency": c.link.latency,
            "error_no_overlap": c.error(overlap=False), "error_overlap": c.error(overlap=True),
        }  # fmt: skip
    else:
        result["calibrate_2_gpus"] = None
        result["skipped"] = {"calibrate_2_gpus": "projection.calibrate needs 2 GPUs (NCCL)"}
    print("projection: done", flush=True)
    return result


def projection_markdown(result: dict) -> list[str]:
    c = result["calibrated"]
    workers = [p["workers"] for p in next(iter(result["projected"].values()))]
    lines = [
        f"{result['model']}; {result['rounds']} interleaved rounds of {result['steps_per_trial']}"
        " steps; seconds per step, median (IQR).",
        "",
        "| loop | ms per step |",
        "|---|---:|",
        *[
            f"| {name} | {s['median'] * 1e3:.4f} ({s['iqr'][0] * 1e3:.4f}-"
            f"{s['iqr'][1] * 1e3:.4f}) |"
            for name, s in result["step_s"].items()
        ],
        "",
        f"The projection's inputs from it: compute {c['compute_seconds'] * 1e3:.4f} ms a step "
        f"(nbaccel's median), {c['gradient_bytes'] / 1e6:.3f} MB of gradients, batch "
        f"{c['batch_size']}: {c['samples_per_s_one_gpu']:,.0f} samples/s on one GPU. Projected "
        "samples/s and efficiency, with overlap (and without):",
        "",
        "| link | " + " | ".join(f"{n} GPU{'s' * (n > 1)}" for n in workers) + " |",
        "|---|" + "---:|" * len(workers),
    ]
    for link, points in result["projected"].items():
        serial = result["projected_no_overlap"][link]
        cells = " | ".join(
            f"{p['samples_per_s']:,.0f}, {p['efficiency']:.2f} ({q['efficiency']:.2f})"
            for p, q in zip(points, serial, strict=True)
        )
        lines.append(f"| {link} | {cells} |")
    k = result["calibrate_2_gpus"]
    if k:
        lines += [
            "",
            f"`projection.calibrate` on 2 GPUs (NCCL): DDP step measured {k['ddp'] * 1e3:.3f} ms, "
            f"compute {k['compute'] * 1e3:.3f} ms, link {k['bandwidth'] / 1e9:.1f} GB/s and "
            f"{k['latency'] * 1e6:.1f} us a ring step; projected error "
            f"{k['error_no_overlap']:+.0%} without overlap, {k['error_overlap']:+.0%} with it.",
        ]
    else:
        lines += ["", f"Not measured: {result['skipped']['calibrate_2_gpus']}."]
    return lines


# -- part 5: what a small step pays on CUDA, cause by cause -------------------------------------
def step_groups(device: torch.device) -> dict:
    """Two groups of variants, each against its first: lesson 5's step on a batch already on
    the device (what the breakdown's CUDA events cost), and overhead.py's loop over a DataLoader
    of CPU tensors (what a blocking copy of each batch costs; nbaccel and HF Accelerate copy
    blocking unless ``DataLoaderConfiguration(non_blocking=True)`` or ``pin_memory=True``)."""
    groups = {
        "lesson 5's step, batch on the device": {
            "plain PyTorch": lesson5_trial(device, False),
            "nbaccel": lesson5_trial(device, True),
            "nbaccel, breakdown off": lesson5_trial(device, True, breakdown=False),
        },
        "overhead.py's MLP, a CPU batch copied each step": {
            "raw, to(device, non_blocking=True)": raw_loop(device, 1, "no"),
            "raw, to(device)": raw_loop(device, 1, "no", non_blocking=False),
            "nbaccel": nbaccel_loop(device, 1, "no"),
            "nbaccel, non_blocking=True": nbaccel_loop(
                device,
                1,
                "no",
                dataloader_config=nbaccel.DataLoaderConfiguration(non_blocking=True),
            ),
            "nbaccel, non_blocking=True, breakdown off": nbaccel_loop(
                device,
                1,
                "no",
                breakdown=False,
                dataloader_config=nbaccel.DataLoaderConfiguration(non_blocking=True),
            ),
        },
    }
    with contextlib.suppress(ImportError):
        from accelerate.utils import DataLoaderConfiguration

        loader = groups["overhead.py's MLP, a CPU batch copied each step"]
        loader["HF Accelerate"] = accelerate_loop(device, 1, "no")
        loader["HF Accelerate, non_blocking=True"] = accelerate_loop(
            device, 1, "no", dataloader_config=DataLoaderConfiguration(non_blocking=True)
        )
    return groups


def step_part(device: torch.device, rounds: int, smoke: bool) -> dict:
    groups = {}
    for group, builders in step_groups(device).items():
        base = next(iter(builders))
        steps = 4 if smoke else steps_for(builders[base], TRIAL_SECONDS["step"], device, 16, 4)
        times = interleaved(builders, steps, rounds, device)
        groups[group] = {
            "steps_per_trial": steps,
            "baseline": base,
            "variants": {
                name: {
                    "us_per_step": stat([t / steps * 1e6 for t in ts], 1),
                    "ratio": stat([b / t for b, t in zip(times[base], ts, strict=True)], 4),
                }
                for name, ts in times.items()
            },
        }
        print(f"step, {group}: {steps} steps a trial, done", flush=True)
    return {"rounds": rounds, "groups": groups}


def step_markdown(result: dict) -> list[str]:
    lines = [
        f"{result['rounds']} interleaved rounds per group; microseconds per step, median (IQR); "
        "speed: the group's first variant's time over the variant's, paired by round (1.000 is "
        "as fast). Each loop does forward, backward and SGD's step every step; the second "
        "group's batches come from a DataLoader of CPU tensors (batch 64, 512 wide).",
    ]
    for group, g in result["groups"].items():
        lines += ["", f"**{group}** ({g['steps_per_trial']} steps a trial)", "",
                  "| variant | us per step | speed |", "|---|---:|---:|"]  # fmt: skip
        lines += [f"| {name} | {cell(v['us_per_step'], 1)} | {cell(v['ratio'], 3)} |"
                  for name, v in g["variants"].items()]  # fmt: skip
    return lines


# -- the run ------------------------------------------------------------------------------------
def cell(s: dict, digits: int) -> str:
    (q1, q3), f = s["iqr"], f".{digits}f"
    return f"{s['median']:{f}} ({q1:{f}}-{q3:{f}})"


def driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def machine(device: torch.device) -> dict:
    info = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
        else "none: a CPU smoke run of the script, not a GPU figure",
        "driver": driver_version() if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "python": sys.version.split()[0],
        "nbaccel": f"{nbaccel.__version__} ({revision()})",
    }  # fmt: skip
    with contextlib.suppress(ImportError):
        info["accelerate"] = __import__("accelerate").__version__
    return info


TITLES = {
    "overhead": "Training-loop overhead against raw PyTorch",
    "amp": "fp32, bf16 and fp16: throughput and peak memory",
    "launch": "Launch time with CUDA initialised in the launching process",
    "projection": "The projection's input measured on one GPU",
    "step": "What a small step pays on CUDA: the breakdown's events and a blocking batch copy",
}
MARKDOWN = {"overhead": overhead_markdown, "amp": amp_markdown, "launch": launch_markdown,
            "projection": projection_markdown, "step": step_markdown}  # fmt: skip
RUN = {"overhead": overhead_part, "amp": amp_part, "launch": launch_part,
       "projection": projection_part, "step": step_part}  # fmt: skip


def header(m: dict, smoke: bool) -> str:
    where = (f"GPU: {m['gpu']} ({m['gpus']} visible), driver {m['driver'] or 'unknown'}, CUDA "
             f"{m['cuda']}" if m["gpus"] else f"CPU only ({m['gpu']})")  # fmt: skip
    extras = f", accelerate {m['accelerate']}" if "accelerate" in m else ""
    method = (
        "Method: every variant in this one process, round-robin (the first rotates each round), "
        "the same steps per trial, objects rebuilt every "
        f"{REBUILD} rounds, `torch.cuda.synchronize` around each trial; medians and "
        "interquartile ranges (IQR) over rounds; ratios paired by round."
    )
    smoke_note = "\n\nSMOKE RUN: one tiny round of each part, to test the script; no figure." \
        if smoke else ""  # fmt: skip
    return (f"{where}; torch {m['torch']}; Python {m['python']}; nbaccel {m['nbaccel']}{extras};"
            f" {m['date']}.\n\n{method}{smoke_note}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--smoke", action="store_true", help="one tiny round of every part")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", help="folder for the files (default: benchmarks/results; "
                        "a new temporary folder with --smoke)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here, measured nothing (nothing written).")
        return 0
    if args.device == "cpu" and not args.smoke:
        parser.error("--device cpu runs only with --smoke: CPU figures are the CPU benchmarks'")
    if args.smoke:  # a test of the script, on either device: never into benchmarks/results
        out = Path(args.out or tempfile.mkdtemp(prefix="nbaccel-gpu-smoke-"))
        if out.resolve() == RESULTS.resolve():
            parser.error("a smoke run never writes into benchmarks/results")
    else:
        out = Path(args.out) if args.out else RESULTS
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out.mkdir(parents=True, exist_ok=True)
    began, failed = time.perf_counter(), []
    for part in args.parts:
        rounds = 2 if args.smoke else ROUNDS[part]  # 2: the fewest for a median and quartiles
        start = time.perf_counter()
        try:  # one part's failure must not cost the others' figures (a GPU run is rare)
            result = RUN[part](device, rounds, args.smoke)
        except Exception:
            traceback.print_exc()
            print(f"{part}: FAILED after {time.perf_counter() - start:.0f} s (above); "
                  "nothing written for it", flush=True)  # fmt: skip
            failed.append(part)
            free(device)
            continue
        m = machine(device)
        report = {"machine": m, "smoke": args.smoke, "seconds": 0.0, **result}
        report["seconds"] = round(time.perf_counter() - start, 1)
        text = "\n".join([f"# {TITLES[part]}", "", header(m, args.smoke), "",
                          *MARKDOWN[part](result), ""])  # fmt: skip
        path = out / f"gpu-{part}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        path.with_suffix(".md").write_text(text)
        print(f"{part}: {report['seconds']:.0f} s; wrote {path} and {path.with_suffix('.md')}",
              flush=True)  # fmt: skip
    took = f"benchmarks/gpu.py: {time.perf_counter() - began:.0f} s in all"
    print(took + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
