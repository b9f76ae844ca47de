"""Numbers from the workers to the notebook: ``log()`` -> channel -> launching process -> view.

Worker side (``Channel``): ``Accelerator.log`` and the prepared DataLoader/optimizer add records
to a bounded buffer; every quarter second it is sent as datagrams on a Unix socket that the
launcher handed over (``NBACCEL_METRICS_FD``). A datagram is sent whole or not at all, without
waiting (``MSG_DONTWAIT``): when the notebook is busy the records wait in the buffer, and when
the buffer is full the oldest are dropped and counted. Logging never blocks and never raises.

On a cluster (``launch/slurm``) there is no socket to the notebook: the channel appends the
same batches to ``metrics-<rank>.bin`` in the job folder (``NBACCEL_METRICS_DIR``), which only
the user can read and write, and the notebook reads them back from there (``read_frames``). One
``write`` per batch, on a file opened for appending. There a batch is JSON, never a pickle, and
is sealed with the launch's secret (``seal``: HMAC-SHA256 under ``NBACCEL_JOB_KEY``, a key made
for this launch alone): the notebook drops, and logs, a batch that lacks the seal, so a file
that something other than the job's ranks wrote (or another launch's) adds nothing to the run.

Launcher side: ``decode`` turns a datagram back into ``Record``s, which the launching process
keeps in a ``run.Run``. The names of the library's own counters live here, beside the channel
that carries them. Nothing here draws: the view (``live``) imports this module, never the
reverse.

Neither side imports torch: values arrive here already converted to floats.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import socket
import time
import weakref
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from ..env import CHANNEL_VAR, JOB_KEY_VAR, METRICS_DIR_VAR


class Run(Protocol):
    """What this module needs of ``records.Run`` (which imports this module, so this one names
    the two members it uses instead of importing it back)."""

    dropped: dict[int, int]

    def add(self, records: list[Record]) -> None: ...


#: Counters the library records by itself, cumulative per rank; rates come from differences.
#: ``MEMORY`` is not cumulative: a CUDA rank's GPU peak allocated, in MiB (2**20 bytes; the
#: name's "mb" predates that care and stays, as exported records carry it).
SAMPLES, STEPS, MEMORY = "nbaccel/samples", "nbaccel/optimizer_steps", "nbaccel/max_memory_mb"
#: A rank's CPU memory: its process's resident set size (RSS) in MiB, a gauge read with the
#: counters, every quarter second, never per step. The process alone: a DataLoader worker's
#: pages are mostly shared with it (fork), and the kernel's OOM killer picks one process.
RSS = "nbaccel/rss_mib"
#: The number of steps the run expects (``Recorder(total_steps=...)``): the progress line's ETA.
TOTAL_STEPS = "nbaccel/total_steps"
#: Where each rank's time went (``breakdown.py``): cumulative seconds, recorded with the counters.
TIME_DATA = "nbaccel/time/data"  # waiting for the next batch (the prepared DataLoader)
TIME_COMPUTE = "nbaccel/time/compute"  # forward + backward + optimizer step, minus communication
TIME_COMMUNICATION = "nbaccel/time/communication"  # blocked in gradient sync and collectives
TIME_LOOP = "nbaccel/time/loop"  # wall time since this rank's first batch
#: A part of the breakdown that a rank could not measure apart (1.0; recorded once): a loop that
#: is not nbaccel's, timed through hooks (``hf/``). That part's time
#: is inside another's: ``UNMEASURED + "communication"`` is inside compute, ``+ "data"`` in other.
UNMEASURED = "nbaccel/time/unmeasured/"
#: A part of the breakdown that a rank estimated from a sample of its spans (recorded once, with
#: the sample's rate: ``4.0`` is one kind of interval in 4 a step): CUDA's events
#: (``cuda_events.StepEvents``).
ESTIMATED = "nbaccel/time/estimated/"
#: The parts of ``Run.breakdown()``; "other" is the loop's time outside the first three.
BREAKDOWN = ("data", "compute", "communication", "other")
#: A live rate covers each rank's last this many seconds of counter records: a dozen quarter-
#: second intervals, so one late record or one pause of the notebook moves it by a few percent,
#: not by half (one interval's rate spiked to 2.4 times the median on a busy machine).
RATE_WINDOW_S = 3.0
#: No live rate comes from less than this (four counter intervals): until a rank has this much
#: of records the line shows no rate, and the panel's curve starts here.
MIN_RATE_SPAN_S = 1.0
#: A run's throughput needs a training window of at least one counter interval: its two ends
#: are the exact times of the first and last records, so the edges cost at most a batch, but a
#: shorter window says more about one hiccup of the machine than about the run.
MIN_WINDOW_S = 0.25
#: The optimizer steps' accumulation (``Accelerator(gradient_accumulation_steps=K)``), recorded
#: with the total steps so the line can count the total as it counts the steps.
ACCUMULATION = "nbaccel/gradient_accumulation_steps"
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
        self._file: str | None = None  # on a cluster: the file the batches are appended to
        self._buffer: deque[tuple] = deque()
        self._last_flush = time.monotonic()
        if self._sock is not None:
            _open_channels.add(self)

    def __getstate__(self) -> dict:
        """A pickled copy (of an Accelerator, say) is not connected: its records go to its
        ``run``, if it has one, else nowhere; the launcher hears only the original."""
        return {**self.__dict__, "_sock": None, "_buffer": deque()}

    @classmethod
    def from_environ(cls, rank: int, run: Run | None = None) -> Channel:
        folder, key = os.environ.get(METRICS_DIR_VAR), os.environ.get(JOB_KEY_VAR, "")
        if folder and key:  # (a folder without the launch's key: nobody would accept its files)
            channel = cls(rank, None, run)
            channel._file = os.path.join(folder, f"metrics-{rank}.bin")
            channel._sock = _FileSink(channel._file, bytes.fromhex(key))
            _open_channels.add(channel)
            return channel
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
            message = ("metrics", self.rank, self.dropped, batch)
            try:
                if isinstance(self._sock, _FileSink):
                    self._sock.write(message)
                else:  # the launcher's own socketpair: a peer it started
                    self._sock.send(pickle.dumps(message), socket.MSG_DONTWAIT)
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

# What open channels still hold, flushed as the launched worker reports (after
# ``rank_recorder.close_all``, which keeps the recorders' channels alive until then). Weak
# references: a channel that is gone had its recorder closed.
_open_channels: weakref.WeakSet[Channel] = weakref.WeakSet()


def flush_all() -> None:
    for channel in list(_open_channels):
        channel.flush()


class _FileSink:
    """The cluster's end instead of a socket: one sealed, length-prefixed batch appended per
    ``write``."""

    def __init__(self, path: str, key: bytes) -> None:
        self.path, self.key = path, key

    def write(self, message: tuple) -> None:
        data = seal(self.key, json.dumps(message).encode())
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, len(data).to_bytes(4, "big") + data)
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


def seal(key: bytes, body: bytes) -> bytes:
    """``body`` with its HMAC-SHA256 under ``key`` in front (32 bytes)."""
    return hmac.new(key, body, hashlib.sha256).digest() + body


def unseal(key: bytes, data: bytes) -> bytes | None:
    """The body ``seal`` sealed under ``key``; None for anything else."""
    mac, body = data[:32], data[32:]
    good = len(data) >= 32 and hmac.compare_digest(
        mac, hmac.new(key, body, hashlib.sha256).digest()
    )
    return body if good else None


def decode_sealed(key: bytes, frame: bytes) -> tuple[list[Record], int, int] | None:
    """A cluster batch (``_FileSink.write``) as ``decode`` gives it, or None without the seal."""
    body = unseal(key, frame)
    if body is None:
        return None
    _, rank, dropped, batch = json.loads(body)
    return [Record(rank, *row) for row in batch], rank, dropped


MAX_FRAME = 1 << 20  # bytes: a batch holds at most _PER_DATAGRAM records, far below this


def read_frames(data: bytes) -> tuple[list[bytes], int, str | None]:
    """The whole batches at the start of ``data`` (what ``_FileSink`` appended), how many bytes
    they took, and what was wrong if the stream broke: a length prefix over ``MAX_FRAME`` was
    not written by a rank, and the stream cannot be resynced after it (rather than waiting
    forever for bytes no rank will write, the reader is told). A batch still being written
    waits for the next read."""
    frames, at = [], 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        if size > MAX_FRAME:
            return frames, at, f"a batch length of {size:,} bytes (at most {MAX_FRAME:,})"
        if at + 4 + size > len(data):
            break
        frames.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return frames, at, None


def decode(datagram: bytes) -> tuple[list[Record], int, int]:
    """A datagram from ``Channel.flush``: its records, the sender's rank and drop count."""
    _, rank, dropped, batch = pickle.loads(datagram)
    return [Record(rank, *row) for row in batch], rank, dropped


def drain(sock: socket.socket, run: Run) -> bool:
    """On the launching side: every datagram waiting on a rank's channel (its non-blocking end,
    ``sock``) decoded into ``run``, without waiting for more; whether any record came."""
    heard = False
    while True:
        try:
            datagram = sock.recv(1 << 16)
        except (BlockingIOError, OSError):
            return heard
        records, rank, dropped = decode(datagram)
        run.add(records)
        run.dropped[rank] = dropped
        heard = heard or bool(records)
