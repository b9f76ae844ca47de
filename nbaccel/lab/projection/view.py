"""The projection drawn: throughput and efficiency curves per link, and a what-if panel.

The drawing side of ``projection``: the model (``model``) computes, this module draws it
(matplotlib's object API, no pyplot) and builds the ipywidgets panel. matplotlib, IPython and
ipywidgets are imported inside the functions, when something is drawn.

Two rules keep the figure honest. Links whose curves coincide (``coinciding``) share one curve,
labelled with every name, so no curve hides another. A ``Check`` given to the figure says in
its title whether the projection was verified against a measurement on this machine; an
unverified projection is drawn lighter and labelled "unverified".
"""

from __future__ import annotations

import math
import textwrap

from .model import PRESETS, Check, Interconnect, coinciding, curve

UNVERIFIED = 0.4  # the curves' opacity when the check failed: visibly not a result


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
    check: Check | None = None,
):
    """Throughput and efficiency against workers: one dashed curve per group of coinciding
    links, labelled as a projection with every link's name; ``measured`` (workers ->
    samples/s, all workers together) drawn as points. With ``check``, the title gives its
    verdict, and a projection that failed it is drawn lighter and labelled "unverified"."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6), dpi=80)
    speed_ax, eff_ax = fig.subplots(1, 2)
    args = (compute_seconds, gradient_bytes, batch_size)
    failed = check is not None and not check.verified
    prefix, alpha = ("unverified projection", UNVERIFIED) if failed else ("projection", 1.0)
    for group in coinciding(*args, links, counts, overlap, accumulation):
        points = curve(*args, group[0], counts, overlap, accumulation)
        names = " = ".join(link.name for link in group)
        label = f"{prefix}: {names}" + (" (curves coincide)" if len(group) > 1 else "")
        style = dict(label=label, alpha=alpha)
        speed_ax.plot(counts, [p.samples_per_s for p in points], "--", **style)
        eff_ax.plot(counts, [p.efficiency for p in points], "--", **style)
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
    # one legend, right of both panels: inside, it hid measured points; long names wrap
    handles, labels = eff_ax.get_legend_handles_labels()
    wrapped = [textwrap.fill(label, 42, subsequent_indent="  ") for label in labels]
    fig.legend(handles, wrapped, loc="center right", fontsize=8)
    fig.suptitle(title or f"projections (dashed) unless marked measured; {_step(*args)}", size=9)
    top = 0.84
    if check is not None:  # the verdict, under the title, in the colour of its answer
        colour = "tab:red" if failed else "tab:green"
        fig.text(0.38, 0.9, check.headline, ha="center", size=9, weight="bold", color=colour)
        top = 0.8
    fig.subplots_adjust(left=0.07, right=0.69, bottom=0.15, top=top, wspace=0.3)
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
    check: Check | None = None,
) -> None:
    """An interactive panel (ipywidgets): interconnect, model size, compute speed, accumulation
    steps, overlap and the largest worker count redraw the projection over the measured points.

    Model size multiplies the compute and the gradient bytes alike (an MLP's both grow with
    its parameters); "compute faster" divides the compute alone (a GPU's step against this
    machine's, say). Measured points belong to the model as measured: they are drawn at size
    x1 and speed x1 only, and so is ``check``'s verdict (with accumulation 1 and the overlap it
    was checked with); any other setting is titled "hypothetical".

    The figure is an ordinary output, displayed once with a display id and then updated in
    place by the controls below it, so a saved notebook keeps it at the starting values.
    Without ipywidgets, or outside a notebook, it shows the static figure for every link."""
    from IPython.display import Image, display

    from ...env import in_notebook  # read at the call: tests stand in for a notebook
    from ...observe.live.panel import to_png

    links = {**({loopback.name: loopback} if loopback else {}), **PRESETS}
    args = (compute_seconds, gradient_bytes, batch_size)

    try:
        import ipywidgets as w
    except ImportError:
        w = None
    if w is None or not in_notebook():
        fig = figure(*args, list(links.values()), measured, check=check)
        display(Image(to_png(fig)))
        return None

    def draw(link, size, faster, accumulation, overlap, most) -> Image:
        counts = tuple(2**i for i in range(int(math.log2(most)) + 1))
        chosen = [links[link]] + ([loopback] if loopback and link != loopback.name else [])
        changed = [f"model size x{size:.3g}"] if size != 1 else []
        changed += [f"compute faster x{faster:.3g}"] if faster != 1 else []
        changed += [f"accumulation {accumulation}"] if accumulation != 1 else []
        if check is not None and check.link.overlaps and overlap != check.overlap:
            changed.append(f"overlap {'on' if overlap else 'off'}")  # not as it was checked
        hypothetical = (
            f"hypothetical ({', '.join(changed)}): projections that no measurement checks; "
            f"{_step(compute_seconds * size / faster, gradient_bytes * size, batch_size)}"
        )
        fig = figure(
            compute_seconds * size / faster,
            gradient_bytes * size,
            batch_size,
            chosen,
            measured if size == 1 and faster == 1 else None,
            counts,
            overlap,
            accumulation,
            title=hypothetical if changed else "",
            check=None if changed else check,
        )
        return Image(to_png(fig))

    style = {"description_width": "10em"}
    slider = dict(continuous_update=False, style=style)
    controls = dict(
        link=w.Dropdown(options=list(links), description="interconnect", style=style),
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

    def values() -> dict:
        return {name: control.value for name, control in controls.items()}

    # the figure first, as a plain output the saved notebook keeps; the controls redraw it
    handle = display(draw(**values()), display_id=True)

    def redraw(change) -> None:
        handle.update(draw(**values()))

    for control in controls.values():
        control.observe(redraw, names="value")
    display(w.VBox(list(controls.values())))
    return None
