"""Run torchrun as a child process: its output shows as usual, signals reach it, nothing is left.

torchrun's stderr (and so its workers', which inherit it) passes through a pipe that copies every
chunk to our stderr as it arrives, unchanged, and keeps the last part: when a worker fails,
torchrun ends with a "Root Cause (first observed failure)" block that names the rank and its
exit code, and ``RunOutcome.describe`` turns that block into one line.

A ``timeout`` ends torchrun as SIGTERM would; ``before_stop`` runs once before torchrun is told
to stop its workers (on the timeout, or on the first signal), while they are still where they
were: ``nbaccel launch`` asks them for their stacks there.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psutil

TAIL_BYTES = 256 * 1024  # the root cause block sits at the very end of torchrun's stderr
GRACE_SECONDS = 5  # for workers of an interrupted torchrun to exit, before they are killed
PIPE_SECONDS = 30  # for the last of its stderr once torchrun exited: a hang guard, not a pace


@dataclass(frozen=True)
class RunOutcome:
    returncode: int
    stderr_tail: str = ""
    signal: int | None = None  # the signal that stopped us, if one did
    timed_out: bool = False  # the timeout stopped it

    @property
    def exit_status(self) -> int:
        """What a shell would report: 128 + N for a process ended by signal N."""
        return self.returncode if self.returncode >= 0 else 128 - self.returncode

    def root_cause(self) -> dict[str, str]:
        """The fields of torchrun's last root cause block (``rank``, ``exitcode``, ``host``...)."""
        blocks = self.stderr_tail.split("Root Cause (first observed failure):")
        if len(blocks) < 2:
            return {}
        fields = re.findall(r"^\s*(\w+)\s*:\s*(.*?)\s*$", blocks[-1].split("=" * 20)[0], re.M)
        return dict(fields)

    def describe(self) -> str:
        cause = self.root_cause()
        rank, code = cause.get("rank", "").split(" ")[0], cause.get("exitcode", "").split(" ")[0]
        if not (rank.isdigit() and code.lstrip("-").isdigit()):
            return f"torchrun exited with code {self.returncode} (its output is above)."
        where = f" on {cause['host']}" if cause.get("host") else ""
        if int(code) < 0:
            try:
                what = f"was killed by {signal.Signals(-int(code)).name} (exit code {code})"
            except ValueError:
                what = f"was killed by signal {-int(code)}"
        else:
            what = f"failed with exit code {code}"
        return (
            f"rank {rank}{where} {what}; its error is above. torchrun stopped the other ranks "
            f"and exited with code {self.returncode}."
        )


def run_torchrun(
    command: list[str],
    env: dict[str, str],
    timeout: float | None = None,
    before_stop: Callable[[], None] | None = None,
) -> RunOutcome:
    """Run ``command`` to the end; SIGINT/SIGTERM are passed on to it, and we wait for it; past
    ``timeout`` seconds it is stopped as SIGTERM would stop it."""
    received: list[int] = []
    workers: set[psutil.Process] = set()
    child: subprocess.Popen | None = None
    asked: list[bool] = []

    def stopping() -> None:
        with contextlib.suppress(psutil.Error):
            workers.update(psutil.Process(child.pid).children(recursive=True))
        if before_stop is not None and not asked:
            asked.append(True)
            before_stop()

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        if child is None:
            return  # not started yet: it will not be
        if len(received) == 1:
            stopping()
        if len(received) > 1:  # a second signal means "now"
            for process in [*workers, child]:
                with contextlib.suppress(psutil.Error, OSError):
                    process.kill()
        elif not _terminal_sent_it_too(signum, child.pid):
            child.send_signal(signum)  # torchrun stops its workers, then exits

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    tail = bytearray()
    timed_out = False
    try:
        if received:
            return RunOutcome(128 + received[0], signal=received[0])
        child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        pump = threading.Thread(target=_pump, args=(child.stderr, tail), daemon=True)
        pump.start()
        try:
            returncode = child.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stopping()
            child.send_signal(signal.SIGTERM)  # torchrun stops its workers, then exits
            returncode = child.wait()
        # torchrun ends its workers before it exits; these are only ever stragglers of a
        # torchrun that was interrupted while doing so.
        _, alive = psutil.wait_procs(workers, timeout=GRACE_SECONDS)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        # At once, normally: every writer of the pipe is gone. A process that outlived torchrun
        # unseen (a worker's own child) may still hold it; do not wait for that one forever.
        pump.join(PIPE_SECONDS)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child is not None and child.poll() is None:  # an error in this function itself
            child.kill()
            child.wait()
    text = bytes(tail).decode(errors="replace")
    return RunOutcome(returncode, text, received[0] if received else None, timed_out)


def _pump(source, tail: bytearray) -> None:
    """Copy the child's stderr to ours as it comes (progress bars too), keeping the tail."""
    out = sys.stderr.buffer
    while chunk := os.read(source.fileno(), 65536):
        out.write(chunk)
        out.flush()
        tail += chunk
        del tail[:-TAIL_BYTES]
    source.close()


def _terminal_sent_it_too(signum: int, pid: int) -> bool:
    """Ctrl-C in a terminal signals every process in the foreground group, torchrun included;
    sending SIGINT again would interrupt torchrun while it stops its workers."""
    try:
        foreground = os.tcgetpgrp(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):
        return False  # no terminal: the signal was meant for us alone
    return signum == signal.SIGINT and foreground == os.getpgrp() == os.getpgid(pid)
