"""The live view: loss and throughput drawn while the workers train, or one line of text.

``LiveView`` redraws a ``records.Run`` through a front end:

* ``NotebookFrontend``: a PNG rendered by matplotlib's object API (no pyplot, so no backend and
  no stray figure at the end of the cell) and a progress line, each one display handle updated
  in place. The panel shows loss and throughput, and, once the ranks time their loops, where
  each rank's time goes (``bars``). Works in JupyterLab, Notebook 7 and VS Code,
  and an executed notebook keeps the last panel as an ``image/png`` output.
* ``ConsoleFrontend``: a throttled one-line progress on stderr (scripts, ``nbaccel launch``, CI).

Tests inject their own front end and clock. Redraws are throttled: text about five times a
second, the panel at most once a second; after the first three panels, less often when drawing
it is slow, so that drawing costs the training at most 1% of a core. One figure is kept and
updated, not rebuilt. This module imports no torch.

Data flows one way: workers -> ``channel`` -> ``Run`` -> here. This module reads the counters'
names from ``channel`` and takes a ``Run`` as it is given; only what draws imports it.
"""

from __future__ import annotations

import bisect
import functools
import io
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...env import in_notebook
from ..channel import MEMORY, SAMPLES, STEPS, TOTAL_STEPS
from .bars import BreakdownBars, straggler_note

if TYPE_CHECKING:
    from ..records import Run


class Frontend(Protocol):
    draws: bool  # False: text only

    def text(self, line: str) -> None: ...
    def image(self, png: bytes) -> None: ...
    def close(self) -> None: ...


def loss_name(run: Run) -> str | None:
    """The metric to plot against step: the first with "loss" in its name, else the first."""
    names = run.names()
    return next((n for n in names if "loss" in n.lower()), names[0] if names else None)


def progress(run: Run, total_steps: int | None = None, now: float | None = None) -> str:
    """``step 120/400 | 2 ranks on CPU | 1,830 samples/s | 35 ms/step | loss 0.41 | 12 s, ETA 3 s``,
    then ``| rank 1 is the straggler (data: others waited 3.2 s)`` when one rank is waited for.

    Reads only each rank's latest records, so it costs the same however long the run is. The
    clock of a run still going reads ``now`` (default: the wall clock, as the records do).
    """
    parts = []
    name = loss_name(run)
    steps = run.latest(STEPS)
    step = int(max(steps.values())) if steps else None
    if step is None and name:  # no optimizer counted: steps done = the last step index + 1
        step = max(run.latest_step(name).values()) + 1
    if step is not None:
        parts.append(f"step {step}" + (f"/{total_steps}" if total_steps else ""))
    ranks = run.label or f"{run.world_size} rank{'s' if run.world_size > 1 else ''}"
    parts.append(f"{ranks} on {run.device}" if run.device else ranks)
    if run.latest_rate(SAMPLES):
        parts.append(f"{run.samples_per_s():,.0f} samples/s")
    step_rates = [r for r in run.latest_rate(STEPS).values() if r > 0]
    if step_rates:  # the slowest rank sets the pace of a synchronous step
        parts.append(f"{1000 / min(step_rates):,.0f} ms/step")
    if name:
        values = list(run.latest(name).values())
        parts.append(f"{name} {sum(values) / len(values):.4g}")
    memory = run.latest(MEMORY)
    if memory:
        parts.append(f"max {max(memory.values()):,.0f} MB")
    elapsed = (run.finished or (time.time() if now is None else now)) - run.started
    clock = f"{elapsed:.0f} s"
    if total_steps and step and not run.finished:
        clock += f", ETA {elapsed / step * max(total_steps - step, 0):.0f} s"
    parts.append(clock)
    note = straggler_note(run)
    if note:
        parts.append(note)
    return " | ".join(parts)


