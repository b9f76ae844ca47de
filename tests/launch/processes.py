"""Find a launch's processes on the whole machine, by the marker each one carries.

Not by parentage: the processes this looks for are the ones whose parent is gone (orphans
adopted by PID 1) or that left their parent's session on purpose.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import psutil

MARKER = "NBACCEL_LAUNCH"  # spelled out, not imported: the tests check the library's promise


def launch_processes(marker: str, groups: Iterable[int] = ()) -> list[psutil.Process]:
    """Every live process whose environment carries ``NBACCEL_LAUNCH=marker``, or which is in
    one of the process ``groups`` (worker pids: a process forked without exec shows, in
    ``/proc/PID/environ``, the environment it was forked with, so a worker shows the fork
    server's). Zombies are not live; processes of other users are read where permitted."""
    groups, found = set(groups), []
    for process in psutil.process_iter():
        try:
            if process.pid == os.getpid() or process.status() == psutil.STATUS_ZOMBIE:
                continue
            try:
                marked = process.environ().get(MARKER) == marker
            except psutil.AccessDenied:
                marked = False
            if marked or os.getpgid(process.pid) in groups:
                found.append(process)
        except (psutil.Error, OSError):  # it ended while we looked
            continue
    return found


def gone(process: psutil.Process) -> bool:
    """It ended: ``is_running`` is false (also when its pid was reused) or it is a zombie."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(processes: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The ones still running after ``timeout`` seconds (a hang catcher, not a speed limit)."""
    processes = list(processes)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(p) for p in processes):
        time.sleep(0.05)
    return [p for p in processes if not gone(p)]
