"""A scaling measurement drawn: throughput, efficiency, where the loop's time goes, loss.

Matplotlib's object API (no pyplot), imported only when something is drawn. A flagged count is
drawn hollow and grey and labelled "spoiled: <short cause>"; only trusted counts make the
"measured" line, so no measured point stands above "ideal" beyond the threshold: such a point
is flagged (``flags.above_one``) and drawn as spoiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ...observe.channel import BREAKDOWN
from ...observe.live.bars import COLOURS
from ...observe.live.line import loss_name
from .flags import short

if TYPE_CHECKING:
    from ...observe.records import Run, Timing


class Measured(Protocol):
    """What the figure reads of a measurement (``result.py``'s ``Scaling``, which draws itself
    through this module; declared here, so this module does not import it back)."""

    runs: dict[int, Run]  # the median run per process count

    def rows(self) -> list[dict[str, Any]]: ...

    def timing(self, n: int) -> Timing: ...


SPOILED = {"color": "gray", "markerfacecolor": "none", "linestyle": "none", "marker": "o"}


def figure(scaling: Measured):
    """Throughput (each repeat a small point, the median, the ideal line), efficiency, the
    loop's shares per process count (when the runs timed their loops), and loss against the
    seconds since each median run's first training step (start-up left out, as in the
    table)."""
    from matplotlib.figure import Figure

    rows = scaling.rows()
    timed = [r for r in rows if r["compute_share"] == r["compute_share"]]  # not NaN
    fig = Figure(figsize=(15 if timed else 12, 3.4), dpi=80, layout="constrained")
    speed_ax, eff_ax, *time_ax, loss_ax = fig.subplots(1, 4 if timed else 3)
    throughput(speed_ax, rows)
    efficiency(eff_ax, rows)
    if timed:
        shares(time_ax[0], timed)
    loss(loss_ax, scaling)
    return fig


def _trusted(rows: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    return [r for r in rows if not r["flags"]], [r for r in rows if r["flags"]]


def _spoiled(ax, rows: list[dict[str, Any]], key: str, last: int) -> None:
    """Flagged counts: hollow grey points, each labelled with its flags' short names (``last``:
    the largest count on the axes)."""
    if not rows:
        return
    ax.plot([r["processes"] for r in rows], [r[key] for r in rows], label="spoiled", **SPOILED)
    for r in rows:
        causes = ", ".join(dict.fromkeys(short(f) for f in r["flags"]))
        right = r["processes"] == last  # the rightmost label reads leftwards, inside the axes
        ax.annotate(
            f"spoiled: {causes}",
            (r["processes"], r[key]),
            xytext=(-5 if right else 5, 5),
            textcoords="offset points",
            ha="right" if right else "left",
            fontsize=7,
            color="gray",
        )


def throughput(ax, rows: list[dict[str, Any]]) -> None:
    """Each repeat's samples/s (small points), the trusted medians joined ("measured"), the
    flagged ones hollow ("spoiled"), and the ideal line from the smallest count."""
    counts = [r["processes"] for r in rows]
    xs = [r["processes"] for r in rows for _ in r["throughputs"]]
    ys = [value for r in rows for value in r["throughputs"]]
    ax.plot(xs, ys, ".", color="tab:blue", alpha=0.35, markersize=5, label="repeats")
    good, bad = _trusted(rows)
    medians = [r["samples_per_s"] for r in good]
    ax.plot([r["processes"] for r in good], medians, "o-", label="measured (median)")
    _spoiled(ax, bad, "samples_per_s", counts[-1])
    if rows:
        ideal = rows[0]["samples_per_s"] / counts[0]
        ax.plot(counts, [ideal * n for n in counts], "--", color="gray", label="ideal")
    ax.set(xlabel="processes", ylabel="samples/s", title="throughput", xticks=counts)
    ax.legend(fontsize=8)


def efficiency(ax, rows: list[dict[str, Any]]) -> None:
    """The trusted counts' efficiency joined, the flagged ones hollow, 1.0 dashed."""
    counts = [r["processes"] for r in rows]
    good, bad = _trusted(rows)
    ax.plot([r["processes"] for r in good], [r["efficiency"] for r in good], "o-", label="measured")
    _spoiled(ax, bad, "efficiency", counts[-1])
    ax.axhline(1.0, ls="--", color="gray")
    top = max([1.2] + [1.15 * r["efficiency"] for r in rows if r["efficiency"] == r["efficiency"]])
    ax.set(xlabel="processes", title="scaling efficiency", xticks=counts, ylim=(0, top))


def loss(ax, scaling: Measured) -> None:
    """Each median run's loss against the seconds since its first training step."""
    for n, run in sorted(scaling.runs.items()):
        name = loss_name(run)
        if name:
            begin = run.started + scaling.timing(n).startup  # the first training step
            by_step = {r.step: r.time for r in run.records if r.name == name}
            steps, values = run.mean(name)
            ax.plot([by_step[s] - begin for s in steps], values, label=f"{n} proc")
            ax.set(ylabel=name)
    ax.set(xlabel="seconds since the first training step", title="loss")
    if ax.lines:
        ax.legend(fontsize=8)


def shares(ax, rows: list[dict[str, Any]]) -> None:
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
