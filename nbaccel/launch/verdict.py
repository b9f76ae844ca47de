"""What a finished attempt says: the values back, or one ``LaunchError`` with the root cause.

The attempt (``supervisor.py``) gathers the facts while it watches, and hands them over here
as ``Facts`` once its workers are gone: each rank's result or failure report, its exit status,
whether nbaccel signaled it, the order failures arrived in. Here they become ``RankFailure``s,
ranked by ``errors.by_priority`` (a rank's own error before a peer's lost connection, before a
death nbaccel caused), and worded by ``errors.root_cause_report``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import errors
from ..errors import RankFailure, by_priority, root_cause_report
from . import leftovers, memory, results

if TYPE_CHECKING:
    from ..observe.hang import Report
    from ..observe.records import Run
    from .protocol import Failure, Result


@dataclass(frozen=True)
class RankFacts:
    """How one worker of an attempt ended, as the attempt saw it."""

    rank: int
    pid: int | None
    exit_code: int | None  # None: its exit was never seen
    result: Result | None  # its value, still pickled (results.py unpickles it)
    error: Failure | None  # the failure it reported
    signaled: bool = False  # still running when the attempt began to stop the workers
    unseen: bool = False  # its exit was never reported: its fork server died first


@dataclass(frozen=True)
class Facts:
    """What one attempt saw, all that its verdict reads."""

    ranks: tuple[RankFacts, ...]
    failed_order: tuple[int, ...]  # the ranks that failed, in the order they were heard
    run: Run  # the attempt's records; the verdict adds the failures to it
    return_all: bool = False  # the call returns every local rank's value, not rank 0's alone
    timeout: float | None = None
    timed_out: bool = False
    found: Report | None = None  # where the ranks were when the timeout struck
    killed: bool = False  # nbaccel sent SIGKILL after the grace
    server_died: bool = False
    server_pid: int | None = None
    memory_start: memory.Snapshot | None = None  # as the attempt started


def judge(facts: Facts) -> list[Any]:
    """The attempt's values, or raise the ``LaunchError`` that says what went wrong."""
    if not facts.failed_order and not facts.timed_out and not facts.server_died:
        return results.collect(facts.ranks, facts.return_all, facts.run)
    failures = facts.run.failures = _failures(facts)
    real = any(f.exc_type for f in failures if not f.secondary)
    if facts.timed_out and not real:
        late = [r.rank for r in facts.ranks if r.signaled]
        found = facts.found or "A rank stuck in a collective usually means another skipped it."
        raise errors.LaunchError(
            f"timeout: ranks {late} had not finished after {facts.timeout:g} s and were "
            f"stopped. {found}",
            failures,
            facts.run,
            stacks=facts.found.stacks if facts.found else None,
        ) from None
    if facts.server_died and not real:
        raise errors.LaunchError(leftovers.lost_server(facts), failures, facts.run)
    stopped = {f.rank for f in failures if _by_us(facts, f)}
    finished = [r.rank for r in facts.ranks if _returned(facts, r.rank)]
    report = root_cause_report(failures, stopped, finished)
    raise errors.LaunchError(report, failures, facts.run) from None


def _returned(facts: Facts, rank: int) -> bool:
    return any(r.rank == rank and r.result is not None for r in facts.ranks)


def _by_us(facts: Facts, f: RankFailure) -> bool:
    """Died of our SIGTERM, or of our SIGKILL once we sent one (not of its own doing)."""
    r = next(r for r in facts.ranks if r.rank == f.rank)
    ours = {-signal.SIGTERM} | ({-signal.SIGKILL} if facts.killed else set())
    return r.signaled and r.exit_code in ours


def _failures(facts: Facts) -> list[RankFailure]:
    failures = []
    for r in facts.ranks:
        if r.error is not None:
            exc, secondary, code = r.error.exception, r.error.collective, r.error.exit_code
            exit_code = r.exit_code if code is None else code
            failures.append(
                RankFailure(
                    r.rank, r.pid, exit_code, exc.type, exc.message, exc.format(), secondary
                )
            )
        elif r.unseen:  # reported as what was seen, not as a death nobody saw
            unseen = "was not seen to exit: its fork server died first (it dies with the server)"
            failures.append(RankFailure(r.rank, r.pid, None, message=unseen))
        elif r.exit_code not in (0, None) or (r.exit_code == 0 and r.result is None):
            note = "without returning a result" if r.exit_code == 0 else ""
            failures.append(RankFailure(r.rank, r.pid, r.exit_code, message=note))
    failures = [replace(f, secondary=f.secondary or _by_us(facts, f)) for f in failures]
    failures = [
        replace(f, message=memory.killed_hint(f.rank, facts.run, facts.memory_start))
        if f.exit_code == -signal.SIGKILL and f.exc_type is None and not f.secondary
        else f
        for f in failures
    ]  # a SIGKILL nbaccel did not send: out of memory, most often
    # A rank that returned its value and was stopped while leaving did nothing wrong.
    failures = [f for f in failures if not (_returned(facts, f.rank) and _by_us(facts, f))]
    return by_priority(failures, list(facts.failed_order))
