"""Where each rank's time goes, drawn: the live panel's stacked bars.

``Run.breakdown()`` splits every rank's training loop into data, compute, communication and
other seconds; ``BreakdownBars`` draws them as one horizontal bar per rank, the four parts
stacked, on an axes of the live panel. Like the panel's lines, the bars are made once (again
only when a rank is heard for the first time) and then only moved and resized, so a redraw
costs little beyond the render.

The colours say the story at a glance: a rank slowed by its data has a long orange part, and
the ranks waiting for it a long red one (communication).

This module imports no torch; ``panel`` imports it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..channel import BREAKDOWN

if TYPE_CHECKING:
    from ..straggler import Straggler

COLOURS = {"data": "tab:orange", "compute": "tab:blue", "communication": "tab:red"}
COLOURS["other"] = "darkgray"  # the loop's own Python: logging, evaluation, checkpoints
#: Where a part not measured apart (``channel.UNMEASURED``) went instead.
INSIDE = {"data": "other", "communication": "compute"}


def estimate_notes(estimated: Mapping[str, float]) -> list[str]:
    """One line per sampling rate of ``Run.estimated()``: which parts are estimates."""
    rates: dict[float, list[str]] = {}
    for part, every in estimated.items():
        rates.setdefault(every, []).append(part)
    return [
        f"{' and '.join(parts)} estimated: GPU events time 1 span in {every:g}"
        for every, parts in rates.items()
    ]


class BreakdownBars:
    """One stacked horizontal bar per rank on ``ax``, redrawn in place by ``update``."""

    def __init__(self, ax) -> None:
        self.ax = ax
        self.ranks: tuple[int, ...] = ()
        self.bars: dict[str, list[Any]] = {}  # part -> one Rectangle per rank, in rank order
        self.notes: tuple[str, ...] = ()
        ax.set_xlabel("where each rank's seconds go")
        self._key()

    def update(
        self,
        breakdown: dict[int, dict[str, float]],
        straggler: Straggler | None,
        unmeasured: list[str] = (),
        estimated: Mapping[str, float] | None = None,
    ) -> None:
        """Set each rank's bar to its parts' seconds (``Run.breakdown()``); the straggler's
        label (``Run.straggler()``) turns bold, in the colour of what slows it. Said under the
        bars: the parts not measured apart (``Run.unmeasured()``), with where they went, and
        those estimated from a sample (``Run.estimated()``), with its rate."""
        notes = tuple(f"{part} not measured apart (in {INSIDE[part]})" for part in unmeasured)
        notes += tuple(estimate_notes(estimated or {}))
        if notes != self.notes:
            self.notes = notes
            self.ax.set_xlabel("\n".join(["where each rank's seconds go", *notes]))
        ranks = tuple(sorted(breakdown))
        if ranks != self.ranks:
            self._build(ranks)
        longest = 0.0
        for i, rank in enumerate(ranks):
            left = 0.0
            for part in BREAKDOWN:
                seconds = max(breakdown[rank].get(part, 0.0), 0.0)
                bar = self.bars[part][i]
                bar.set_x(left)
                bar.set_width(seconds)
                left += seconds
            longest = max(longest, left)
        self.ax.set_xlim(0, longest * 1.04 or 1.0)
        for rank, label in zip(ranks, self.ax.get_yticklabels(), strict=True):
            if straggler is not None and rank == straggler.rank:
                label.set(color=COLOURS[straggler.cause], fontweight="bold")
            else:
                label.set(color="black", fontweight="normal")

    def _key(self) -> None:
        """The parts' names in their colours, one after the other above the bars: what a
        legend shows, for a third of a legend's drawing time (paid at every panel)."""
        style = {"fontsize": 9, "fontweight": "bold", "va": "bottom"}
        first = BREAKDOWN[0]
        word = self.ax.text(0, 1.03, first, transform=self.ax.transAxes, color=COLOURS[first])
        word.set(**style)
        for part in BREAKDOWN[1:]:  # each placed after the one before it ends
            word = self.ax.annotate(
                part, (1, 0), xycoords=word, xytext=(6, 0), textcoords="offset points", **style
            )
            word.set_color(COLOURS[part])

    def _build(self, ranks: tuple[int, ...]) -> None:
        """Bars for a new set of ranks (the first update, or a rank heard late)."""
        for container in list(self.ax.containers):
            container.remove()
        y = range(len(ranks))
        for part in BREAKDOWN:
            container = self.ax.barh(y, [0.0] * len(ranks), color=COLOURS[part], label=part)
            self.bars[part] = list(container.patches)
        self.ax.set_yticks(y, [f"rank {r}" for r in ranks])
        self.ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top, as the legends list them
        self.ranks = ranks
