"""Numbers from the workers to the notebook: ``log()`` -> channel -> launching process -> display.

Worker side (``Channel``): ``Accelerator.log`` and the prepared DataLoader/optimizer add records
to a bounded buffer; every quarter second it is sent as datagrams on a Unix socket that the
launcher handed over (``NBACCEL_METRICS_FD``). A datagram is sent whole or not at all, without
waiting (``MSG_DONTWAIT``): when the notebook is busy the records wait in the buffer, and when
the buffer is full the oldest are dropped and counted. Logging never blocks and never raises.

Launcher side (``Run``): every record of a launch as plain data (rank, step, time, name, value),
plus per-rank results and failures; exportable to CSV/JSON and drawn by ``display``.

Neither side imports torch: values arrive here already converted to floats.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import pickle
import socket
import time
import weakref
from collections import deque
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHANNEL_VAR = "NBACCEL_METRICS_FD"
PANEL_VAR = "NBACCEL_SAVE_PANEL"  # a path: without a notebook, save the final panel there
#: Counters the library records by itself, cumulative per rank; rates come from differences.
SAMPLES, STEPS, MEMORY = "nbaccel/samples", "nbaccel/optimizer_steps", "nbaccel/max_memory_mb"
_PER_DATAGRAM = 40  # records; small enough for macOS's 2 KiB default datagram limit


@dataclass(frozen=True)
class Record:
    rank: int
    step: int
    time: float  # seconds since the epoch (time.time()), comparable across local ranks
    name: str
    value: float


class Channel:
    """The worker's end: buffer records, send them in batches, never block, never raise.

    Without a launcher listening (one process, torchrun), records go straight into ``run``.
    """

    def __init__(
        self,
        rank: int,
        fd: int | None = None,
        run: Run | None = None,
        capacity: int = 20_000,
        interval: float = 0.25,
    ) -> None:
        self.rank, self.run, self.capacity, self.interval = rank, run, capacity, interval
        self.dropped = 0
        self._sock = socket.socket(fileno=os.dup(fd)) if fd is not None else None
        self._buffer: deque[tuple] = deque()
        self._last_flush = time.monotonic()
        if self._sock is not None:
            _open_channels.add(self)

    @classmethod
    def from_environ(cls, rank: int, run: Run | None = None) -> Channel:
        fd = os.environ.get(CHANNEL_VAR)
        return cls(rank, int(fd) if fd and fd.isdigit() else None, run)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def add(self, step: int, values: dict[str, float]) -> None:
        now = time.time()
        if self._sock is None:
            if self.run is not None:
                self.run.add([Record(self.rank, step, now, k, v) for k, v in values.items()])
            return
        for name, value in values.items():
            self._buffer.append((step, now, name, value))
        while len(self._buffer) > self.capacity:
            self._buffer.popleft()
            self.dropped += 1
        self.tick()

    def tick(self) -> None:
        """Send if a quarter second has passed since the last send (cheap to call often)."""
        if self._sock is not None and time.monotonic() - self._last_flush >= self.interval:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        while self._sock is not None and self._buffer:
            batch = [self._buffer[i] for i in range(min(_PER_DATAGRAM, len(self._buffer)))]
            data = pickle.dumps(("metrics", self.rank, self.dropped, batch))
            try:
                self._sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return  # the notebook is busy: keep the records for the next flush
            except OSError:
                self.close()  # nobody listens any more; training goes on
                return
            for _ in batch:
                self._buffer.popleft()

    def close(self) -> None:
        if self._sock is not None:
            sock, self._sock = self._sock, None
            sock.close()


# A launch that runs its one process in the caller's process (no worker) hands its Run to the
# Accelerator created inside through this context variable, as it hands the environment over.
local_run: ContextVar[Run | None] = ContextVar("nbaccel_local_run", default=None)

# The launched worker flushes every open channel before it reports its result, so the last
# quarter second of records is not lost when the function did not call end_training(). Weak
# references: a channel that is gone needs no flush.
_open_channels: weakref.WeakSet[Channel] = weakref.WeakSet()


def flush_all() -> None:
    for channel in list(_open_channels):
        channel.flush()


def decode(datagram: bytes) -> tuple[list[Record], int, int]:
    """A datagram from ``Channel.flush``: its records, the sender's rank and drop count."""
    _, rank, dropped, batch = pickle.loads(datagram)
    return [Record(rank, *row) for row in batch], rank, dropped


