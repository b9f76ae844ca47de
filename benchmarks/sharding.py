"""Per-rank model state and throughput of DDP, ZeRO 1-3 and FSDP2 on 2 CPU ranks.

One model (a stack of 4 Linear layers 1024 wide, 4.2M parameters), AdamW, synthetic data,
trained through ``notebook_launcher`` on 2 CPU workers (gloo) once per strategy and precision:

    DDP      Accelerator()                                   (PyTorch DDP, whole state)
    ZeRO 1-3 Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=s, config=SHARD_ALL))
    FSDP2    Accelerator(fsdp_plugin=FSDPPlugin())           (torch's fully_shard)

each in float32 ("no") and bf16 mixed precision. Memory: each rank calls
``nbaccel.lessons.tools.state_bytes`` after backward and before ``optimizer.step()`` of the
second step (gradients and optimizer state both exist), and the bytes stand beside what the
ZeRO paper's model-state formulas predict (Rajbhandari et al., 2020) with the constants of the
dtypes actually stored. Throughput: after warm-up steps, the workers time a fixed number of
training steps between two barriers (the engine's start-up is not timed); samples/s counts both
ranks' samples.

The machine may be shared and noisy, so configurations take turns: every round launches each
of them once, in an order that rotates each round, and a strategy's ratio to DDP is the median
of the per-round ratios (same precision, same round). We report medians with the interquartile
range (IQR).

    python benchmarks/sharding.py [--rounds 5] [--steps 10] [--bf16-steps 5]
        [--out benchmarks/results/sharding-cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from overhead import revision  # this folder is on sys.path when a script here runs

import nbaccel
from nbaccel import notebook_launcher
from nbaccel.lessons.tools import machine as machine_line

STRATEGIES = ("DDP", "ZeRO 1", "ZeRO 2", "ZeRO 3", "FSDP2")
PRECISIONS = ("no", "bf16")  # float32, bf16 mixed precision
WIDTH, LAYERS, BATCH, LR = 1024, 4, 32, 1e-4  # BATCH: per rank
RANKS, WARMUP = 2, 2  # state measured on the second warm-up step; timing starts after them
# DeepSpeed keeps parameters under 1e5 elements whole on every rank in ZeRO 3 (its default
# stage3_param_persistence_threshold): shard them all, biases included, as FSDP2 does.
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
MIB = 2**20


def make_model():
    import torch

    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def work(strategy: str, precision: str, steps: int) -> dict:
    """One rank: train ``WARMUP + steps`` steps; return its state bytes and timed seconds."""
    import time

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, DeepSpeedPlugin, FSDPPlugin
    from nbaccel.lessons.tools import state_bytes

    plugin = {}
    if strategy.startswith("ZeRO"):
        stage = int(strategy.split()[1])
        plugin["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=stage, config=SHARD_ALL)
    elif strategy == "FSDP2":
        plugin["fsdp_plugin"] = FSDPPlugin()
    accelerator = Accelerator(precision, cpu=True, live=False, **plugin)
    torch.manual_seed(0)
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    n = (WARMUP + steps) * BATCH * accelerator.num_processes
    data = TensorDataset(torch.randn(n, WIDTH), torch.randint(0, WIDTH, (n,)))
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=BATCH)
    )
    batches = iter(loader)
    state, ddp_buckets = None, None
    for step in range(WARMUP):
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        if step == 1:  # a step after the first: gradients and optimizer state both exist
            state = state_bytes(model, optimizer)
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                ddp_buckets = ddp_bucket_bytes(model)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()
    start, cpu_start = time.perf_counter(), time.process_time()
    timed = 0
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        timed += 1
    last_loss = loss.item()
    accelerator.wait_for_everyone()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    accelerator.end_training()
    return {
        "numel": numel,
        "state": state,
        "ddp_buckets": ddp_buckets,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "steps": timed,
        "last_loss": last_loss,
    }


def ddp_bucket_bytes(model) -> int | None:
    """Bytes of DDP's C++ gradient buckets, as its logging data reports them (None: unknown)."""
    with contextlib.suppress(Exception):
        data = model._get_ddp_logging_data()
        if data.get("gradient_as_bucket_view"):
            return 0
        sizes = data.get("bucket_sizes", "")
        return sum(int(s) for s in str(sizes).split(",") if s.strip())
    return None


