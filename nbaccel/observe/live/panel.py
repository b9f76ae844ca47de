"""The live panel: loss per rank and their mean, throughput per rank and in total, each rank's
CPU memory, and where each rank's time goes (``bars``), in one matplotlib figure redrawn in
place.

matplotlib's object API draws it (no pyplot, so no backend and no stray figure at the end of
the cell), and ``to_png`` renders it. The title is the progress line (``line``). This module
imports no torch, and matplotlib only when a panel is made.
"""

from __future__ import annotations

import bisect
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..channel import MIN_RATE_SPAN_S, MIN_WINDOW_S, RSS, SAMPLES
from .bars import BreakdownBars
from .line import loss_name, progress, steps

if TYPE_CHECKING:
    from ..records import Run


def figure(run: Run, total_steps: int | None = None, now: float | None = None):
    """The panel as a matplotlib ``Figure``: loss per rank (faint) and mean (bold) against step;
    samples/s per rank and in total against time; each rank's CPU memory (its resident set size,
    in MiB) against time; where each rank's time goes, if measured."""
    panel = Panel()
    panel.update(run, total_steps, now)
    return panel.fig


def png(run: Run, total_steps: int | None = None, now: float | None = None) -> bytes:
    return Panel().png(run, total_steps, now)


def save_png(run: Run, path: str | os.PathLike, total_steps: int | None = None) -> Path:
    """The panel of ``run``'s records, written to ``path`` as a PNG; returns the path."""
    path = Path(path)
    path.write_bytes(png(run, total_steps))
    return path


def to_png(fig) -> bytes:
    """A matplotlib ``Figure`` as PNG bytes, through Agg (no pyplot, so no backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


#: What the loss axes says while no metric was logged.
NOTHING_LOGGED = (
    "nothing logged: log({'loss': loss}) on the Accelerator\n"
    "or a Recorder draws the loss here, per rank and their mean"
)
#: What the CPU memory's axes says while no rank recorded it.
NO_MEMORY = "no CPU memory recorded:\nthe Accelerator or a\nRecorder records it"
BOLD = {"lw": 2.2, "color": "black", "zorder": 3}  # the mean and the total, over the ranks
#: The axes' widths: loss, throughput, and a narrower CPU memory; the breakdown adds its own.
WIDTHS = (1, 1, 0.55)


_warmed = False  # the warm-up ran in this process (``warm_up``)


def warm_up() -> None:
    """Import matplotlib and load its fonts by drawing one empty panel, once a process: about
    half a second on 2 cores. A kernel calls it on its main thread while idle, after the cell
    that imported the launcher (``launch.client.prestart``), so that the first launch's panel
    is drawn at once. Never from a thread of its own: an import in a background thread races
    the cell's own imports (torch's and matplotlib's are not safe from two threads at once).
    Without matplotlib it does nothing: the launch's view says so, once, when it draws."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    try:
        Panel().render()
    except Exception:
        pass  # the launch's first panel meets it again, and the view says what is wrong


