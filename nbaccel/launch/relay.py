"""The workers' output, relayed to the notebook a whole line at a time, prefixed by its rank.

Each worker writes into two pipes (its stdout and stderr); the supervisor hands what it reads
to ``Relay.feed``, which keeps the part after the last newline until the rest arrives, so
lines from different ranks never interleave mid-line.
"""

from __future__ import annotations

import sys
from typing import Literal


class Relay:
    """One launch's output: ``streams`` maps a pipe's read end to (rank, "out" or "err")."""

    def __init__(self, output: Literal["all", "main"] = "all") -> None:
        self.output = output
        self.streams: dict[int, tuple[int, str]] = {}
        self.partial: dict[int, bytes] = {}

    def add(self, fd: int, rank: int, kind: str) -> None:
        self.streams[fd] = (rank, kind)

    def feed(self, fd: int, data: bytes) -> None:
        """Print the whole lines of ``data`` (read from ``fd``); ``b""`` is the pipe's end."""
        rank, kind = self.streams[fd]
        buffered = self.partial.get(fd, b"") + data
        *lines, rest = buffered.split(b"\n")
        if not data:  # EOF: print what is left
            lines, rest = ([rest] if rest else []), b""
        self.partial[fd] = rest
        if self.output == "main" and rank != 0:
            return
        stream = sys.stdout if kind == "out" else sys.stderr
        for line in lines:
            print(f"[rank {rank}] {line.decode(errors='replace')}", file=stream)
        if lines:
            stream.flush()
