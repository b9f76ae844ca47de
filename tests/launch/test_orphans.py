"""No worker, and nothing a worker started, outlives its launch (issue 31): not when the fork
server is killed mid-launch, not after a launch that succeeded. Verdicts come from the process
table (``processes.py`` scans the whole machine for a launch's marker), never from timing.
And a worker's ``sys.argv`` is its own, not the fork server's."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import psutil
import pytest

from nbaccel import LaunchError, notebook_launcher
from nbaccel.launch import leftovers

from .processes import launch_processes, wait_gone

pytestmark = pytest.mark.multiprocess
HANG = 120  # seconds: a launch or an exit that takes this long is hung, not slow


def sleeper(folder: str, start_child: bool = False):
    """Each rank writes who it is (and a subprocess it started), then sleeps past any test."""

    def work():
        import subprocess

        child = 0
        if start_child:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
        rank = os.environ["RANK"]
        facts = f"{os.getpid()} {os.getppid()} {os.environ['NBACCEL_LAUNCH']} {child}"
        with open(f"{folder}/{rank}.tmp", "w") as f:
            f.write(facts)
        os.rename(f"{folder}/{rank}.tmp", f"{folder}/{rank}")  # whole, or not there
        time.sleep(600)

    return work


def kill_the_server_once_ranks_report(folder, world_size: int, stop: threading.Event) -> None:
    """From a thread: wait for every rank's facts, then SIGKILL their parent, the fork server."""
    paths = [os.path.join(folder, str(rank)) for rank in range(world_size)]
    while not stop.is_set() and not all(os.path.exists(p) for p in paths):
        time.sleep(0.05)
    if not stop.is_set():
        with open(paths[0]) as f:
            server = int(f.read().split()[1])
        os.kill(server, signal.SIGKILL)


def launch_then_kill_the_server(work, folder) -> tuple[LaunchError, list[list[str]]]:
    stop = threading.Event()
    killer = threading.Thread(target=kill_the_server_once_ranks_report, args=(folder, 2, stop))
    killer.start()
    try:
        with pytest.raises(LaunchError) as raised:
            notebook_launcher(work, num_processes=2, timeout=HANG)
    finally:
        stop.set()
        killer.join()
    facts = []
    for rank in range(2):
        with open(os.path.join(folder, str(rank))) as f:
            facts.append(f.read().split())
    return raised.value, facts


def test_workers_die_with_their_fork_server(tmp_path, monkeypatch):
    # The launcher's own sweep is off: the workers must die of the server's death alone.
    monkeypatch.setattr(leftovers, "sweep", lambda *args, **kwargs: None)
    work = sleeper(str(tmp_path))
    error, facts = launch_then_kill_the_server(work, tmp_path)
    assert re.search(r"fork server \(pid \d+\) died while ranks \[0, 1\] ran", str(error))
    # what the launcher saw, not a death it did not see (it once said "killed by SIGKILL")
    assert [(f.rank, f.exit_code) for f in error.failures] == [(0, None), (1, None)]
    assert all("was not seen to exit" in f.describe() for f in error.failures)
    workers = [int(f[0]) for f in facts]
    assert len({f[1] for f in facts}) == 1  # one parent: the server that was killed
    processes = []
    for pid in workers:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass  # already gone
    assert wait_gone(processes, HANG) == [], "workers outlived their fork server"
    assert launch_processes(facts[0][2], groups=workers) == []
    monkeypatch.undo()

    def pid():
        return os.getpid()

    assert len(set(notebook_launcher(pid, num_processes=2, return_all=True))) == 2


def test_what_ranks_started_dies_with_a_lost_fork_server(tmp_path, capfd):
    work = sleeper(str(tmp_path), start_child=True)
    error, facts = launch_then_kill_the_server(work, tmp_path)
    assert re.search(r"fork server \(pid \d+\) died while ranks \[0, 1\] ran", str(error))
    marker, workers = facts[0][2], [int(f[0]) for f in facts]
    assert marker == facts[1][2]  # one marker per launch
    assert launch_processes(marker, groups=workers) == []
    err = capfd.readouterr().err
    for rank, f in enumerate(facts):
        assert f"(pid {f[3]}, started by rank {rank})" in err and "time.sleep(600)" in err


def test_a_successful_launch_ends_what_ranks_left_running_and_names_what_they_detached(capfd):
    def start_helpers():
        import subprocess

        forgotten = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(601)"])
        detached = None
        if os.environ["RANK"] == "0":  # a TensorBoard-like server, meant to outlive the launch
            command = [sys.executable, "-c", "import time; time.sleep(602)"]
            detached = subprocess.Popen(command, start_new_session=True).pid
        return os.environ["NBACCEL_LAUNCH"], forgotten.pid, detached, os.getpid()

    values = notebook_launcher(start_helpers, num_processes=2, return_all=True, timeout=HANG)
    marker, _, detached, _ = values[0]
    server = psutil.Process(detached)
    try:
        err = capfd.readouterr().err
        for rank, (_, forgotten, _, _) in enumerate(values):
            ended = (
                f"nbaccel: ended `{sys.executable} -c import time; time.sleep(601)` (pid "
                f"{forgotten}, started by rank {rank}), still running when the launch ended\n"
            )
            assert ended in err
        left = (
            f"nbaccel: left running `{sys.executable} -c import time; time.sleep(602)` (pid "
            f"{detached}, started by rank 0), which it started in a session of its own; end it "
            f"with os.kill({detached}, signal.SIGTERM)\n"
        )
        assert left in err
        said = ("nbaccel: ended", "nbaccel: left running")
        assert sum(line.startswith(said) for line in err.splitlines()) == 3
        workers = [v[3] for v in values]
        assert [p.pid for p in launch_processes(marker, groups=workers)] == [detached]
    finally:
        server.kill()  # ours: this test's launch started it
    assert wait_gone([server], HANG) == []


def test_workers_see_an_argv_of_their_own_not_the_fork_servers():
    def argv():
        return list(sys.argv)

    expected = [argv.__qualname__]
    assert notebook_launcher(argv, num_processes=2, return_all=True) == [expected, expected]