class Panel:
    """One figure redrawn with new data: its axes, ticks, lines and legend are made once and
    updated, not built again for every redraw."""

    def __init__(self) -> None:
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=(12, 3.4), dpi=80)  # no layout engine: it doubles the time
        self.fig.subplots_adjust(left=0.06, right=0.98, bottom=0.15, top=0.8, wspace=0.25)
        self.loss_ax, self.speed_ax, self.memory_ax = self.fig.subplots(1, 3, width_ratios=WIDTHS)
        self.speed_ax.set(
            xlabel="seconds since the launch",
            ylabel="samples/s",
            title="throughput",
        )
        self.loss_ax.set(xlabel="step", title="loss")
        # the process's resident set size, not the GPU's peak (that one is on the line)
        self.memory_ax.set(
            xlabel="seconds since the launch", ylabel="MiB", title="CPU memory (RSS)"
        )
        self.title = self.fig.suptitle("", fontsize=10)
        # what an axes with nothing to draw says instead (cleared once it has a curve)
        self._empty = {
            ax: ax.text(
                0.5,
                0.25,
                "",
                ha="center",
                va="center",
                wrap=True,
                fontsize=9,
                color="0.35",
                transform=ax.transAxes,
            )
            for ax in (self.loss_ax, self.speed_ax, self.memory_ax)
        }
        self._lines: dict[tuple[Any, str], Any] = {}
        self.breakdown: BreakdownBars | None = None  # a third axes, once a rank has timed its loop

    def update(self, run: Run, total_steps: int | None = None, now: float | None = None) -> None:
        name = loss_name(run)
        if name:
            for rank, (xs, values) in sorted(run.series(name).items()):
                self._line(self.loss_ax, f"rank {rank}", _thin(xs, values), lw=1, alpha=0.35)
            self._line(self.loss_ax, "mean", _thin(*run.mean(name)), **BOLD)
            _, unit, _ = steps(run)
            self.loss_ax.set(ylabel=name, title=name, xlabel=f"step ({unit})")
        self._empty[self.loss_ax].set_text("" if name else NOTHING_LOGGED)
        rates = run.rates(SAMPLES)
        self.speed_ax.set_title(_speed_title(run.rate_spans(SAMPLES)))
        for rank, (times, values) in sorted(rates.items()):
            self._line(self.speed_ax, f"rank {rank}", _thin(times, values), lw=1, alpha=0.6)
        if len(rates) > 1:
            self._line(self.speed_ax, "total", _thin(*_total(rates)), **BOLD)
        window = None if rates or not run.finished else run.throughput()
        if window is not None:  # too short for a live curve: the run's own throughput instead
            t = run.timing()
            span = [t.startup, t.startup + t.training]
            self._line(self.speed_ax, "training window", (span, [window, window]), **BOLD)
        self._empty[self.speed_ax].set_text("" if rates else _no_rate(run, window))
        drawn = bool(rates) or window is not None  # no ticks on an axes with nothing drawn
        self.speed_ax.tick_params(labelleft=drawn, labelbottom=drawn, left=drawn, bottom=drawn)
        memory = run.over_time(RSS)
        for rank, (times, values) in sorted(memory.items()):
            self._line(self.memory_ax, f"rank {rank}", _thin(times, values), lw=1)
        self._empty[self.memory_ax].set_text("" if memory else NO_MEMORY)
        shown = bool(memory)
        self.memory_ax.tick_params(labelleft=shown, labelbottom=shown, left=shown, bottom=shown)
        for ax in (self.loss_ax, self.speed_ax, self.memory_ax):
            ax.set_autoscale_on(True)  # set_ylim below turned it off: fit the new data
            ax.relim()
            ax.autoscale_view()
        self.speed_ax.set_ylim(bottom=0)
        self.memory_ax.set_ylim(bottom=0)  # the share of memory held, not its wiggles
        breakdown = run.breakdown()
        if breakdown:
            self._breakdown().update(breakdown, run.straggler(), run.unmeasured(), run.estimated())
        self.title.set_text(progress(run, total_steps, now))

    def _breakdown(self) -> BreakdownBars:
        """The breakdown's axes, made at the first breakdown: the figure widens to hold it
        (a loop without the counters keeps the three-axes panel)."""
        if self.breakdown is None:
            grid = self.fig.add_gridspec(1, 4, width_ratios=(*WIDTHS, 0.8))
            for ax, cell in zip((self.loss_ax, self.speed_ax, self.memory_ax), grid, strict=False):
                ax.set_subplotspec(cell)
            self.fig.set_size_inches(15, 3.4)
            self.fig.subplots_adjust(left=0.045, right=0.985, wspace=0.28)
            self.breakdown = BreakdownBars(self.fig.add_subplot(grid[3]))
        return self.breakdown

    def png(self, run: Run, total_steps: int | None = None, now: float | None = None) -> bytes:
        self.update(run, total_steps, now)
        return self.render()

    def render(self) -> bytes:
        """The figure as it stands, as PNG bytes."""
        return to_png(self.fig)

    def _line(self, ax, label: str, data: tuple[list, list], **style) -> None:
        line = self._lines.get((ax, label))
        if line is not None:
            line.set_data(*data)
            return
        (self._lines[ax, label],) = ax.plot(*data, label=label, **style)
        # ranks in order, then the mean or total, however late a rank's first record came
        lines = sorted(ax.lines, key=lambda line: _legend_order(line.get_label()))
        loc = "upper right" if ax is self.loss_ax else "lower right"
        ax.legend(handles=lines, loc=loc, fontsize=8)


def _speed_title(spans: tuple[float, float] | None) -> str:
    """The throughput axes' title: the seconds its points' rates span (``Run.rate_spans``),
    as the progress line says its own: "the last 1-3 s" in a run (its first points cover less
    than the window), "the last 1-13 s" once a point crossed a 10 s pause that counted nothing,
    "the last 3 s" when every point covers about the window."""
    if spans is None:
        return "throughput"
    lo, hi = (f"{span:.0f}" for span in spans)
    return f"throughput (each point: the last {hi if lo == hi else f'{lo}-{hi}'} s)"


def _no_rate(run: Run, window: float | None) -> str:
    """Why the throughput axes has no live curve: no samples counted, or too short a span of
    them (then, once the run ended, the bold line is its training window's throughput)."""
    timing = run.timing()
    if not timing.samples:
        return (
            "no samples counted: a prepared DataLoader counts them,\n"
            "or log(..., samples=len(batch)) in your own loop"
        )
    samples = sum(timing.samples.values())
    if window is not None:
        return (
            f"{samples:,.0f} samples in {timing.training:.2f} s, too short for a live rate\n"
            f"(it needs {MIN_RATE_SPAN_S:g} s): the line is the run's throughput"
        )
    return (
        f"{samples:,.0f} samples counted over {timing.training:.2f} s:\n"
        f"a live rate needs {MIN_RATE_SPAN_S:g} s of records, a run's {MIN_WINDOW_S:g} s"
    )


def _legend_order(label: str) -> tuple[int, int]:
    kind, _, rank = label.partition(" ")
    return (0, int(rank)) if kind == "rank" else (1, 0)


def _thin(xs: list, ys: list, most: int = 500) -> tuple[list, list]:
    """At most ``most`` points, evenly spaced, the last one kept: a panel is 400 pixels wide."""
    if len(xs) <= most:
        return xs, ys
    stride = -(-len(xs) // most)
    keep = [*range(0, len(xs) - 1, stride), len(xs) - 1]
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _total(rates: dict[int, tuple[list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """Sum of the ranks' rates, each held at its last value until its next sample."""
    everyone = max(ts[0] for ts, _ in rates.values())  # before this, some ranks not yet heard
    times = sorted({t for ts, _ in rates.values() for t in ts if t >= everyone})
    total = []
    for t in times:
        s = 0.0
        for ts, vs in rates.values():
            i = _last_at_or_before(ts, t)
            s += vs[i] if i >= 0 else 0.0
        total.append(s)
    return times, total


def _last_at_or_before(times: list[float], t: float) -> int:
    return bisect.bisect_right(times, t) - 1


def has_a_curve(run: Run) -> bool:
    """A panel is worth drawing once there is a logged metric or two throughput samples."""
    return bool(run.names() or run.rates(SAMPLES))
