"""What else used the CPU while we measured: the cores other processes kept busy.

A throughput is only as good as the machine was quiet. ``Load`` reads two of the kernel's
counters when it starts, every ``interval`` seconds in a background thread, and when it stops:

* the busy seconds of the cores this process may run on (everything but idle and I/O wait;
  ``steal``, time the hypervisor gave to another machine, counts as busy: it was taken from us);
* the CPU seconds of this process and of all its descendants (the fork server, the workers),
  each counted with the seconds of the children it has reaped.

``other_cores`` is the difference over the seconds measured: the mean number of cores that
other processes kept busy. About 0 on an idle machine; 1.0 is a whole core taken away.

Why count the reaped children: when a worker exits, its parent reaps it, and the parent's
``children_user``/``children_system`` grow by the worker's whole total. So each of our processes
is counted from its first reading (from 0 if it was born since), and when it disappears the
parent's jump replaces it (``ours_used``). Nothing of ours is lost to "other" when workers
exit, not even a process that lived less than one interval. A process that leaves the tree
alive (orphaned, adopted by init) is followed by its pid until it ends; only its last interval
is missed, which errs towards flagging a measurement, never towards trusting it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reading:
    """The counters at one moment (seconds, on the machine's clocks)."""

    time: float  # time.monotonic()
    busy: float  # busy CPU seconds of the cores we may use, since boot
    # pid -> (parent pid, CPU seconds of the process and of the children it reaped)
    ours: dict[int, tuple[int, float]] = field(default_factory=dict)


def ours_used(before: Reading, after: Reading) -> float:
    """CPU seconds our processes used between two readings: each one's growth (a process born
    since counts from 0), less the last count of each that ended, reaped by a parent of ours
    whose children's seconds now hold its whole total."""
    used = sum(total - before.ours.get(pid, (0, 0.0))[1] for pid, (_, total) in after.ours.items())
    for pid, (parent, total) in before.ours.items():
        if pid not in after.ours and parent in before.ours:
            used -= total
    return used


def other_seconds(before: Reading, after: Reading) -> float:
    """CPU seconds that processes not ours used between two readings."""
    return (after.busy - before.busy) - ours_used(before, after)


def read(previous: Reading | None = None) -> Reading:
    """The counters now: this process, its descendants, and any process of ``previous`` that
    left the tree alive (an orphan is still ours)."""
    import psutil

    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    per_core = psutil.cpu_times(percpu=True)
    busy = sum(_busy(t) for i, t in enumerate(per_core) if cores is None or i in cores)
    me = psutil.Process()
    processes = [me, *me.children(recursive=True)]
    found = {p.pid for p in processes}
    orphans = [pid for pid in (previous.ours if previous else ()) if pid not in found]
    ours = {}
    for p in processes + orphans:
        try:
            p = p if isinstance(p, psutil.Process) else psutil.Process(p)
            with p.oneshot():
                t = p.cpu_times()
                ours[p.pid] = (p.ppid(), t.user + t.system + t.children_user + t.children_system)
        except psutil.Error:  # ended between the listing and the reading: its parent has it
            continue
    return Reading(time.monotonic(), busy, ours)


def _busy(t) -> float:
    """A core's busy seconds: all its time but idle and I/O wait (guest time is already in
    user time on Linux, so it is taken out once)."""
    idle = t.idle + getattr(t, "iowait", 0.0)
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return sum(t) - idle - guest


class Load:
    """Measures ``other_cores`` between ``start()`` and ``stop()``, or over a ``with`` block.

    >>> with Load() as load:  # doctest: +SKIP
    ...     notebook_launcher(train, num_processes=2)
    >>> load.other_cores  # doctest: +SKIP
    0.04

    ``read`` is injectable (a function of the previous ``Reading``), so the arithmetic can be
    tested with readings made up for the test.
    """

    def __init__(
        self, interval: float = 0.2, read: Callable[[Reading | None], Reading] = read
    ) -> None:
        self.interval = interval
        self._read = read
        self._first: Reading | None = None
        self._last: Reading | None = None
        self._other = 0.0  # CPU seconds of other processes so far
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Load:
        if self._thread is not None:
            raise RuntimeError("this Load is already measuring; stop() it first")
        self._first = self._last = self._read(None)
        self._other = 0.0
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="nbaccel-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stop the thread, take the last reading, and return ``other_cores``."""
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()
            self._thread = None
            self._step()
        return self.other_cores

    @property
    def other_cores(self) -> float:
        """Mean cores other processes kept busy, over the seconds measured (0.0 before)."""
        if self._first is None or self._last is None or self._last.time <= self._first.time:
            return 0.0
        return max(self._other / (self._last.time - self._first.time), 0.0)

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval):
            self._step()

    def _step(self) -> None:
        reading = self._read(self._last)
        self._other += other_seconds(self._last, reading)
        self._last = reading

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
