"""The workers' output, relayed to the notebook prefixed by its rank: whole lines, and live bars.

Each worker writes into two pipes (its stdout and stderr); the supervisor hands what it reads
to ``Relay.feed``, which keeps the part after the last newline until the rest arrives, so
lines from different ranks never interleave mid-line.

A progress bar (tqdm) is the exception that must not wait for its newline: it writes
``"\\r" + bar`` on each update and ``"\\n"`` only when it closes. Jupyter's output area and
terminals both treat ``\\r`` as "back to the start of the line", so a rank's latest bar is
shown as ``\\r[rank 0] <bar>`` without a newline, and its next update overwrites it. That
unterminated line is *the open line*, and the rules that keep the view readable are:

- There is one open line, whichever stream it is on. Several ranks drawing bars at once would
  otherwise give a cell of thousands of alternating lines, so a free line goes to the lowest
  rank with a bar, which keeps it until its bar ends (its newline, EOF, or a clear), even if
  a lower rank starts drawing meanwhile; the other bars' latest state is held (kept, not
  shown). A held bar's final state is printed once, as a whole line, when it ends.
- A whole line printed on the open line's stream overwrites the bar (padded with spaces to
  cover it) and the bar is drawn again below it: the bar stays the last line, as
  ``tqdm.write`` keeps it. A line on the *other* stream ends the open line with ``"\\n"``
  first: Jupyter starts a new output block when stdout and stderr interleave, so the bar is
  drawn again there, and its last state stays visible above.
- A rank's own newline after its bar ends the bar: tqdm closes with ``"\\r 100%|...|"`` then
  ``"\\n"``, and the final state appears once, drawn if it was not already on the line.
- ``\\r`` inside a whole line keeps what a terminal shows: the text after the last ``\\r``
  (``"a\\rb\\n"`` prints ``b``; a ``\\r`` just before the newline moves nothing, as in
  Jupyter). A terminal would overlay a shorter text on a longer one; tqdm pads every redraw
  to cover the last one, so for bars the two agree. A bar cleared this way (tqdm's
  ``leave=False`` writes spaces) disappears rather than leaving an empty ``[rank 0]`` line.
- Text without a newline and without ``\\r`` (``print(..., end="")``) still waits for its
  newline, as before: it is not a bar, and showing it early would print it twice.

One line is dropped: DeepSpeed's note that it loaded its shared-memory op (``DeepSpeed
<op> built successfully``), one per process at every start, whichever code started DeepSpeed
(nbaccel's own start filters it too). It says nothing about the run.

Bytes are decoded only where a segment is complete, so a UTF-8 character split across two
reads never shows as U+FFFD. Each ``feed`` flushes what it wrote, so the cell sees updates
as they come; tqdm already limits its redraws to about ten a second.
"""

from __future__ import annotations

import codecs
import re
import sys
from collections.abc import Mapping
from typing import Literal, TextIO

#: DeepSpeed's line as each process loads a compiled op: noise at every start.
BUILT = re.compile(r"DeepSpeed \S+ built successfully")


def visible(data: bytes) -> bytes:
    """What a terminal line shows of ``data``: the part after the last ``\\r`` that moved text.

    >>> visible(b"\\r 10%\\r 20%"), visible(b"abc\\r"), visible(b"plain")
    (b' 20%', b'abc', b'plain')
    """
    body = data.rstrip(b"\r")
    return body[body.rfind(b"\r") + 1 :]


