"""How much CPU other programs took while the lessons ran: the machine's busy time (``/proc/stat``)
less this process tree's (psutil, sampled), over the wall time, in cores.

``make lessons`` writes its outputs only when that share stayed small: a lesson's measurements
are the machine's, and another program on one of 2 cores would halve them.

The tree's CPU is read from every process in it, every ``interval`` seconds, and each process's
largest reading kept (by pid and start time), so a worker that came and went between two
readings is missed by at most one interval of its CPU. The kernel's own accounting of this
process and its waited-for descendants (``getrusage``) misses instead what is still running or
was never waited for; each errs low, so the larger of the two is the tree's: an error that
makes others' share look larger, never smaller.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass

import psutil

#: Above this many cores taken by other programs, on average, the run's outputs are not written.
LIMIT_CORES = 0.10


@dataclass(frozen=True)
class Load:
    wall: float  # seconds
    busy: float  # CPU seconds the whole machine was busy
    own: float  # CPU seconds this process tree used

    @property
    def others(self) -> float:
        """Cores other programs kept busy on average (0 when none; never below 0)."""
        return max(0.0, self.busy - self.own) / self.wall if self.wall > 0 else 0.0

    def verdict(self, limit: float = LIMIT_CORES) -> str:
        word = "within" if self.others <= limit else "ABOVE"
        return (
            f"other programs kept {self.others:.2f} cores busy on average over {self.wall:.0f} s "
            f"({word} the {limit:.2f} this run allows); this run used {self.own:.0f} CPU s"
        )


def _rusage() -> float:
    """CPU seconds of this process and of every descendant it (or they) waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def busy_seconds() -> float:
    """CPU seconds the machine has been busy since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class LoadMeter:
    """``with LoadMeter() as meter: ...`` then ``meter.load``."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._seen: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)
        self.load: Load | None = None

    def _sample(self) -> None:
        root = psutil.Process()
        for process in [root, *root.children(recursive=True)]:
            try:
                with process.oneshot():
                    key = (process.pid, process.create_time())
                    times = process.cpu_times()
            except psutil.Error:
                continue
            used = times.user + times.system
            self._seen[key] = max(self._seen.get(key, 0.0), used)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> LoadMeter:
        self._sample()
        self._before = dict(self._seen)
        self._busy, self._rusage, self._started = busy_seconds(), _rusage(), time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        sampled = sum(used - self._before.get(key, 0.0) for key, used in self._seen.items())
        own = max(sampled, _rusage() - self._rusage)
        wall = time.monotonic() - self._started
        self.load = Load(wall=wall, busy=busy_seconds() - self._busy, own=own)