def figure(run: Run, total_steps: int | None = None, now: float | None = None):
    """The panel as a matplotlib ``Figure``: loss per rank (faint) and mean (bold) against step;
    samples/s per rank and in total against time; where each rank's time goes, if measured."""
    panel = Panel()
    panel.update(run, total_steps, now)
    return panel.fig


def png(run: Run, total_steps: int | None = None, now: float | None = None) -> bytes:
    return Panel().png(run, total_steps, now)


def to_png(fig) -> bytes:
    """A matplotlib ``Figure`` as PNG bytes, through Agg (no pyplot, so no backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


BOLD = {"lw": 2.2, "color": "black", "zorder": 3}  # the mean and the total, over the ranks


class Panel:
    """One figure redrawn with new data: its axes, ticks, lines and legend are made once and
    updated, not built again for every redraw."""

    def __init__(self) -> None:
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=(10, 3.4), dpi=80)  # no layout engine: it doubles the time
        self.fig.subplots_adjust(left=0.07, right=0.98, bottom=0.15, top=0.8, wspace=0.22)
        self.loss_ax, self.speed_ax = self.fig.subplots(1, 2)
        self.speed_ax.set(xlabel="seconds", ylabel="samples/s", title="throughput")
        self.loss_ax.set(xlabel="step", title="nothing logged yet")
        self.title = self.fig.suptitle("", fontsize=10)
        self._lines: dict[tuple[Any, str], Any] = {}
        self.breakdown: BreakdownBars | None = None  # a third axes, once a rank has timed its loop

    def update(self, run: Run, total_steps: int | None = None, now: float | None = None) -> None:
        name = loss_name(run)
        if name:
            for rank, (steps, values) in sorted(run.series(name).items()):
                self._line(self.loss_ax, f"rank {rank}", _thin(steps, values), lw=1, alpha=0.35)
            self._line(self.loss_ax, "mean", _thin(*run.mean(name)), **BOLD)
            self.loss_ax.set(ylabel=name, title=name)
        rates = run.rates(SAMPLES)
        for rank, (times, values) in sorted(rates.items()):
            self._line(self.speed_ax, f"rank {rank}", _thin(times, values), lw=1, alpha=0.6)
        if len(rates) > 1:
            self._line(self.speed_ax, "total", _thin(*_total(rates)), **BOLD)
        for ax in (self.loss_ax, self.speed_ax):
            ax.set_autoscale_on(True)  # set_ylim below turned it off: fit the new data
            ax.relim()
            ax.autoscale_view()
        self.speed_ax.set_ylim(bottom=0)
        breakdown = run.breakdown()
        if breakdown:
            self._breakdown().update(breakdown, run.straggler())
        self.title.set_text(progress(run, total_steps, now))

    def _breakdown(self) -> BreakdownBars:
        """The breakdown's axes, made at the first breakdown: the figure widens to hold it
        (a loop without the counters keeps the two-axes panel)."""
        if self.breakdown is None:
            grid = self.fig.add_gridspec(1, 3, width_ratios=(1, 1, 0.8))
            for ax, cell in zip((self.loss_ax, self.speed_ax), grid, strict=False):
                ax.set_subplotspec(cell)
            self.fig.set_size_inches(13, 3.4)
            self.fig.subplots_adjust(left=0.055, right=0.985, wspace=0.25)
            self.breakdown = BreakdownBars(self.fig.add_subplot(grid[2]))
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


def _has_a_curve(run: Run) -> bool:
    """A panel is worth drawing once there is a logged metric or two throughput samples."""
    return bool(run.names() or run.rates(SAMPLES))


class NotebookFrontend:
    """One progress line and one PNG, each a display handle updated in place."""

    draws = True

    def __init__(self) -> None:
        self._text: Any = None
        self._image: Any = None

    def text(self, line: str) -> None:
        from IPython.display import display

        content = {"text/plain": line}
        if self._text is None:
            self._text = display(content, raw=True, display_id=True)
        else:
            self._text.update(content, raw=True)

    def image(self, data: bytes) -> None:
        from IPython.display import Image, display

        if self._image is None:
            self._image = display(Image(data=data), display_id=True)
        else:
            self._image.update(Image(data=data))

    def close(self) -> None:
        pass


class ConsoleFrontend:
    """One line on stderr: rewritten in place on a terminal; in a log (CI, a file), a plain
    line every ``log_interval`` seconds, since carriage returns there are only noise."""

    draws = False

    def __init__(
        self,
        stream=None,
        tty: bool | None = None,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream or sys.stderr
        self.clock = clock
        self.tty = _isatty(self.stream) if tty is None else tty
        self.log_interval = log_interval
        self._width = 0
        self._next_log = 0.0
        self._last = ""

    def text(self, line: str) -> None:
        self._last = line
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif self.clock() >= self._next_log:
            self.stream.write(line + "\n")
            self._next_log = self.clock() + self.log_interval
            self._last = ""
        self.stream.flush()

    def image(self, data: bytes) -> None:  # pragma: no cover - draws is False
        pass

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
        elif not self.tty and self._last:
            self.stream.write(self._last + "\n")  # the final state, if not yet written
        self.stream.flush()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@functools.cache
def _warm_up() -> None:
    """Import matplotlib and load its fonts, once a process: a second, paid when the first
    view is made rather than in its first panel."""
    Panel().render()


class LiveView:
    """Redraw a ``Run`` through a front end, throttled; ``close()`` draws the final state."""

    def __init__(
        self,
        frontend: Frontend | None = None,
        total_steps: int | None = None,
        save_png: str | None = None,
        text_interval: float = 0.2,
        image_interval: float = 1.0,
        first_panels: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.frontend = frontend or (NotebookFrontend() if in_notebook() else ConsoleFrontend())
        self.total_steps, self.save_png = total_steps, save_png
        self.text_interval, self.image_interval = text_interval, image_interval
        self.first_panels = first_panels  # drawn once a second whatever they cost
        self.clock = clock  # of the throttle and of a panel's cost; tests pass their own
        self._drawn = 0
        self._next_text = self._next_image = 0.0
        self._panel: Panel | None = None  # made at the first panel: most launches log nothing
        if self.frontend.draws:
            _warm_up()  # while the workers start, not in the first panel
        self._seen = -1  # record count at the last panel, to skip redraws with nothing new
        self.closed = False

    def update(self, run: Run, final: bool = False) -> None:
        if not run.records:
            return  # nothing logged or counted yet: show nothing rather than an empty panel
        now = self.clock()
        if not self._next_image:  # the first panel after a second of data, not at once
            self._next_image = now + self.image_interval
        total = self._total(run)
        if final or now >= self._next_text:
            self.frontend.text(progress(run, total))
            self._next_text = now + self.text_interval
        fresh = len(run.records) != self._seen and _has_a_curve(run)
        if self.frontend.draws and fresh and (final or now >= self._next_image):
            started = self.clock()
            self._panel = self._panel or Panel()
            self.frontend.image(self._panel.png(run, total))
            spent = self.clock() - started
            self._seen = len(run.records)
            self._drawn += 1
            # Never more than once a second. After the first few panels (so that even a short
            # run is seen to move), rarer when drawing is slow: 1% of a core at most, since on
            # a laptop the workers use every core and the panel's time is theirs.
            slow = 100 * spent if self._drawn >= self.first_panels else 0.0
            self._next_image = now + max(self.image_interval, spent + slow)

    def refresh_text(self) -> None:
        """Let the next ``update`` rewrite the progress line whatever the throttle says."""
        self._next_text = 0.0

    def _total(self, run: Run) -> int | None:
        total = run.latest(TOTAL_STEPS)
        return int(max(total.values())) if total else self.total_steps

    def close(self, run: Run) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.update(run, final=True)
            if self.save_png:
                panel = self._panel or Panel()  # the notebook's figure, if there is one
                with open(self.save_png, "wb") as f:
                    f.write(panel.png(run, self._total(run)))
        finally:
            self.frontend.close()
