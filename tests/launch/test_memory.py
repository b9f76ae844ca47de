"""A rank killed by SIGKILL: was it memory? The cgroup files are written by the test in a
directory of its own and the machine's memory is the test's, so every verdict is the rule's."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from nbaccel.errors import RankFailure
from nbaccel.launch import memory
from nbaccel.launch.memory import Snapshot, killed_hint, snapshot
from nbaccel.observe.channel import RSS, SAMPLES, Record
from nbaccel.observe.records import Run

GIB = 1024.0  # MiB


def a_run(**rss: float) -> Run:
    """A run whose ranks (``r0=``, ``r1=``, ...) last recorded these CPU memories, in MiB."""
    run = Run(world_size=len(rss), started=0.0)
    for key, mib in rss.items():
        rank = int(key[1:])
        run.add([Record(rank, 0, 1.0, RSS, mib / 2), Record(rank, 1, 1.25, RSS, mib)])
    return run


def cgroup_v2(root: Path, oom_kills: int, limit: str = "max") -> Path:
    root.mkdir(exist_ok=True)
    (root / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {oom_kills}\n")
    (root / "memory.max").write_text(f"{limit}\n")
    return root


def machine(available: float = 12 * GIB, total: float = 16 * GIB):
    return lambda: (available, total)


def test_a_risen_oom_kill_count_is_likely_out_of_memory(tmp_path):
    cgroup = cgroup_v2(tmp_path / "cg", oom_kills=2)
    start = snapshot(cgroup=cgroup)
    assert start == Snapshot(oom_kills=2)
    cgroup_v2(cgroup, oom_kills=3)  # the kernel killed one process during the launch
    hint = killed_hint(1, a_run(r0=1000, r1=3210), start, cgroup=cgroup, machine=machine())
    assert hint.startswith("likely out of memory: the kernel's OOM killer ended 1 process ")
    assert "its last recorded CPU memory was 3,210 MiB (4,210 MiB for all 2 ranks)" in hint
    assert "the machine has 12,288 MiB available now of 16,384 MiB" in hint
    assert "dmesg | grep -i kill" in hint and "num_processes" in hint
    assert "memory limit" not in hint  # memory.max says "max": no limit
    assert 1 <= len(hint.splitlines()) <= 3


def test_ranks_that_held_most_of_the_limit_are_likely_out_of_memory(tmp_path):
    cgroup = cgroup_v2(tmp_path / "cg", oom_kills=0, limit=str(8 * 2**30))  # 8 GiB
    start = snapshot(cgroup=cgroup)
    full = a_run(r0=3.5 * GIB, r1=3.5 * GIB)  # 7 of 8 GiB: 88%
    hint = killed_hint(0, full, start, cgroup=cgroup, machine=machine())
    assert hint.startswith("likely out of memory: the ranks last held 88% of the cgroup's")
    assert "the cgroup's memory limit is 8,192 MiB" in hint
    light = a_run(r0=1 * GIB, r1=1 * GIB)  # 25%
    hint = killed_hint(0, light, start, cgroup=cgroup, machine=machine())
    assert hint.startswith("memory is not the evident cause; something else sent SIGKILL")


def test_without_a_limit_the_machine_total_is_the_ceiling(tmp_path):
    cgroup = cgroup_v2(tmp_path / "cg", oom_kills=0)
    start = snapshot(cgroup=cgroup)
    run = a_run(r0=7 * GIB, r1=7 * GIB)  # 14 of 16 GiB
    hint = killed_hint(1, run, start, cgroup=cgroup, machine=machine(available=10 * GIB))
    assert hint.startswith("likely out of memory: the ranks last held 88% of the machine's")


def test_cgroup_v1_files_are_read_too(tmp_path):
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    start = snapshot(cgroup=tmp_path)
    assert start.oom_kills == 5
    hint = killed_hint(0, a_run(r0=100), start, cgroup=tmp_path, machine=machine())
    assert hint.startswith("memory is not the evident cause") and "limit" not in hint


def test_a_rank_that_recorded_nothing_and_nothing_readable_never_raise(tmp_path):
    missing = tmp_path / "no-cgroup-here"
    start = snapshot(cgroup=missing)
    assert start == Snapshot(oom_kills=None)

    def broken():
        raise PermissionError("no /proc/meminfo")

    hint = killed_hint(3, Run(world_size=4), start, cgroup=missing, machine=broken)
    assert hint.startswith("whether memory was the cause cannot be told from here.")
    assert "it recorded no CPU memory before it died" in hint
    assert "available" not in hint  # the machine's part dropped, the rest kept
    # other ranks' memory without this rank's still weighs in the verdict
    hint = killed_hint(3, a_run(r0=15 * GIB), start, cgroup=missing, machine=machine())
    assert hint.startswith("likely out of memory") and "it recorded no CPU memory" in hint


def test_a_run_or_a_reader_that_breaks_still_gives_a_hint(tmp_path, monkeypatch):
    class Broken(Run):
        def latest(self, name):
            raise RuntimeError("records unreadable")

    hint = killed_hint(0, Broken(), Snapshot(None), cgroup=tmp_path, machine=machine())
    assert "it recorded no CPU memory" in hint

    def unreadable(cgroup):
        raise RuntimeError("a bug in a reader")

    monkeypatch.setattr(memory, "_limit_mib", unreadable)
    assert killed_hint(0, a_run(r0=1.0), Snapshot(0), cgroup=tmp_path) == f"{memory.CHECK}."


def test_the_real_machine_is_read(monkeypatch):
    """On this machine, with its own files: a snapshot and a hint, whatever they say."""
    start = snapshot()
    assert start.oom_kills is None or start.oom_kills >= 0
    run = a_run(r0=100)
    run.add([Record(0, 1, 1.3, SAMPLES, 8.0)])
    hint = killed_hint(0, run, start)
    assert "its last recorded CPU memory was 100 MiB" in hint
    assert "MiB available now of" in hint  # psutil reads it on every platform we run


@pytest.mark.parametrize("message", ["", "likely out of memory: ..."])
def test_a_killed_rank_describes_its_hint(message):
    failure = RankFailure(1, 42, -signal.SIGKILL, message=message)
    killed = "rank 1 (pid 42) was killed by SIGKILL"
    assert failure.describe() == (f"{killed}; {message}" if message else killed)
    assert RankFailure(1, 42, 3, message="").describe() == "rank 1 (pid 42) exited with code 3"