def decode(data: bytes, final: bool) -> str:
    """UTF-8 text of ``data``; unless ``final``, an unfinished character at its end waits."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final)


class Relay:
    """One launch's output: ``pipes`` maps a pipe's read end to (rank, "out" or "err").

    ``streams`` maps "out" and "err" to where their lines go (tests pass their own); by
    default ``sys.stdout`` and ``sys.stderr`` as they are at each write, the cell's in Jupyter.
    """

    def __init__(
        self,
        output: Literal["all", "main"] = "all",
        streams: Mapping[str, TextIO] | None = None,
    ) -> None:
        self.output = output
        self.targets = streams
        self.pipes: dict[int, tuple[int, str]] = {}
        self.partial: dict[int, bytes] = {}  # after the last newline, from the bar's last \r
        self.live: int | None = None  # the pipe whose bar is on the open line
        self.shown = ""  # the open line's text, "[rank R] " included
        self.written: set[str] = set()  # the streams to flush at the end of this feed

    def add(self, fd: int, rank: int, kind: str) -> None:
        self.pipes[fd] = (rank, kind)
        self.partial[fd] = b""

    def feed(self, fd: int, data: bytes) -> None:
        """Relay ``data`` read from ``fd``: its whole lines, and its bar's latest state.

        ``b""`` is the pipe's end: what is left is printed as a last line."""
        rank, _ = self.pipes[fd]
        *lines, rest = (self.partial[fd] + data).split(b"\n")
        if not data:
            lines, rest = ([rest] if rest else []), b""
        self.partial[fd] = _from_last_redraw(rest)  # bounded, however many redraws came
        if self.output == "main" and rank != 0:
            return
        for line in lines:
            self._print(fd, line)
        if self.live == fd and (bar := self._bar(fd)) is not None:
            self._draw(fd, bar)
        self._hand_over()
        self._flush()

    def end_line(self) -> None:
        """End the open line, so that something else can print after it (the launcher's own
        messages); the bar is drawn again with its next update."""
        self._end_line()
        self._flush()

    def close(self) -> None:
        """Print what every pipe left without a newline, as at its end, and end the line."""
        for fd in self.pipes:
            self.feed(fd, b"")
        self.end_line()

    def _print(self, fd: int, raw: bytes) -> None:
        """Print a whole line of ``fd``'s; it may end that rank's bar or overwrite another's."""
        rank, kind = self.pipes[fd]
        text = decode(visible(raw), final=True)
        if BUILT.fullmatch(text.strip()):
            return
        if b"\r" in raw and not text.strip():  # a bar cleared, then its newline
            if self.live == fd:
                self._erase()
            return
        line = f"[rank {rank}] {text}"
        if self.live is None or self.pipes[self.live][1] != kind:
            self._end_line()
            self._write(kind, line + "\n")
            return
        if self.live != fd or line != self.shown:  # else its bar's final state is shown
            self._write(kind, "\r" + line + self._padding(line))
        self._write(kind, "\n")
        self.live, self.shown = None, ""  # another rank's bar is drawn again below

    def _bar(self, fd: int) -> str | None:
        """The latest state of ``fd``'s bar, or None when its unfinished line has no ``\\r``."""
        rest = self.partial[fd]
        return decode(visible(rest), final=False) if b"\r" in rest else None

    def _draw(self, fd: int, bar: str) -> None:
        rank, kind = self.pipes[fd]
        if not bar.strip():  # cleared (tqdm's leave=False): nothing left to show
            if self.live == fd:
                self._erase()
            return
        line = f"[rank {rank}] {bar}"
        if self.live == fd and line == self.shown:
            return
        self._write(kind, "\r" + line + self._padding(line))
        self.live, self.shown = fd, line

    def _hand_over(self) -> None:
        """Give a free open line to the lowest rank whose bar waits, if one does."""
        if self.live is not None:
            return
        waiting = [
            (rank, fd)
            for fd, (rank, _) in self.pipes.items()
            if (self.output == "all" or rank == 0) and (self._bar(fd) or "").strip()
        ]
        if waiting:
            _, fd = min(waiting)
            self._draw(fd, self._bar(fd) or "")

    def _padding(self, line: str) -> str:
        """Spaces that cover what the open line showed beyond ``line`` (an overwrite does not
        clear the rest of the line, in a terminal or in Jupyter)."""
        return " " * (len(self.shown) - len(line)) if self.live is not None else ""

    def _erase(self) -> None:
        """Blank the open line and leave it free; the next text overwrites the blanks."""
        if self.live is None:
            return
        self._write(self.pipes[self.live][1], "\r" + " " * len(self.shown) + "\r")
        self.live, self.shown = None, ""

    def _end_line(self) -> None:
        if self.live is not None:
            self._write(self.pipes[self.live][1], "\n")
            self.live, self.shown = None, ""

    def _stream(self, kind: str) -> TextIO:
        if self.targets is not None:
            return self.targets[kind]
        return sys.stdout if kind == "out" else sys.stderr

    def _write(self, kind: str, text: str) -> None:
        self._stream(kind).write(text)
        self.written.add(kind)

    def _flush(self) -> None:
        for kind in sorted(self.written):
            self._stream(kind).flush()
        self.written.clear()


def _from_last_redraw(rest: bytes) -> bytes:
    """``rest`` from the ``\\r`` before its visible part: what a later read can still change."""
    cut = rest.rstrip(b"\r").rfind(b"\r")
    return rest[cut:] if cut > 0 else rest