# -- what the ZeRO paper predicts ------------------------------------------------------------------
def constants(strategy: str, precision: str) -> tuple[int, int, str]:
    """(bytes per stored weight and gradient, K optimizer bytes per parameter, why).

    The paper's mixed-precision Adam keeps 16-bit weights and gradients (2 bytes each) and
    K = 12 (float32 master weights, momentum, variance). DeepSpeed's bf16 mode stores exactly
    that. Under DDP and FSDP2, bf16 is autocast over float32 weights, and in float32 training
    no master copy is needed: 4-byte weights and gradients, K = 8 (AdamW's two float32 moments).
    """
    if precision == "bf16" and strategy.startswith("ZeRO"):
        return 2, 12, "bf16 weights and gradients; fp32 master + 2 moments"
    return 4, 8, "fp32 weights and gradients; 2 fp32 moments"


def predicted(strategy: str, precision: str) -> dict[str, float]:
    """Bytes per parameter per rank, split as the paper counts them, for ``RANKS`` ranks."""
    p, k, _ = constants(strategy, precision)
    n = RANKS
    split = {  # parameters, gradients, optimizer state
        "DDP": (p, p, k),  # replicated: (2 + 2 + K) psi
        "ZeRO 1": (p, p, k / n),  # 2 psi + 2 psi + K psi / N
        "ZeRO 2": (p, p / n, k / n),  # 2 psi + (2 + K) psi / N
        "ZeRO 3": (p / n, p / n, k / n),  # (2 + 2 + K) psi / N
        "FSDP2": (p / n, p / n, k / n),  # full sharding, as ZeRO 3
    }[strategy]
    return dict(zip(("parameters", "gradients", "optimizer"), split, strict=True))


# -- the run ---------------------------------------------------------------------------------------
def launch(strategy: str, precision: str, steps: int) -> list[dict]:
    return notebook_launcher(
        work,
        args=(strategy, precision, steps),
        num_processes=RANKS,
        cpu=True,
        live=False,
        return_all=True,
    )


def stat(xs: list[float], digits: int) -> dict:
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": round(median, digits), "iqr": [round(q1, digits), round(q3, digits)]}


