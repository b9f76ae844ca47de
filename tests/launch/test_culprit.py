"""The root cause, whatever order the reports arrive in.

A rank that leaves (``sys.exit(3)``, an exception, a hard death) while a peer waits in a
collective makes that peer fail with "connection closed by peer". The two reports race to the
supervisor; here their order is the test's input, not luck: the supervisor is fed the messages
one by one, in every order they can come, and must name the rank that left each time.
"""

from __future__ import annotations

import selectors
import signal
import socket
from dataclasses import replace
from multiprocessing.connection import Connection

import pytest

from nbaccel import LaunchError
from nbaccel.launch import verdict
from nbaccel.launch.protocol import ExceptionData, Exited, Failure, encode
from nbaccel.launch.supervisor import PEER_REPORT_SECONDS, Attempt, LaunchSpec, _Worker

CLOSED = "Connection closed by peer [127.0.0.1]:4242"
LOST = Failure(ExceptionData("DistBackendError", "torch.distributed", CLOSED), collective=True)
EXIT_3 = Failure(ExceptionData("SystemExit", "builtins", "config file missing"), exit_code=3)
RAISED = Failure(ExceptionData("ValueError", "builtins", "bad batch"))


class Server:
    """The fork server as the supervisor sees it: it records the signals sent to the launch."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.pending: list = []

    def signal(self, launch: int, sig: int) -> None:
        self.signals.append(sig)


class Harness:
    """A launch of ``n`` ranks whose messages the test sends and delivers one at a time."""

    def __init__(self, n: int = 2) -> None:
        self.attempt = Attempt(
            LaunchSpec(envs=tuple({"RANK": str(i)} for i in range(n)), payload=b"")
        )
        self.server, self.selector, self.workers = Server(), selectors.DefaultSelector(), []
        for rank in range(n):
            ours, theirs = socket.socketpair()
            r = _Worker(rank, -1, -1, Connection(ours.detach()), pid=1000 + rank)
            self.attempt.ranks.append(r)
            self.selector.register(r.messages, selectors.EVENT_READ, (r, "messages"))
            self.workers.append(Connection(theirs.detach()))

    def sent(self, rank: int, message) -> None:
        """The worker wrote its report; the supervisor has not read it yet."""
        self.workers[rank].send_bytes(encode(message))

    def read(self, rank: int) -> None:
        """The supervisor reads what ``rank`` sent (this is the order under test)."""
        self.attempt._on_message(self.attempt.ranks[rank], self.selector, self.server)

    def exited(self, rank: int, code: int) -> None:
        if code == -signal.SIGTERM:
            assert signal.SIGTERM in self.server.signals, "no SIGTERM was sent"
        self.attempt._on_server(Exited(1000 + rank, code), self.server, self.selector)

    def error(self) -> LaunchError:
        with pytest.raises(LaunchError) as caught:
            verdict.judge(self.attempt.facts())
        for w in self.workers:
            w.close()
        for r in self.attempt.ranks:
            r.messages.close()
        self.selector.close()
        return caught.value


def _exits_with_3_while_rank_0_waits(h: Harness, order: str) -> None:
    if order == "peer first":
        h.sent(1, EXIT_3)
        h.read(1)
        h.sent(0, LOST)
        h.read(0)
    elif order == "peer already sent":  # its report is in the socket when rank 0's is read
        h.sent(1, EXIT_3)
        h.sent(0, LOST)
        h.read(0)
    else:  # "peer still on its way": a finally ended its group before its report was sent
        h.sent(0, LOST)
        h.read(0)
        assert h.server.signals == [], "rank 1 was stopped before it could say why it left"
        h.sent(1, EXIT_3)
        h.read(1)
    assert h.server.signals == [signal.SIGTERM]


@pytest.mark.parametrize("order", ["peer first", "peer already sent", "peer still on its way"])
@pytest.mark.parametrize("rank_1_status", [3, -signal.SIGTERM])  # left, or stopped leaving
def test_a_rank_that_exits_during_a_collective_is_the_culprit_in_any_order(order, rank_1_status):
    h = Harness()
    _exits_with_3_while_rank_0_waits(h, order)
    h.exited(1, rank_1_status)
    h.exited(0, 1)
    err = h.error()
    assert err.rank == 1 and err.exc_type == "SystemExit"
    first = str(err).splitlines()[0]
    assert first == "rank 1 (pid 1001) exited with code 3: config file missing"
    assert "  rank 0 (pid 1000) raised DistBackendError: Connection closed by peer" in str(err)
    assert "stopped by nbaccel" not in str(err)
    assert [f.rank for f in err.failures] == [1, 0] and err.failures[0].exit_code == 3


@pytest.mark.parametrize("first", ["peer", "waiting rank"])
def test_a_rank_that_raises_is_the_culprit_in_either_order(first):
    h = Harness()
    for rank, message in [(1, RAISED), (0, LOST)] if first == "peer" else [(0, LOST), (1, RAISED)]:
        h.sent(rank, message)
        h.read(rank)
    h.exited(0, 1)
    h.exited(1, 1)
    err = h.error()
    assert err.rank == 1 and str(err).startswith("rank 1 (pid 1001) raised ValueError: bad batch")


@pytest.mark.parametrize("code", [3, -signal.SIGKILL, -signal.SIGSEGV])
@pytest.mark.parametrize("first", ["exit report", "lost connection"])
def test_a_rank_that_dies_without_a_word_is_the_culprit_in_either_order(code, first):
    h = Harness()
    if first == "exit report":
        h.exited(1, code)
        h.sent(0, LOST)
        h.read(0)
    else:
        h.sent(0, LOST)
        h.read(0)
        assert h.server.signals == []  # its exit report may yet come: it is not stopped
        h.exited(1, code)
    assert h.server.signals == [signal.SIGTERM]
    h.exited(0, 1)
    err = h.error()
    assert err.rank == 1 and err.exc_type is None
    assert str(err).splitlines()[0].startswith("rank 1 (pid 1001) ")
    assert "stopped by nbaccel" not in str(err)


def test_a_peer_that_never_reports_is_stopped_after_the_wait_and_said_so():
    h = Harness()
    h.sent(0, LOST)
    h.read(0)
    waited_from = h.attempt.waiting_since
    assert waited_from is not None and h.server.signals == []
    h.attempt._on_clock(waited_from + PEER_REPORT_SECONDS / 2, 0.0, h.server)
    assert h.server.signals == []  # still within the wait
    h.attempt._on_clock(waited_from + PEER_REPORT_SECONDS + 0.01, 0.0, h.server)
    assert h.server.signals == [signal.SIGTERM]
    h.exited(1, -signal.SIGTERM)
    h.exited(0, 1)
    err = h.error()
    assert err.rank == 0 and "rank 1 (pid 1001) was killed by SIGTERM (stopped by nbaccel)" in str(
        err
    )


def test_a_peer_that_returned_is_a_desync_and_nobody_waits():
    h = Harness()
    from nbaccel.launch.protocol import Result

    h.sent(1, Result(b"\x80\x04N.", "NoneType"))
    h.read(1)
    h.exited(1, 0)
    h.sent(0, LOST)
    h.read(0)
    assert h.server.signals == [signal.SIGTERM]  # everyone has spoken
    h.exited(0, 1)
    err = h.error()
    assert err.rank == 0 and "Ranks [1] had already returned" in str(err)


def test_three_ranks_two_lose_the_one_that_left():
    h = Harness(3)
    h.sent(0, LOST)
    h.read(0)
    h.sent(2, LOST)
    h.read(2)
    assert h.server.signals == []  # rank 1 has said nothing yet
    h.sent(1, EXIT_3)
    h.read(1)
    for rank, code in ((1, 3), (0, 1), (2, 1)):
        h.exited(rank, code)
    err = h.error()
    assert err.rank == 1 and err.failures[0].rank == 1


def test_a_sigkill_is_the_ranks_own_unless_nbaccel_sent_one():
    h = Harness()
    h.sent(0, RAISED)
    h.read(0)  # a real error: rank 1 is stopped
    h.exited(1, -signal.SIGKILL)
    h.exited(0, 1)
    facts = h.attempt.facts()
    assert not verdict._failures(facts)[1].secondary  # we sent no SIGKILL: e.g. out of memory
    ours = replace(facts, killed=True)  # had we sent SIGKILL ourselves, rank 1 is our doing
    assert verdict._failures(ours)[1].secondary
    h.attempt.killed = True
    assert "rank 1 (pid 1001) was killed by SIGKILL (stopped by nbaccel)" in str(h.error())


def test_the_error_is_also_torchs_child_failed_error_for_code_written_for_torchrun():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    h = Harness()
    h.sent(1, RAISED)
    h.read(1)
    h.exited(1, 1)
    h.exited(0, -signal.SIGTERM)
    err = h.error()
    assert isinstance(err, ChildFailedError) and type(err).__name__ == "LaunchError"
    rank, failure = err.get_first_failure()  # torch's own accessor
    assert rank == 1 and failure.message.startswith("rank 1 (pid 1001) raised ValueError")
    assert [f.rank for f in err.failures] == [1, 0]  # nbaccel's list, root cause first