@dataclass
class Run:
    """Everything a launch recorded: metrics from every rank, results, failures, timings.

    Pass one to ``notebook_launcher(..., run=run)`` to keep it; ``LaunchError.run`` holds it
    when a launch fails.
    """

    records: list[Record] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    failures: list[Any] = field(default_factory=list)
    dropped: dict[int, int] = field(default_factory=dict)
    world_size: int = 1
    label: str | None = None  # how the progress line names the ranks, e.g. "rank 0 of 2"
    device: str | None = None  # what they train on, for the progress line: "CPU", "GPU"
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def __post_init__(self) -> None:
        # (name, rank) -> that rank's records of that name, in order; kept up to date lazily,
        # so the live view's five-times-a-second progress line costs the same at any length.
        self._index: dict[tuple[str, int], list[Record]] = {}
        self._indexed = 0

    def reset(self) -> None:
        """Forget what was recorded (a restarted launch records from step 0 again); keep what
        the launch is: its world size, label and device."""
        kept = {"world_size": self.world_size, "label": self.label, "device": self.device}
        self.__dict__.update(Run(**kept).__dict__)

    def add(self, records: list[Record]) -> None:
        self.records += records

    def _sync(self) -> None:
        for r in self.records[self._indexed :]:
            self._index.setdefault((r.name, r.rank), []).append(r)
        self._indexed = len(self.records)

    def _by_rank(self, name: str) -> dict[int, list[Record]]:
        self._sync()
        return {rank: rs for (n, rank), rs in sorted(self._index.items()) if n == name}

    def names(self) -> list[str]:
        """The metric names the user logged (the library's own counters left out)."""
        self._sync()
        return sorted({n for n, _ in self._index if not n.startswith("nbaccel/")})

    def series(self, name: str) -> dict[int, tuple[list[int], list[float]]]:
        """``{rank: (steps, values)}`` for one metric."""
        return {
            rank: ([r.step for r in rs], [r.value for r in rs])
            for rank, rs in self._by_rank(name).items()
        }

    def mean(self, name: str) -> tuple[list[int], list[float]]:
        """The metric averaged over the ranks that logged each step."""
        by_step: dict[int, list[float]] = {}
        for rs in self._by_rank(name).values():
            for r in rs:
                by_step.setdefault(r.step, []).append(r.value)
        steps = sorted(by_step)
        return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]

    def rates(self, name: str = SAMPLES) -> dict[int, tuple[list[float], list[float]]]:
        """``{rank: (seconds since start, per second)}`` from a cumulative counter."""
        out = {}
        for rank, rs in self._by_rank(name).items():
            pairs = [
                (b.time - self.started, (b.value - a.value) / (b.time - a.time))
                for a, b in itertools.pairwise(rs)
                if b.time > a.time
            ]
            if pairs:
                out[rank] = ([t for t, _ in pairs], [v for _, v in pairs])
        return out

    def latest(self, name: str) -> dict[int, float]:
        """Each rank's last value of a metric."""
        return {rank: rs[-1].value for rank, rs in self._by_rank(name).items()}

    def latest_step(self, name: str) -> dict[int, int]:
        return {rank: rs[-1].step for rank, rs in self._by_rank(name).items()}

    def latest_rate(self, name: str = SAMPLES) -> dict[int, float]:
        """Each rank's rate between its last two records of a cumulative counter."""
        return {
            rank: (rs[-1].value - rs[-2].value) / (rs[-1].time - rs[-2].time)
            for rank, rs in self._by_rank(name).items()
            if len(rs) > 1 and rs[-1].time > rs[-2].time
        }

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps([asdict(r) for r in self.records]))
        return path

    def to_csv(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["rank", "step", "time", "name", "value"])
            writer.writerows((r.rank, r.step, r.time, r.name, r.value) for r in self.records)
        return path

    def figure(self, total_steps: int | None = None):
        """The live panel, redrawn from the records (a matplotlib ``Figure``)."""
        from .display import figure

        return figure(self, total_steps)

    def save_png(self, path: str | os.PathLike, total_steps: int | None = None) -> Path:
        from .display import png

        path = Path(path)
        path.write_bytes(png(self, total_steps))
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Run:
        records = [Record(**row) for row in json.loads(Path(path).read_text())]
        run = cls(records=records)
        if records:
            run.started = min(r.time for r in records)
            run.world_size = max(r.rank for r in records) + 1
        return run
