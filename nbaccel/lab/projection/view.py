"""The projection drawn: throughput and efficiency curves per link, and a what-if panel.

The drawing side of ``projection``: the model (``model``) computes, this module draws it
(matplotlib's object API, no pyplot) and builds the ipywidgets panel. matplotlib, IPython and
ipywidgets are imported inside the functions, when something is drawn.
"""

from __future__ import annotations

import math

from .model import PRESETS, Interconnect, curve


def figure(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    links: list[Interconnect],
    measured: dict[int, float] | None = None,
    counts=(1, 2, 4, 8, 16, 32, 64),
    overlap: bool = True,
    accumulation: int = 1,
    title: str = "",
):
    """Throughput and efficiency against workers: one dashed curve per link, each labelled as a
    projection; ``measured`` (workers -> samples/s, all workers together) drawn as points."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6), dpi=80)
    speed_ax, eff_ax = fig.subplots(1, 2)
    args = (compute_seconds, gradient_bytes, batch_size)
    for link in links:
        points = curve(*args, link, counts, overlap, accumulation)
        label = f"projection: {link.name}"
        speed_ax.plot(counts, [p.samples_per_s for p in points], "--", label=label)
        eff_ax.plot(counts, [p.efficiency for p in points], "--", label=label)
    if measured:
        alone = batch_size / compute_seconds  # the projection's one worker, for the efficiency
        xs = sorted(measured)
        speed_ax.plot(xs, [measured[n] for n in xs], "ko", label="measured here")
        eff_ax.plot(xs, [measured[n] / (n * alone) for n in xs], "ko", label="measured here")
    for ax in (speed_ax, eff_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("workers")
    speed_ax.set_yscale("log")
    speed_ax.set(ylabel="samples/s, all workers", title="throughput")
    eff_ax.set(ylabel="scaling efficiency", title="efficiency", ylim=(0, 1.1))
    # one legend, right of both panels: inside, it hid measured points
    fig.legend(*eff_ax.get_legend_handles_labels(), loc="center right", fontsize=8)
    fig.suptitle(title or f"projections (dashed) unless marked measured; {_step(*args)}", size=9)
    fig.subplots_adjust(left=0.07, right=0.69, bottom=0.15, top=0.84, wspace=0.3)
    return fig


def _step(compute_seconds: float, gradient_bytes: float, batch_size: int) -> str:
    return (
        f"one worker: {compute_seconds * 1e3:.3g} ms a step of {batch_size} samples, "
        f"{gradient_bytes / 1e6:.3g} MB of gradients"
    )


def whatif(
    compute_seconds: float,
    gradient_bytes: float,
    batch_size: int,
    measured: dict[int, float] | None = None,
    loopback: Interconnect | None = None,
):
    """An interactive panel (ipywidgets): interconnect, model size, compute speed, accumulation
    steps, overlap and the largest worker count redraw the projection over the measured points.

    Model size multiplies the compute and the gradient bytes alike (an MLP's both grow with
    its parameters); "compute faster" divides the compute alone (a GPU's step against this
    machine's, say). Measured points belong to the model as measured: they are drawn at size
    x1 and speed x1 only. Without ipywidgets, or outside a notebook, it shows the static
    figure for every link and returns ``None``."""
    from IPython.display import Image, display

    from ...env import in_notebook  # read at the call: tests stand in for a notebook
    from ...observe.live.panel import to_png

    links = {**({loopback.name: loopback} if loopback else {}), **PRESETS}

    def show(fig) -> None:
        display(Image(to_png(fig)))

    try:
        import ipywidgets as w
    except ImportError:
        w = None
    if w is None or not in_notebook():
        show(figure(compute_seconds, gradient_bytes, batch_size, list(links.values()), measured))
        return None

    def redraw(link, size, faster, accumulation, overlap, most):
        counts = tuple(2**i for i in range(int(math.log2(most)) + 1))
        chosen = [links[link]] + ([loopback] if loopback and link != loopback.name else [])
        as_measured = size == 1 and faster == 1
        fig = figure(
            compute_seconds * size / faster,
            gradient_bytes * size,
            batch_size,
            chosen,
            measured if as_measured else None,
            counts,
            overlap,
            accumulation,
        )
        show(fig)

    slider = dict(continuous_update=False, style={"description_width": "10em"})
    return w.interactive(
        redraw,
        link=w.Dropdown(options=list(links), description="interconnect", style=slider["style"]),
        size=w.FloatLogSlider(
            value=1, base=10, min=-1, max=3, description="model size x", **slider
        ),
        faster=w.FloatLogSlider(
            value=1, base=10, min=0, max=3, description="compute faster x", **slider
        ),
        accumulation=w.IntSlider(value=1, min=1, max=64, description="accumulation", **slider),
        overlap=w.Checkbox(value=True, description="overlap (DDP buckets)"),
        most=w.SelectionSlider(
            options=[2, 4, 8, 16, 32, 64], value=64, description="workers up to", **slider
        ),
    )
