"""The GPU run's figures, for the lessons that quote them: what ``make gpu-check`` recorded.

``benchmarks/gpu.py`` writes ``benchmarks/results/gpu-<part>.json`` on a GPU machine only. These
helpers find such a file from the repository, and format it for lesson 3 (fp32/bf16/fp16
throughput and memory) and lesson 5 (the projection's reference points), always labelled with
the GPU, driver, CUDA, torch and date of the run. With no file they return None, and the lesson
says in one line that no GPU run is recorded. Nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

PRECISIONS = ("fp32", "bf16", "fp16")


def search_roots() -> list[Path]:
    """Where to look for ``benchmarks/results``: the current directory and the package's
    location, each with every folder above it."""
    here = Path.cwd().resolve()
    package = Path(__file__).resolve().parent
    roots: list[Path] = []
    for start in (here, package):
        for folder in (start, *start.parents):
            if folder not in roots:
                roots.append(folder)
    return roots


def results_path(name: str) -> Path | None:
    """The first ``benchmarks/results/gpu-<name>.json`` above the search roots, or None."""
    for root in search_roots():
        path = root / "benchmarks" / "results" / f"gpu-{name}.json"
        if path.is_file():
            return path
    return None


def gpu_results(name: str) -> dict | None:
    """The parsed ``gpu-<name>.json`` of a GPU run (``"amp"``, ``"projection"``, ...), or None
    when none is recorded. A smoke run or a run without a GPU is no GPU figure: None too."""
    path = results_path(name)
    if path is None:
        return None
    results = json.loads(path.read_text())
    machine = results.get("machine", {})
    if results.get("smoke") or not machine.get("gpus"):
        return None
    return results


def none_recorded(name: str) -> str:
    """The one line a lesson prints when no GPU run is recorded."""
    return (
        f"No GPU run has been recorded yet (no benchmarks/results/gpu-{name}.json): "
        "`make gpu-check` on a GPU machine writes it."
    )


def gpu_label(results: dict) -> str:
    """The GPU a run measured, with its driver, CUDA, torch and date."""
    m = results["machine"]
    return (
        f"{m['gpu']} (driver {m.get('driver') or 'unknown'}, CUDA {m.get('cuda')}, "
        f"torch {m.get('torch')}, {m.get('date')})"
    )


def amp_speedups(results: dict, model: str) -> dict[str, float]:
    """samples/s of each precision over fp32's, for one model of ``gpu-amp.json``."""
    r = results["models"][model]
    return {p: r[p]["samples_per_s"] / r["fp32"]["samples_per_s"] for p in PRECISIONS}


def amp_markdown(results: dict) -> str:
    """A Markdown table of ``gpu-amp.json``: samples/s (and x fp32) and peak MiB per precision
    and model, headed by the GPU it was measured on."""
    info = results.get("model_info", {})
    columns = [f"{p} samples/s" for p in PRECISIONS] + [f"{p} peak MiB" for p in PRECISIONS]
    lines = [
        f"**Measured on {gpu_label(results)}** by `make gpu-check` (`benchmarks/gpu.py`), not "
        "on this machine: training steps (AdamW) through the Accelerator, samples/s median "
        "(x fp32), and the allocator's peak over a step.",
        "",
        "| model | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * (2 * len(PRECISIONS)),
    ]
    for name, r in results["models"].items():
        x = amp_speedups(results, name)
        speeds = " | ".join(f"{r[p]['samples_per_s']:,.0f} (x{x[p]:.2f})" for p in PRECISIONS)
        peaks = " | ".join(
            "-" if r[p].get("peak_mib") is None else f"{r[p]['peak_mib']:,.0f}" for p in PRECISIONS
        )
        label = info.get(name, {}).get("description", name)
        lines.append(f"| {label} | {speeds} | {peaks} |")
    return "\n".join(lines)


def projection_reference(results: dict) -> dict:
    """Lesson 5's reference points from ``gpu-projection.json``: the projection's inputs
    measured on one GPU, and the measured samples/s (workers -> all workers together): 1 GPU,
    and 2 GPUs when ``projection.calibrate`` ran there."""
    c = results["calibrated"]
    measured = {1: c["samples_per_s_one_gpu"]}
    k = results.get("calibrate_2_gpus")
    if k:
        measured[k["workers"]] = k["workers"] * k["batch_size"] / k["ddp"]
    return {
        "gpu": gpu_label(results),
        "model": results.get("model", ""),
        "compute_seconds": c["compute_seconds"],
        "gradient_bytes": c["gradient_bytes"],
        "batch_size": c["batch_size"],
        "measured": measured,
    }


