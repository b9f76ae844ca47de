"""The live view: loss and throughput drawn while the workers train, or one line of text.

``LiveView`` redraws a ``records.Run`` through a front end:

* ``NotebookFrontend``: the panel (``panel``) as a PNG and the progress line (``line``), each
  one display handle updated in place. The panel shows loss and throughput, and, once the
  ranks time their loops, where each rank's time goes (``bars``). Works in JupyterLab,
  Notebook 7 and VS Code, and an executed notebook keeps the last panel as an ``image/png``
  output.
* ``ConsoleFrontend``: a throttled one-line progress on stderr (scripts, ``nbaccel launch``, CI).

Tests inject their own front end and clock. Redraws are throttled: text about five times a
second, the panel at most once a second; after the first three panels, less often when drawing
it is slow, so that drawing costs the training at most 1% of a core. One figure is kept and
updated, not rebuilt. This module imports no torch.

Data flows one way: workers -> ``channel`` -> ``Run`` -> here. The view takes a ``Run`` as it
is given, and reads the counters' names from ``channel``; only what draws imports it.

A view never stops a launch: a panel that cannot be drawn (no matplotlib, a broken backend, a
bug) or a progress line that cannot be written says so once on stderr and is turned off, and
the training goes on (``LiveView._contained``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...env import in_notebook
from ..channel import TOTAL_STEPS
from .line import progress, timing_line
from .panel import Panel, has_a_curve

if TYPE_CHECKING:
    from ..records import Run

logger = logging.getLogger(__name__)

#: The two parts of a view that can fail on their own: the panel, or the whole view (the
#: progress line, the front end). A failed part is off for the rest of the view.
PANEL, VIEW = "panel", "view"


class Frontend(Protocol):
    draws: bool  # False: text only

    def text(self, line: str) -> None: ...
    def image(self, png: bytes) -> None: ...
    def close(self) -> None: ...


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

    def due(self) -> bool:
        """Whether ``text`` would write now (a log writes a line every ``log_interval``); the
        view skips making a line that nobody would see."""
        return self.tty or self.clock() >= self._next_log

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


def _yes() -> bool:
    return True


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


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
        self._seen = -1  # record count at the last panel, to skip redraws with nothing new
        self.closed = False
        self._off: set[str] = set()  # PANEL or VIEW, once it failed (``_contained``)
        #: said at ``close`` when the run recorded nothing (``hf.common.empty_hint``)
        self.empty_hint: str | None = None

    def update(self, run: Run, final: bool = False) -> None:
        """Redraw what is due; never raises: a part that fails is turned off (``_contained``)."""
        if run.records and VIEW not in self._off:  # nothing recorded yet: show nothing
            self._contained(VIEW, self._update, run, final)

    def _update(self, run: Run, final: bool) -> None:
        now = self.clock()
        if not self._next_image:  # the first panel after a second of data, not at once
            self._next_image = now + self.image_interval
        # only what is due is computed: in a loop run here, this is in the training's time
        text_due = final or (now >= self._next_text and getattr(self.frontend, "due", _yes)())
        image_due = self.frontend.draws and (final or now >= self._next_image)
        image_due = image_due and PANEL not in self._off
        total = self._total(run) if text_due or image_due else None
        if text_due:
            text = progress(run, total)
            timed = timing_line(run) if final and run.finished else None
            self.frontend.text(f"{text}\n{timed}" if timed else text)
            self._next_text = now + self.text_interval
        if image_due and len(run.records) != self._seen and has_a_curve(run):
            started = self.clock()
            self._contained(PANEL, self._draw_panel, run, total)
            spent = self.clock() - started
            self._seen = len(run.records)
            self._drawn += 1
            # Never more than once a second. After the first few panels (so that even a short
            # run is seen to move), rarer when drawing is slow: 1% of a core at most, since on
            # a laptop the workers use every core and the panel's time is theirs.
            slow = 100 * spent if self._drawn >= self.first_panels else 0.0
            self._next_image = now + max(self.image_interval, spent + slow)

    def _draw_panel(self, run: Run, total: int | None) -> None:
        self._panel = self._panel or Panel()
        self.frontend.image(self._panel.png(run, total))

    def refresh_text(self) -> None:
        """Let the next ``update`` rewrite the progress line whatever the throttle says."""
        self._next_text = 0.0

    def _total(self, run: Run) -> int | None:
        total = run.latest(TOTAL_STEPS)
        return int(max(total.values())) if total else self.total_steps

    def close(self, run: Run) -> None:
        """Draw the final state, save the panel if asked, and close the front end; never
        raises (but for an interrupt)."""
        if self.closed:
            return
        self.closed = True
        try:
            if not run.records and self.empty_hint and VIEW not in self._off:
                self._contained(VIEW, self.frontend.text, self.empty_hint)
            self.update(run, final=True)
            if self.save_png and PANEL not in self._off:
                self._contained(PANEL, self._save, run)
        finally:
            self._contained(VIEW, self.frontend.close)

    def _save(self, run: Run) -> None:
        panel = self._panel or Panel()  # the notebook's figure, if there is one
        with open(self.save_png, "wb") as f:
            f.write(panel.png(run, self._total(run)))

    def _contained(self, part: str, step: Callable[..., object], *args: Any) -> None:
        """Run one step of drawing. If it raises, ``part`` (PANEL or VIEW) is off for the rest
        of this view, and stderr says so once: a display must never cost the training."""
        try:
            step(*args)
        except Exception as err:
            logger.debug("the live %s failed and is off", part, exc_info=True)
            if part not in self._off:
                self._off.add(part)
                with contextlib.suppress(Exception):  # stderr may be what failed
                    print(self._note(part, err), file=sys.stderr, flush=True)

    def _note(self, part: str, err: Exception) -> str:
        """The one line that says what failed and what goes on."""
        failed = f"{type(err).__name__}: {' '.join(str(err).split())}"  # on one line
        if part == VIEW:
            return f"nbaccel: the live view failed ({failed}); the training goes on without it."
        unsaved = f", not saving {self.save_png}" if self.save_png else ""
        if isinstance(err, ImportError):  # matplotlib is in the notebook extra only
            missing = (err.name or "matplotlib").split(".")[0]
            return (
                f"nbaccel: the live panel needs {missing}, which this environment lacks; "
                f"showing the progress line only{unsaved} "
                "(pip install 'nbaccel[notebook]' draws it)."
            )
        return (
            f"nbaccel: the live panel failed ({failed}) and is off for the rest of this "
            f"run{unsaved}; the training goes on."
        )
