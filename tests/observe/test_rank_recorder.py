"""The recorder's CPU memory: this process's resident set size, read at the counters' quarter-
second pace and never per step. The clock is the test's, so no verdict depends on speed."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from nbaccel import Recorder
from nbaccel.observe.channel import MEMORY, RSS, SAMPLES


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rss_is_read_at_the_counters_interval_not_per_step():
    clock, reads = Clock(), []

    def rss() -> float:
        reads.append(clock.now)
        return 100.0 + len(reads)

    recorder = Recorder(live=False, clock=clock, rss=rss)
    for second in range(4):  # four quarter-second intervals of 50 steps each
        clock.now = second * 0.25
        for _ in range(50):
            recorder.log({"loss": 1.0}, samples=8)
    assert reads == [0.0, 0.25, 0.5, 0.75]  # 200 steps, 4 reads
    values = recorder.run.series(RSS)[0][1]
    assert values == [101.0, 102.0, 103.0, 104.0]
    assert recorder.run.latest(SAMPLES) == {0: 8.0 * 151}  # the counters kept their pace too
    assert recorder.run.latest(MEMORY) == {}  # the GPU peak is another counter, CUDA only


def test_rss_is_a_gauge_recorded_even_when_nothing_new_was_counted():
    clock = Clock()
    recorder = Recorder(live=False, clock=clock, rss=lambda: 42.0)
    recorder.log({"loss": 1.0})  # counts no samples: no counter, but the memory
    clock.now = 0.25
    recorder.log({"loss": 1.0}, samples=8)
    clock.now = 0.5
    recorder.log({"loss": 1.0})  # nothing new counted: no repeat of the samples, the memory
    assert recorder.run.series(RSS)[0][1] == [42.0, 42.0, 42.0]
    assert recorder.run.series(SAMPLES)[0][1] == [8.0]


def test_rss_is_this_process_resident_set_size_in_mib():
    clock = Clock()
    recorder = Recorder(live=False, clock=clock)
    recorder.log({"loss": 1.0}, samples=1)
    before = recorder.run.latest(RSS)[0]
    assert abs(before - psutil.Process().memory_info().rss / 2**20) < 50
    block = torch.ones(50 * 2**20)  # 200 MiB, every page written, so resident
    clock.now = 0.25
    recorder.log({"loss": 1.0}, samples=1)
    after = recorder.run.latest(RSS)[0]
    del block
    assert after - before >= 150, (before, after)


@pytest.mark.process
def test_a_forked_child_reads_its_own_rss_not_its_parents():
    """The recorder keeps its process handle between readings: a child forked after a reading
    (a worker forked from a process that recorded) must read itself, not the PID it inherited.
    The child writes 300 MiB that its parent never holds."""
    from nbaccel.observe.rank_recorder import _rss_mib

    assert _rss_mib() is not None  # read once here: the handle is this process's
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no torch, no pytest, just the reading
        try:
            block = b"x" * (300 * 2**20)
            own = psutil.Process(os.getpid()).memory_info().rss / 2**20
            os.write(write, f"{_rss_mib()} {own} {len(block)}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        reported, own, _ = pipe.read().split()
    os.waitpid(pid, 0)
    assert abs(float(reported) - float(own)) < 50, (reported, own)


def test_without_procfs_rss_is_read_through_psutil(monkeypatch):
    from nbaccel.observe import rank_recorder

    def no_procfs(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(rank_recorder, "_statm", None)
    monkeypatch.setattr(rank_recorder.os, "open", no_procfs)
    rss = rank_recorder._rss_mib()
    assert rank_recorder._statm is False  # and no second try at every reading
    assert abs(rss - psutil.Process().memory_info().rss / 2**20) < 50


def test_a_platform_that_will_not_say_records_no_rss():
    recorder = Recorder(live=False, clock=Clock(), rss=lambda: None)
    recorder.log({"loss": 1.0}, samples=1)
    recorder.close()
    assert recorder.run.latest(RSS) == {} and recorder.run.latest(SAMPLES) == {0: 1.0}