def projection_markdown(results: dict) -> str:
    """The reference points and the projection from them (with overlap), per preset link."""
    ref = projection_reference(results)
    points = results["projected"]
    workers = [p["workers"] for p in next(iter(points.values()))]
    measured = ", ".join(
        f"{n} GPU{'s' * (n > 1)}: {s:,.0f} samples/s" for n, s in sorted(ref["measured"].items())
    )
    from nbaccel.lab import projection

    sources = {  # each preset's published bandwidth, with where it is published
        "PCIe 4.0 x16": "https://pcisig.com/specifications",
        "PCIe 5.0 x16": "https://pcisig.com/specifications",
        "NVLink 3 (A100)": "https://www.nvidia.com/en-us/data-center/a100/",
        "NVLink 4 (H100)": "https://www.nvidia.com/en-us/data-center/h100/",
        "100 Gb Ethernet": "https://standards.ieee.org/ieee/802.3/10422/",
        "InfiniBand NDR": "https://www.nvidia.com/en-us/networking/quantum2/",
    }
    published = ", ".join(
        f"[{link.name}]({sources[link.name]}) {link.bandwidth / 1e9:g} GB/s"
        if link.name in sources
        else f"{link.name} {link.bandwidth / 1e9:g} GB/s"
        for link in projection.PRESETS.values()
    )
    latencies = ", ".join(
        f"{link.name} {link.latency * 1e6:g} us" for link in projection.PRESETS.values()
    )
    lines = [
        f"**Measured on {ref['gpu']}** by `make gpu-check`, not on this machine: {ref['model']}; "
        f"one step {ref['compute_seconds'] * 1e3:.4f} ms, "
        f"{ref['gradient_bytes'] / 1e6:.3f} MB of gradients. Measured: {measured}.",
        "",
        "The projection's inputs: **measured** on that GPU: the step time (1 GPU); **counted**: "
        f"the gradient bytes; **published**, one direction: each link's bandwidth ({published}); "
        f"**assumed**, not measured: each link's latency per ring step ({latencies}; orders of "
        "magnitude, see `nbaccel.lab.projection.model`), the backward pass as 2/3 of the step "
        "(`projection.BACKWARD_SHARE`), and, in the first table, full overlap "
        "(the limit of many small DDP buckets). A model whose gradients fit in one bucket "
        "overlaps nothing: the table without overlap, where recorded, is that case.",
        "",
        "Projected from that step (samples/s, efficiency), with overlap:",
        "",
        "| link | " + " | ".join(f"{n} GPU{'s' * (n > 1)}" for n in workers) + " |",
        "|---|" + "---:|" * len(workers),
    ]
    for link, curve in points.items():
        cells = " | ".join(f"{p['samples_per_s']:,.0f}, {p['efficiency']:.2f}" for p in curve)
        lines.append(f"| {link} | {cells} |")
    bare = results.get("projected_no_overlap")
    if bare:
        lines += ["", "Projected from the same step without overlap:", ""]
        lines += [
            "| link | " + " | ".join(f"{n} GPU{'s' * (n > 1)}" for n in workers) + " |",
            "|---|" + "---:|" * len(workers),
        ]
        for link, curve in bare.items():
            cells = " | ".join(f"{p['samples_per_s']:,.0f}, {p['efficiency']:.2f}" for p in curve)
            lines.append(f"| {link} | {cells} |")
    return "\n".join(lines)


def projection_figure(results: dict, links=None):
    """``nbaccel.lab.projection.figure`` from the GPU's inputs, its points labelled with the GPU."""
    from nbaccel.lab import projection

    ref = projection_reference(results)
    links = list(projection.PRESETS.values()) if links is None else links
    gpu = results["machine"]["gpu"]
    date = results["machine"].get("date")
    title = (
        f"points: measured on {gpu} ({date}); dashed: projections from its 1-GPU step, "
        "full overlap and preset latencies assumed"
    )
    fig = projection.figure(
        ref["compute_seconds"],
        ref["gradient_bytes"],
        ref["batch_size"],
        links,
        ref["measured"],
        title=title,
    )
    for text in (t for legend in fig.legends for t in legend.get_texts()):
        if text.get_text() == "measured here":
            text.set_text(f"measured on {gpu}")
    return fig
