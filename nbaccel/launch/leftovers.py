"""What a launch's workers left running, found and ended when the launch ends.

A rank may start processes of its own: a data server, a ``subprocess.Popen`` it forgot to wait
for, DataLoader workers of an unfinished iterator. When the rank exits they go on, reparented
to PID 1, unless someone ends them. Two facts find them, neither of which needs parentage:

* the launch's *marker*: each worker's environment holds ``NBACCEL_LAUNCH=<id>``, an id of its
  own per launch, and whatever a worker executes inherits it;
* the worker's *process group*: each worker leads one (``forkserver.py``), and what it forks
  without a new session stays in it, in the fork server's session.

Everything found in the fork server's session is ended (SIGTERM, then SIGKILL after a grace),
by pid, and named on stderr. A process the rank deliberately detached into a session of its own
(``subprocess.Popen(..., start_new_session=True)``, a TensorBoard server, say) is left running
and named, with how to end it.

The workers themselves die with the fork server, however it dies (``forkserver._die_with``):
then this sweep ends what they started, and ``lost_server`` words the cell's error.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from ..env import LAUNCH_VAR


@dataclass(frozen=True)
class Leftover:
    process: psutil.Process
    command: str
    rank: str  # who started it, as far as can be told ("?" when not)

    def __str__(self) -> str:
        return f"`{self.command}` (pid {self.process.pid}, started by rank {self.rank})"


def find(
    marker: str, groups: dict[int, int], session: int
) -> tuple[list[Leftover], list[Leftover]]:
    """Every live process of the launch: ``(to end, detached)``.

    ``groups``: each worker's pid (its process group) -> its rank; ``session``: the fork
    server's session, where workers and all they did not detach live.
    """
    ours, detached = [], []
    me = os.getpid()
    for process in psutil.process_iter():
        try:
            if process.pid == me or process.status() == psutil.STATUS_ZOMBIE:
                continue
            sid, pgid = os.getsid(process.pid), os.getpgid(process.pid)
            in_group = sid == session and pgid in groups
            try:
                environ = process.environ()
            except psutil.AccessDenied:  # another user's: not ours, unless in a worker's group
                environ = {}
            if not in_group and environ.get(LAUNCH_VAR) != marker:
                continue
            rank = environ.get("RANK") or str(groups.get(pgid, "?"))
            found = Leftover(process, _command(process), rank)
        except (psutil.Error, OSError):  # it ended while we looked
            continue
        if sid == session:
            ours.append(found)
        elif sid == process.pid:  # a session leader: the rank detached it on purpose
            detached.append(found)
    return ours, detached


def end(leftovers: Iterable[Leftover], grace: float) -> None:
    """SIGTERM each, SIGKILL what is still running after ``grace`` seconds. psutil's
    ``Process`` refuses to signal a pid that was reused since it was found."""
    processes = [leftover.process for leftover in leftovers]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + grace
        while not all(_ended(p) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.02)
        processes = [p for p in processes if not _ended(p)]
        if not processes:
            return


def _ended(process: psutil.Process) -> bool:
    """Gone, or a zombie: an orphan's is reaped by PID 1, whenever that gets to it."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def sweep(marker: str, workers: dict[int | None, int], session: int, grace: float) -> None:
    """End what the launch left running and say so, one line each, on stderr; name what was
    detached. ``workers``: each worker's pid -> its rank. The workers themselves (still dying
    when the fork server was lost) are ended without a word: the launch's error tells of them.
    ``grace``: seconds between SIGTERM and SIGKILL (``supervisor.GRACE_SECONDS``)."""
    groups = {pid: rank for pid, rank in workers.items() if pid is not None}
    if not groups:
        return
    ours, detached = find(marker, groups, session)
    end(ours, grace)
    for leftover in ours:
        if leftover.process.pid not in groups:
            print(
                f"nbaccel: ended {leftover}, still running when the launch ended", file=sys.stderr
            )
    for leftover in detached:
        pid = leftover.process.pid
        print(
            f"nbaccel: left running {leftover}, which it started in a session of its own; "
            f"end it with os.kill({pid}, signal.SIGTERM)",
            file=sys.stderr,
        )
    if ours or detached:
        sys.stderr.flush()


def lost_server(facts) -> str:
    """What the cell says when the fork server of an attempt (its ``verdict.Facts``) died."""
    running = [r.rank for r in facts.ranks if r.result is None]
    return (
        f"nbaccel's fork server (pid {facts.server_pid}) died while ranks {running} ran: "
        "something outside it ended it (the OOM killer, a process monitor?), and its workers "
        "died with it (anything they started was ended too). The next launch starts a new "
        "server."
    )


def _command(process: psutil.Process, width: int = 120) -> str:
    try:
        command = " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        command = "?"
    return command if len(command) <= width else command[: width - 3] + "..."
