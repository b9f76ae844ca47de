"""A launch's file descriptors: many workers, a kernel whose open-file limit is too low for a
launch, a fork server whose limit is, and nothing leaked when a launch is refused."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap

import psutil
import pytest

from nbaccel import LaunchError, notebook_launcher
from nbaccel.launch import descriptors
from nbaccel.launch.client import shared_server

HANG = 120  # seconds: a launch that takes this long is hung, not slow


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.multiprocess
def test_forty_workers_each_get_their_own_descriptors():
    # 16 was the most: the fork server read at most 64 descriptors, 4 per worker (2 core CI: 2 s).
    def rank():
        return int(os.environ["RANK"])

    values = notebook_launcher(rank, num_processes=40, return_all=True, timeout=HANG)
    assert values == list(range(40))


# The kernel's side, in a process of its own whose soft limit is 256 (the test's stays as it was).
LOW_LIMIT = textwrap.dedent("""
    import os, resource, sys
    import psutil
    from nbaccel import LaunchError, notebook_launcher
    from nbaccel.launch import descriptors
    from nbaccel.launch.client import shared_server

    def parent():
        return os.getppid()

    def limit():
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)

    if sys.argv[1] == "unchecked":  # as if descriptors were opened after the check
        descriptors.check_room = lambda workers: descriptors.open_count()
    server = notebook_launcher(parent, num_processes=2, timeout=120)  # a launch that fits
    before = len(os.listdir("/proc/self/fd"))
    try:
        notebook_launcher(parent, num_processes=64, timeout=120)
    except LaunchError as err:
        print(err)
    print("open before and after:", before, len(os.listdir("/proc/self/fd")))
    print("workers left:", len(psutil.Process(server).children()))
    print("same server:", notebook_launcher(parent, num_processes=2, timeout=120) == server)
    print("workers' limit is ours:", notebook_launcher(limit, num_processes=2) == limit())
    soft, hard = resource.prlimit(server, resource.RLIMIT_NOFILE)
    print("server's soft limit is the hard one:", soft == hard)
""")


def run_with_soft_limit(soft: int, mode: str) -> str:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"this machine's hard limit on open files ({hard}) leaves no room for the test")
    done = subprocess.run(
        [sys.executable, "-c", LOW_LIMIT, mode],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.multiprocess
def test_a_launch_over_the_kernels_limit_names_it_and_the_fix_and_starts_nothing():
    out = run_with_soft_limit(256, "checked")
    assert "not enough file descriptors for the launch's 64 workers: each needs 8" in out
    assert "open-file limit is 256 (the soft limit; the hard limit is" in out
    assert "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, " in out
    assert "`ulimit -n 1024`" in out and "launch fewer processes (num_processes=" in out
    assert "fork server" not in out  # it did not stop; the same one serves the next launch
    before, after = out.split("open before and after:")[1].split()[:2]
    assert before == after
    assert "workers left: 0" in out and "same server: True" in out
    assert "server's soft limit is the hard one: True" in out
    assert "workers' limit is ours: True" in out  # not the server's, raised to the hard limit


@pytest.mark.multiprocess
def test_running_out_of_descriptors_while_making_them_says_the_same_and_leaks_none():
    out = run_with_soft_limit(256, "unchecked")
    assert (
        "[Errno 24] Too many open files while making the descriptors for the launch's 64 workers"
        in out
    )
    assert "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, " in out
    assert "stopped while starting" not in out
    before, after = out.split("open before and after:")[1].split()[:2]
    assert before == after
    assert "workers left: 0" in out and "same server: True" in out


@pytest.mark.multiprocess
def test_a_server_that_cannot_take_the_descriptors_refuses_and_serves_the_next_launch():
    def parent():
        return os.getppid()

    server = notebook_launcher(parent, num_processes=2, timeout=HANG)
    assert server == shared_server().process.pid
    limits = resource.prlimit(server, resource.RLIMIT_NOFILE)
    assert limits[0] == limits[1]  # it raised its soft limit to the hard one
    before = open_fds()
    # Room for one more descriptor, not for a worker's four: the server's own limit cuts the set
    room = psutil.Process(server).num_fds() + 1
    resource.prlimit(server, resource.RLIMIT_NOFILE, (room, limits[1]))
    try:
        with pytest.raises(
            LaunchError,
            match=rf"fork server \(pid {server}\) refused the launch: it received \d of the 8 "
            r"file descriptors for 2 workers and started nothing: it may open \d+ \(its soft "
            r"limit; the hard limit is \d+\).*Launch fewer processes",
        ):
            notebook_launcher(parent, num_processes=2, timeout=HANG)
    finally:
        resource.prlimit(server, resource.RLIMIT_NOFILE, limits)
    assert open_fds() == before
    assert psutil.Process(server).children() == []
    assert notebook_launcher(parent, num_processes=2, timeout=HANG) == server


def test_a_hard_limit_too_low_says_the_hard_limit_is_the_fix(monkeypatch):
    monkeypatch.setattr(descriptors, "limits", lambda: (256, 512))
    monkeypatch.setattr(descriptors, "open_count", lambda: 10)
    with pytest.raises(
        LaunchError,
        match=r"limit is 256 \(the soft limit; the hard limit is 512\)\. Nothing was started\. "
        r"The hard limit is too low for that many: launch fewer processes \(num_processes=26 "
        r"fits now; 58 after raising the soft limit to the hard one in the kernel: `import "
        r"resource; resource.setrlimit\(resource.RLIMIT_NOFILE, \(512, 512\)\)`\), or start "
        r"Jupyter with a higher hard limit \(`ulimit -Hn 1024` as root",
    ):
        descriptors.check_room(64)