def machine(start_load: float) -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), cpu)
    versions = {"nbaccel": f"{nbaccel.__version__} ({revision()})"}
    for pkg in ("torch", "deepspeed"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    return {
        "line": machine_line(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_1min": [round(start_load, 2), round(os.getloadavg()[0], 2)],
    }


def summarise(runs: dict[tuple[str, str], list[list[dict]]]) -> dict:
    """Memory (identical on every launch: checked) and throughput per configuration."""
    results: dict[str, dict] = {}
    for precision in PRECISIONS:
        results[precision] = {}
        ddp_total = None
        for strategy in STRATEGIES:
            launches = runs[strategy, precision]
            first = launches[0]
            numel = first[0]["numel"]
            states = [rank["state"] for launch in launches for rank in launch]
            if any(s != first[0]["state"] for s in states[1:]):
                print(f"note: {strategy} {precision}: state bytes differ between ranks or rounds")
            state = max(states, key=lambda s: s["parameters"] + s["gradients"] + s["optimizer"])
            total = state["parameters"] + state["gradients"] + state["optimizer"]
            ddp_total = total if strategy == "DDP" else ddp_total
            pred = predicted(strategy, precision)
            p, k, why = constants(strategy, precision)
            pred_total = sum(pred.values()) * numel
            per_param = {
                key: state[key] / numel for key in ("parameters", "gradients", "optimizer")
            }
            # samples/s of both ranks: the slower rank's seconds (they end at one barrier)
            sps = [
                BATCH * RANKS * launch[0]["steps"] / max(r["seconds"] for r in launch)
                for launch in launches
            ]
            cpu_ms = [
                1000 * statistics.mean(r["cpu_seconds"] for r in launch) / launch[0]["steps"]
                for launch in launches
            ]
            results[precision][strategy] = {
                "numel": numel,
                "state_bytes": state,
                "total_bytes": total,
                "bytes_per_param": {k_: round(v, 4) for k_, v in per_param.items()}
                | {"total": round(total / numel, 4)},
                "predicted": {
                    "constants": {"weight_and_gradient_bytes": p, "K": k, "dtypes": why},
                    "bytes_per_param": pred | {"total": sum(pred.values())},
                    "total_bytes": pred_total,
                },
                "measured_over_predicted": round(total / pred_total, 4),
                "ratio_to_ddp": round(total / ddp_total, 4),
                "ddp_bucket_bytes": first[0]["ddp_buckets"],
                "samples_per_s": stat(sps, 1),
                "cpu_ms_per_step": stat(cpu_ms, 1),
                "launch_s": stat([launch[0]["launch_s"] for launch in launches], 1),
                "last_loss": round(first[0]["last_loss"], 4),
                "per_round_samples_per_s": [round(x, 1) for x in sps],
                "per_round_cpu_ms_per_step": [round(x, 2) for x in cpu_ms],
            }
        ddp = results[precision]["DDP"]
        for r in results[precision].values():
            pairs = zip(r["per_round_samples_per_s"], ddp["per_round_samples_per_s"], strict=True)
            r["throughput_ratio_to_ddp"] = stat([x / b for x, b in pairs], 3)
            pairs = zip(
                r["per_round_cpu_ms_per_step"], ddp["per_round_cpu_ms_per_step"], strict=True
            )
            r["cpu_time_ratio_to_ddp"] = stat([b / x for x, b in pairs], 3)  # as throughput
    return results


def target(results: dict) -> dict:
    """Issue target: ZeRO 3 and FSDP2 per-rank state at most 0.55x DDP's (same precision)."""
    return {
        precision: {s: results[precision][s]["ratio_to_ddp"] <= 0.55 for s in ("ZeRO 3", "FSDP2")}
        for precision in PRECISIONS
    }


NAMES = {"no": "float32", "bf16": "bf16"}


def to_markdown(report: dict) -> str:
    m, c, res = report["machine"], report["config"], report["results"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if k != "torch")
    load = "-".join(f"{x:.1f}" for x in m["loadavg_1min"])
    numel = res["no"]["DDP"]["numel"]
    lines = [
        "# Sharding on 2 CPU ranks: per-rank model state and throughput",
        "",
        f"{m['line']}; Python {m['python']}; {versions}; {m['date']}; 1-min load average"
        f" {load} at start-end (the machine is shared with other jobs).",
        f"Command: `{c['command']}` ({c['seconds'] / 60:.1f} min).",
        f"Model: {c['model']} ({numel:,} parameters = psi), AdamW, batch {c['batch_per_rank']} per"
        f" rank; {RANKS} workers via notebook_launcher (gloo, 1 thread each). CPU figures"
        " only: no GPU was used, and CPU throughput says nothing about GPU speed.",
        "",
        "## Model state per rank",
        "",
        "Measured by `nbaccel.lessons.tools.state_bytes` on each rank after `backward` and before"
        " `optimizer.step()` of step 2 (the larger rank shown). Bytes/param: measured bytes over"
        " psi, split parameters + gradients + optimizer (optimizer includes DeepSpeed's float32"
        " master weights). Predicted: the ZeRO paper's formulas (replicated (2+2+K)psi; stage 1"
        " 2psi+2psi+Kpsi/N; stage 2 2psi+(2+K)psi/N; stage 3 and FSDP2 (2+2+K)psi/N) with N = 2"
        " and the stored dtypes' constants: p + p + K with p = 4, K = 8 (float32 weights,"
        " AdamW's two float32 moments) except DeepSpeed bf16, p = 2, K = 12 (bf16 weights and"
        " gradients, float32 master + moments). / DDP: total over DDP's, same precision.",
        "",
        "| precision | strategy | parameters MiB | gradients MiB | optimizer MiB | total MiB"
        " | bytes/param (p+g+o) | predicted bytes/param | predicted MiB | measured / predicted"
        " | / DDP |",
        "|---|---|" + "---:|" * 9,
    ]

    def split(d: dict) -> str:
        parts = "+".join(f"{d[k]:g}" for k in ("parameters", "gradients", "optimizer"))
        return f"{parts} = {d['total']:g}"

    for precision in PRECISIONS:
        for strategy, r in res[precision].items():
            s = r["state_bytes"]
            cells = [f"{s[k] / MIB:.1f}" for k in ("parameters", "gradients", "optimizer")]
            cells += [f"**{r['total_bytes'] / MIB:.1f}**", split(r["bytes_per_param"])]
            cells += [split(r["predicted"]["bytes_per_param"])]
            cells += [f"{r['predicted']['total_bytes'] / MIB:.1f}"]
            cells += [f"{r['measured_over_predicted']:.2f}", f"**{r['ratio_to_ddp']:.3f}**"]
            lines.append(f"| {NAMES[precision]} | {strategy} | " + " | ".join(cells) + " |")
    lines += ["", "Target (issue): ZeRO 3 and FSDP2 per-rank state at most 0.55x DDP's, same"
              " precision:"]  # fmt: skip
    for precision, hits in report["target"].items():
        for strategy, ok in hits.items():
            ratio = res[precision][strategy]["ratio_to_ddp"]
            verdict = "met" if ok else "NOT met"
            lines.append(f"- {NAMES[precision]} {strategy}: {ratio:.3f}x DDP, {verdict}.")

    lines += [
        "",
        "## Throughput",
        "",
        f"{c['rounds']} rounds; each round launches every configuration once, the order"
        f" rotating each round; each launch runs {WARMUP} warm-up steps, then times"
        f" {' and '.join(f'{n} ({p})' for p, n in c['timed_steps'].items())} steps between two"
        " barriers (start-up not timed). samples/s: both ranks' samples over the slower rank's"
        " wall time. / DDP: median of the per-round ratios to DDP in the same precision. CPU"
        " ms/step: a worker's process CPU time per step, all its threads (leaves out the time"
        " other programs held the CPU, and time spent waiting); its / DDP is DDP's CPU ms/step"
        " over the strategy's, per round, so that below 1 means slower, as for samples/s."
        " Launch s: the whole notebook_launcher call, start-up included. Median (IQR).",
        "",
        "| precision | strategy | samples/s | / DDP | CPU ms/step per rank | / DDP in CPU time"
        " | launch s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]

    def cell(s: dict, digits: int) -> str:
        (q1, q3), f = s["iqr"], f".{digits}f"
        return f"{s['median']:{f}} ({q1:{f}}-{q3:{f}})"

    for precision in PRECISIONS:
        for strategy, r in res[precision].items():
            lines.append(
                f"| {NAMES[precision]} | {strategy} | {cell(r['samples_per_s'], 1)}"
                f" | {cell(r['throughput_ratio_to_ddp'], 3)} | {cell(r['cpu_ms_per_step'], 1)}"
                f" | {cell(r['cpu_time_ratio_to_ddp'], 3)} | {r['launch_s']['median']:.1f} |"
            )
    losses = [r["last_loss"] for precision in PRECISIONS for r in res[precision].values()]
    lines += [
        "",
        f"Every configuration ended on the same data with loss {min(losses):.3f}-"
        f"{max(losses):.3f}: the same training, sharded differently.",
    ]
    lines += ["", "## Reading the numbers", "", *notes(res)]
    return "\n".join(lines) + "\n"


def notes(res: dict) -> list[str]:
    """The gaps between measured and predicted, each said only where the numbers show it."""
    out = []

    def bpp(precision: str, strategy: str, key: str) -> float:
        return res[precision][strategy]["bytes_per_param"][key]

    def pred(precision: str, strategy: str, key: str) -> float:
        return res[precision][strategy]["predicted"]["bytes_per_param"][key]

    if all(
        abs(bpp(p, "ZeRO 1", "gradients") - bpp(p, "ZeRO 2", "gradients")) < 0.01
        for p in PRECISIONS
    ):
        out.append(
            "- **ZeRO 1 measures like ZeRO 2 in gradients** ("
            + ", ".join(f"{bpp(p, 'ZeRO 1', 'gradients'):g}" for p in PRECISIONS)
            + " bytes/param in float32, bf16; the formula counts them whole: "
            + ", ".join(f"{pred(p, 'ZeRO 1', 'gradients'):g}" for p in PRECISIONS)
            + "). DeepSpeed's stage 1 reduces the gradients at the end of the window's backward"
            " and then keeps only its own partition of the result; the whole gradients exist only"
            " during backward, up to that reduction, and that peak is what the paper counts. A"
            " snapshot between backward and step cannot see it."
        )
    extra = [
        s
        for s in ("ZeRO 1", "ZeRO 2", "ZeRO 3")
        if abs(bpp("no", s, "optimizer") - pred("no", s, "optimizer") - 4 / RANKS) < 0.01
    ]
    if extra:
        z3, fsdp = (res["no"][s]["bytes_per_param"]["total"] for s in ("ZeRO 3", "FSDP2"))
        z3_pred = res["no"]["ZeRO 3"]["predicted"]["bytes_per_param"]["total"]
        ratio, bf16_ratio = (res[p]["ZeRO 3"]["ratio_to_ddp"] for p in PRECISIONS)
        out.append(
            "- **float32 under DeepSpeed keeps a float32 master copy anyway** ("
            + ", ".join(extra)
            + f": optimizer state {4 / RANKS:g} bytes/param above the formula). DeepSpeed keeps"
            " a separate float32 partition of the weights for the optimizer even when the weights"
            f" are already float32, so ZeRO 3 in float32 measures (4+4+4+8)/N = {z3:g}"
            f" bytes/param, not (4+4+8)/N = {z3_pred:g} (FSDP2, with no such copy: {fsdp:g})."
            f" That puts float32 ZeRO 3 at {ratio:.3f}x DDP"
            + (", above the 0.55x target" if ratio > 0.55 else "")
            + f"; in bf16, where that master copy is the paper's own K, ZeRO 3 is at"
            f" {bf16_ratio:.3f}x."
            + (
                " In float32 ZeRO 1 this and the gradient gap above cancel: "
                + "+".join(
                    f"{bpp('no', 'ZeRO 1', k):g}" for k in ("parameters", "gradients", "optimizer")
                )
                + " measured against "
                + "+".join(
                    f"{pred('no', 'ZeRO 1', k):g}" for k in ("parameters", "gradients", "optimizer")
                )
                + " predicted."
                if "ZeRO 1" in extra
                else ""
            )
        )
    buckets = res["no"]["DDP"]["ddp_bucket_bytes"]
    if buckets:
        ddp = res["no"]["DDP"]["total_bytes"] + buckets
        fsdp, z3 = (res["no"][s]["total_bytes"] / ddp for s in ("FSDP2", "ZeRO 3"))
        what = (
            f"here {buckets / MIB:.1f} MiB per rank in float32, by DDP's own logging data;"
            f" counted, they would put float32 FSDP2 at {fsdp:.2f}x DDP and ZeRO 3 at {z3:.2f}x"
        )
    else:
        what = "their size is not reported by this torch"
    other = max(r["state_bytes"]["other"] for v in res.values() for r in v.values())
    out.append(
        "- **DDP's real footprint is larger than measured.** Its C++ gradient buckets (with"
        " PyTorch's default `gradient_as_bucket_view=False`, another copy of the gradients:"
        f" {what}) are invisible to `state_bytes`, so the DDP totals, and every ratio's"
        " denominator, undercount DDP: the sharded strategies' ratios are conservative. (What"
        " `state_bytes` counts as 'other', engine buffers beside the model state, came to at"
        f" most {other} byte{'s' * (other != 1)} here.)"
    )
    same = all(
        res["bf16"][s]["total_bytes"] == res["no"][s]["total_bytes"] for s in ("DDP", "FSDP2")
    )
    if same:
        out.append(
            "- **bf16 does not shrink DDP's or FSDP2's state.** nbaccel's bf16 there is autocast"
            " over float32 weights (FSDP2: float32 sharded state, bf16 only for compute), so"
            " their totals equal the float32 ones. The paper's (2+2+K) with K = 12 assumes 16-bit"
            " weights and gradients plus float32 masters, which is what DeepSpeed's bf16 mode"
            " stores; for DDP and FSDP2 the prediction uses the stored 4+4+8. Both give 16 bytes"
            " per parameter replicated, split differently."
        )
    out.append(
        "- **Throughput on 2 shared CPU cores** is one core's compute per rank plus what each"
        " strategy adds on that same core: gloo collectives over loopback (CPU work here, unlike"
        " NCCL on GPUs), DeepSpeed's gradient flattening and partition copies, FSDP2's"
        " all-gathers and reduce-scatters; in bf16, this CPU's emulated bfloat16 matrix"
        " multiplies dominate and narrow the gaps. On this shared machine, read a ratio"
        " with its IQR. None of it says anything about GPU speed."
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="launches of each configuration")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per float32 launch")
    parser.add_argument(
        "--bf16-steps",
        type=int,
        default=5,
        help="timed steps per bf16 launch (emulated on CPUs"
        " without AVX-512 BF16 or AMX: ~4x slower)",
    )
    parser.add_argument("--out", default="benchmarks/results/sharding-cpu.json")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2, for a median and quartiles")
    if min(args.steps, args.bf16_steps) < 1:
        parser.error("--steps and --bf16-steps must be at least 1")
    steps = {"no": args.steps, "bf16": args.bf16_steps}
    start_load = os.getloadavg()[0]
    began = time.perf_counter()
    launch("DDP", "no", 1)  # warm-up, not recorded: the fork server, imports ...
    launch("ZeRO 2", "no", 1)  # ... and DeepSpeed's op, built or loaded from torch's cache
    configs = [(s, p) for p in PRECISIONS for s in STRATEGIES]
    runs: dict[tuple[str, str], list[list[dict]]] = {c: [] for c in configs}
    for i in range(args.rounds):
        for strategy, precision in configs[i % len(configs) :] + configs[: i % len(configs)]:
            start = time.perf_counter()
            ranks = launch(strategy, precision, steps[precision])
            ranks[0]["launch_s"] = time.perf_counter() - start
            runs[strategy, precision].append(ranks)
        print(f"round {i + 1}/{args.rounds} ({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    command = f"python benchmarks/sharding.py --rounds {args.rounds} --steps {args.steps}"
    command += f" --bf16-steps {args.bf16_steps}"
    config = {
        "command": command,
        "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}), ReLU between",
        "batch_per_rank": BATCH,
        "optimizer": f"AdamW(lr={LR})",
        "ranks": RANKS,
        "warmup_steps": WARMUP,
        "timed_steps": {NAMES[p]: n for p, n in steps.items()},
        "rounds": args.rounds,
        "deepspeed_config": SHARD_ALL,
        "seconds": round(time.perf_counter() - began, 1),
    }
    results = summarise(runs)
    report = {"machine": machine(start_load), "config": config, "results": results}
    report["target"] = target(results)
    text = to_markdown(report)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
