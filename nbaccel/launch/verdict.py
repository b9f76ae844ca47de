"""What a finished launch says: the values back, or one ``LaunchError`` with the root cause.

The supervisor (``supervisor.py``) gathers the facts: each rank's result or failure report,
its exit status, whether nbaccel signaled it, the order failures arrived in. Here they become
``RankFailure``s, ranked by ``errors.by_priority`` (a rank's own error before a peer's lost
connection, before a death nbaccel caused), and worded by ``errors.root_cause_report``.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import RankFailure, by_priority, root_cause_report
from . import leftovers, memory, results

if TYPE_CHECKING:
    from .supervisor import Launch


def outcome(launch: Launch) -> list[Any]:
    """The launch's values, or raise the ``LaunchError`` that says what went wrong (also
    torch's ``ChildFailedError``: ``child_failed.py``)."""
    if not launch.failed_order and not launch.timed_out and not launch.server_died:
        return results.collect(launch.ranks, launch.spec.return_all, launch.run)
    from .child_failed import LaunchError  # imports torch, loaded by now: not at import time

    failures = launch.run.failures = _failures(launch)
    real = any(f.exc_type for f in failures if not f.secondary)
    if launch.timed_out and not real:
        late = [r.rank for r in launch.ranks if r.signaled]
        found = launch.found or "A rank stuck in a collective usually means another skipped it."
        raise LaunchError(
            f"timeout: ranks {late} had not finished after {launch.spec.timeout:g} s and were "
            f"stopped. {found}",
            failures,
            launch.run,
            stacks=launch.found.stacks if launch.found else None,
        ) from None
    if launch.server_died and not real:
        raise LaunchError(leftovers.lost_server(launch), failures, launch.run)
    stopped = {f.rank for f in failures if _by_us(launch, f)}
    finished = [r.rank for r in launch.ranks if _returned(launch, r.rank)]
    report = root_cause_report(failures, stopped, finished)
    raise LaunchError(report, failures, launch.run) from None


def _returned(launch: Launch, rank: int) -> bool:
    return any(r.rank == rank and r.result is not None for r in launch.ranks)


def _by_us(launch: Launch, f: RankFailure) -> bool:
    """Died of our SIGTERM, or of our SIGKILL once we sent one (not of its own doing)."""
    r = next(r for r in launch.ranks if r.rank == f.rank)
    ours = {-signal.SIGTERM} | ({-signal.SIGKILL} if launch.killed else set())
    return r.signaled and r.exit_code in ours


def _failures(launch: Launch) -> list[RankFailure]:
    failures = []
    for r in launch.ranks:
        if r.error is not None:
            exc, secondary, code = r.error.exception, r.error.collective, r.error.exit_code
            failures.append(
                RankFailure(r.rank, r.pid, r.exit_code if code is None else code, exc.type,
                            exc.message, exc.format(), secondary=secondary)
            )  # fmt: skip
        elif r.unseen:  # reported as what was seen, not as a death nobody saw
            unseen = "was not seen to exit: its fork server died first (it dies with the server)"
            failures.append(RankFailure(r.rank, r.pid, None, message=unseen))
        elif r.exit_code not in (0, None) or (r.exit_code == 0 and r.result is None):
            note = "without returning a result" if r.exit_code == 0 else ""
            failures.append(RankFailure(r.rank, r.pid, r.exit_code, message=note))
    failures = [replace(f, secondary=f.secondary or _by_us(launch, f)) for f in failures]
    failures = [
        replace(f, message=memory.killed_hint(f.rank, launch.run, launch.memory_start))
        if f.exit_code == -signal.SIGKILL and f.exc_type is None and not f.secondary
        else f
        for f in failures
    ]  # a SIGKILL nbaccel did not send: out of memory, most often
    # A rank that returned its value and was stopped while leaving did nothing wrong.
    failures = [f for f in failures if not (_returned(launch, f.rank) and _by_us(launch, f))]
    return by_priority(failures, launch.failed_order)
