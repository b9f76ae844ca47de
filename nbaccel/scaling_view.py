"""The scaling lab's figure: throughput against the ideal line, efficiency, where the loop's time
goes, and loss over time.

The drawing side of ``scaling``: ``Scaling`` holds the runs and their numbers, this module draws
them (matplotlib's object API, no pyplot). ``Scaling.figure`` imports it when asked to draw.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .observe.channel import BREAKDOWN
from .observe.live.bars import COLOURS
from .observe.live.line import loss_name

if TYPE_CHECKING:
    from .scaling import Scaling


def figure(scaling: Scaling):
    """Throughput (with the ideal line), efficiency, the loop's shares per process count (when
    the runs timed their loops), and loss against the seconds since each run's first training
    step (start-up left out, as in the table)."""
    from matplotlib.figure import Figure

    rows = scaling.rows()
    counts = [r["processes"] for r in rows]
    timed = [r for r in rows if not math.isnan(r["compute_share"])]
    fig = Figure(figsize=(15 if timed else 12, 3.4), dpi=80, layout="constrained")
    speed_ax, eff_ax, *time_ax, loss_ax = fig.subplots(1, 4 if timed else 3)
    speed_ax.plot(counts, [r["samples_per_s"] for r in rows], "o-", label="measured")
    if rows:
        ideal = rows[0]["samples_per_s"] / counts[0]
        speed_ax.plot(counts, [ideal * n for n in counts], "--", color="gray", label="ideal")
    speed_ax.set(xlabel="processes", ylabel="samples/s", title="throughput", xticks=counts)
    speed_ax.legend(fontsize=8)
    eff_ax.plot(counts, [r["efficiency"] for r in rows], "o-")
    eff_ax.axhline(1.0, ls="--", color="gray")
    top = max([1.2] + [1.1 * r["efficiency"] for r in rows if r["efficiency"] == r["efficiency"]])
    eff_ax.set(xlabel="processes", title="scaling efficiency", xticks=counts, ylim=(0, top))
    if timed:
        shares(time_ax[0], timed)
    for n, run in sorted(scaling.runs.items()):
        name = loss_name(run)
        if name:
            begin = run.started + scaling.timing(n).startup  # the first training step
            by_step = {r.step: r.time for r in run.records if r.name == name}
            steps, values = run.mean(name)
            loss_ax.plot([by_step[s] - begin for s in steps], values, label=f"{n} proc")
            loss_ax.set(ylabel=name)
    loss_ax.set(xlabel="seconds since the first training step", title="loss")
    if loss_ax.lines:
        loss_ax.legend(fontsize=8)
    return fig


def shares(ax, rows: list[dict[str, float]]) -> None:
    """One bar per process count, its loop's mean shares stacked: the efficiency lost shows up
    as the communication (red) and data (orange) parts that grow with the count."""
    labels = [str(r["processes"]) for r in rows]  # categories: evenly spaced, whatever the counts
    bottom = [0.0] * len(rows)
    for part in BREAKDOWN:
        heights = [100 * r[f"{part}_share"] for r in rows]
        ax.bar(labels, heights, bottom=bottom, color=COLOURS[part], label=part, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(xlabel="processes", ylabel="% of the training loop", ylim=(0, 100))
    ax.set_title("where the time goes")
    handles, names = ax.get_legend_handles_labels()  # listed top down, as the bars stack
    ax.legend(handles[::-1], names[::-1], fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
