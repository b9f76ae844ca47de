"""File descriptors: what a launch's workers cost in open files, and the fix when they do not fit.

Each worker talks to the notebook through four descriptors (``protocol.FDS_PER_WORKER``): its stdout
and stderr pipes, its message socket and its metrics socket (its channel). The launching process
makes both ends of each, hands the worker's ends to the fork server and closes them once the server
has its copies: eight descriptors a worker while the launch starts, four after. A process may hold
no more than its soft ``RLIMIT_NOFILE`` (often 1024, or what ``ulimit -n`` set before Jupyter
started), so a launch checks that its workers fit before it makes any (``check_room``), and says the
limit and the fix when they do not (``no_room``).

The fork server raises its own soft limit to the hard one when it starts (``raise_limit``; its
loop is epoll, so high-numbered descriptors are fine) and gives each worker it forks the
original back, so the workers have the limit their launcher had.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from .. import errors
from .protocol import FDS_PER_WORKER, MissingDescriptors

if TYPE_CHECKING:
    from ..errors import LaunchError

WHILE_STARTING = 2 * FDS_PER_WORKER  # both ends of each, until the server has its own
HEADROOM = 32  # the launch's own beside the workers': the supervisor's selector, the store's
UNLIMITED = resource.RLIM_INFINITY


def open_count() -> int | None:
    """How many descriptors this process has open; None where neither /proc nor psutil tells."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # not the listing's own
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process().num_fds()
    except Exception:
        return None


def limits() -> tuple[int, int]:
    """This process's (soft, hard) limit on open descriptors."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def check_room(workers: int) -> int | None:
    """Raise the ``no_room`` error, before any descriptor is made, when ``workers`` workers do
    not fit under this process's soft limit; returns how many descriptors were open (None:
    unknown, and then nothing is checked)."""
    opened = open_count()
    soft, _ = limits()
    unlimited = opened is None or soft == UNLIMITED  # as far as this process can tell
    if not unlimited and _needed(workers, opened) > soft:
        raise no_room(workers, opened)
    return opened


def no_room(workers: int, opened: int | None, err: OSError | None = None) -> LaunchError:
    """What is wrong and the fix, when ``workers`` workers' descriptors do not fit: found by
    ``check_room``, or met as ``err`` (EMFILE, ENFILE) while making them."""
    soft, hard = limits()
    opened = opened or 0
    need = _needed(workers, opened)
    what = f"{err} while making the descriptors for" if err else "not enough file descriptors for"
    text = (
        f"{what} the launch's {workers} workers: each needs {WHILE_STARTING} descriptors in this "
        f"process while the launch starts ({FDS_PER_WORKER} after), about {need} in all with the "
        f"{opened} open already, but this process's open-file limit is {_shown(soft)} (the soft "
        f"limit; the hard limit is {_shown(hard)}). Nothing was started. "
    )
    n = -(-need // 1024) * 1024  # the next multiple of 1024
    if hard == UNLIMITED or need <= hard:
        n = n if hard == UNLIMITED else min(n, hard)
        fits = _fits(soft, opened)
        fewer = f", or launch fewer processes (num_processes={fits} fits now)" if fits else ""
        return errors.LaunchError(
            text + "Raise the soft limit in the kernel, then launch again:\n"
            f"    import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {_code(hard)}))"
            f"\nor start Jupyter after `ulimit -n {n}`{fewer}."
        )
    raised = (
        f"; {_fits(hard, opened)} after raising the soft limit to the hard one in the kernel: "
        f"`import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({hard}, {hard}))`"
        if soft < hard
        else ""
    )
    return errors.LaunchError(
        text + "The hard limit is too low for that many: launch fewer processes (num_processes="
        f"{_fits(soft, opened)} fits now{raised}), or start Jupyter with a higher hard limit "
        f"(`ulimit -Hn {n}` as root, or `nofile` in /etc/security/limits.conf)."
    )


def refusal(err: MissingDescriptors) -> str:
    """The fork server's answer (``protocol.Refused``) when a ``Start``'s descriptors did not
    all arrive: what it may hold, and the fix."""
    soft, hard = limits()
    opened = open_count() or 0
    fits = (soft - opened) // FDS_PER_WORKER if soft != UNLIMITED else 0
    fewer = f" (num_processes={fits} fits in the server now)" if fits >= 1 else ""
    return (
        f"it {err} and started nothing: it may open {_shown(soft)} (its soft limit; the hard "
        f"limit is {_shown(hard)}) and has {opened} open, or the system's file table is full. "
        f"Launch fewer processes{fewer}, or start Jupyter with a higher limit (`ulimit -n` "
        "before it; only root raises the hard limit, `ulimit -Hn`, or `nofile` in "
        "/etc/security/limits.conf) and restart the kernel: its next server has that limit."
    )


def raise_limit() -> tuple[int, int]:
    """Raise this process's soft limit to its hard one; returns the limits it had before."""
    before = limits()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (before[1], before[1]))
    except (ValueError, OSError):
        pass  # a hard limit the system caps lower (macOS: OPEN_MAX): keep the soft one
    return before


def worker_ends(workers: int, opened: int | None) -> tuple[tuple, list[int]]:
    """One worker's pipes and sockets as (the launcher's ends, the worker's descriptors): the
    stdout and stderr pipes (the launcher reads their descriptors), the message socket (a
    ``Connection``), the metrics socket (datagrams, read without blocking).
    All four or none: what was made before a failure is closed again, and running out of
    descriptors (``opened`` before the first of the launch's ``workers``) raises ``no_room``."""
    made: list[int] = []
    try:
        made += os.pipe()
        made += os.pipe()
        made += [s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)]
        made += [s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)]
    except BaseException as err:
        for fd in made:
            os.close(fd)
        if isinstance(err, OSError) and err.errno in (errno.EMFILE, errno.ENFILE):
            raise no_room(workers, opened, err) from err
        raise
    out_r, out_w, err_r, err_w, messages, their_messages, metrics, their_metrics = made
    datagrams = socket.socket(fileno=metrics)
    datagrams.setblocking(False)
    ours = (out_r, err_r, Connection(messages), datagrams)
    return ours, [out_w, err_w, their_messages, their_metrics]


def _needed(workers: int, opened: int) -> int:
    """Descriptors open at the peak of a launch's start: what was open, the workers', ours."""
    return opened + WHILE_STARTING * workers + HEADROOM


def _fits(limit: int, opened: int) -> int:
    """How many workers fit under ``limit``: ``_needed`` solved for ``workers``."""
    return max(0, (limit - opened - HEADROOM) // WHILE_STARTING)


def _shown(limit: int) -> str:
    return "unlimited" if limit == UNLIMITED else str(limit)


def _code(limit: int) -> str:
    return "resource.RLIM_INFINITY" if limit == UNLIMITED else str(limit)
