"""One request of a ranks session, from the kernel's side: wait for the ranks and say what they did.

``Waiter.wait`` watches every rank's output pipes, message socket and channel (its metrics
socket), and the fork server's reports, until each rank the request went to has answered
(``Done``). It relays output with rank labels (``relay.py``), shows rich output, feeds the
live panel, and decides: the stop button, the cell's timeout, a hang (a rank in a collective
that an idle rank cannot join) and a death, as ``session.py`` describes. Every press of the
stop button while it waits is counted, never raised mid-read, so no message is ever cut in
half. A failed cell raises ``CellError`` (``errors.py``), a ``LaunchError``.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .. import errors
from ..errors import RankFailure, by_priority, root_cause_report
from ..observe.channel import drain
from ..observe.hang import ask, where
from ..observe.records import Run
from . import memory
from .protocol import Cell, Display, Done, Exited, Signal, Signalled, decode, encode, recv, send

INTERRUPT_S = 5.0  # after the stop button's SIGINT: ranks still in the cell then are stuck
LEAVE_S = 2.0  # for idle ranks to leave by themselves when the session stops


@dataclass
class SessionRank:
    """One rank of a ranks session, as the kernel holds it across cells: its pipes' and
    sockets' ends, and the request it has not answered yet."""

    rank: int
    out: int  # read ends of its stdout and stderr pipes
    err: int
    messages: Connection  # its message socket: Cell requests in, Display and Done out
    metrics: socket.socket  # its channel: the records it logs
    pid: int | None = None
    exit_code: int | None = None
    busy: int | None = None  # the request it has not answered yet
    last: int | None = None  # the last cell it finished

    def __post_init__(self) -> None:
        os.set_blocking(self.out, False)
        os.set_blocking(self.err, False)

    def send(self, message) -> None:
        self.messages.send_bytes(encode(message))
        self.busy = message.number

    def close(self) -> None:
        for fd in (self.out, self.err):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.messages.close()
        self.metrics.close()


class Waiter:
    def __init__(
        self, session, number: int, targets: list[int], limit: float | None, what: str
    ) -> None:
        self.s, self.number, self.limit, self.what = session, number, limit, what
        self.cell = session.labels.get(number, number)  # as the notebook numbers it
        self.pending, self.done = set(targets), {}
        self.run, self.view = Run(), None
        self.run.world_size, self.run.device = len(session.ranks), session.device
        self.presses, self.interrupted, self.timed_out = 0, None, False
        self.dead: list[SessionRank] = []
        self.started = time.monotonic()
        idle = [r for r in session.ranks if r.rank not in targets and r.busy is None]
        self.idle_since = self.started if idle else None
        self.next_look, self.report = 0.0, None  # when to ask where ranks are; the last answer

    # -- the loop -------------------------------------------------------------------------------
    def wait(self, message: Cell | None = None) -> dict[int, Done]:
        """Send ``message`` to the ranks (the stop button counted already: never half sent),
        then wait for their answers and judge them."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._press) if main else None
        selector = selectors.DefaultSelector()
        try:
            for rank in sorted(self.pending) if message is not None else ():
                with contextlib.suppress(OSError):  # it died: the server's report says how
                    self.s.ranks[rank].send(message)
            hung = self._loop(self._watch(selector))
        finally:
            selector.close()
            if main:
                signal.signal(signal.SIGINT, previous)
            self._end_output()
        return self._verdict(hung)

    def drain(self) -> None:
        """Between cells: what the ranks sent meanwhile (a stuck rank's late report, output
        from their threads) read and said now, without waiting for anything."""
        with selectors.DefaultSelector() as selector:
            self._loop(self._watch(selector), once=True)
        self._end_output()

    def _watch(self, selector):
        for r in self.s.ranks:
            for fd in (r.out, r.err):
                selector.register(fd, selectors.EVENT_READ, (r, fd))
            if not r.messages.closed:
                selector.register(r.messages, selectors.EVENT_READ, (r, "messages"))
            selector.register(r.metrics, selectors.EVENT_READ, (r, "metrics"))
        selector.register(self.s.server.sock, selectors.EVENT_READ, (None, "server"))
        return selector

    def _loop(self, selector, once: bool = False) -> str | None:
        while (self.pending or once) and not self.dead:
            now = time.monotonic()
            if self.what == "start" and (self.presses or self._late(now)):
                return "interrupt"  # nothing of the user's runs yet: the start is abandoned
            if (self.presses or self._late(now)) and self.interrupted is None:
                self._interrupt(now)
            if self.interrupted is not None and (
                self.presses > 1 or now - self.interrupted > INTERRUPT_S
            ):
                return "interrupt"
            if self._stalled(now):
                return "stall"
            while self.s.server.pending:
                self._on_server(self.s.server.pending.pop(0))
            for key, _ in selector.select(timeout=0 if once else 0.1):
                r, what = key.data
                if what == "server":
                    try:
                        self._on_server(recv(self.s.server.sock)[0])
                    except (EOFError, OSError):  # the server died, and its workers with it
                        self._lost_server(selector)
                elif what == "messages":
                    self._on_message(r, selector)
                elif what == "metrics":
                    self._on_metrics(r)
                else:
                    self._read(r, what)
            if once:
                return None
        return None

    def _press(self, *_) -> None:  # the stop button, counted: never raised mid-read
        self.presses += 1

    def _late(self, now: float) -> bool:
        self.timed_out = self.limit is not None and now - self.started > self.limit
        return self.timed_out

    def _interrupt(self, now: float) -> None:
        """SIGINT to the session's ranks (those between cells ignore it), then wait for the
        server's word that it is sent: no late signal can reach the next cell."""
        self.interrupted = now
        server = self.s.server
        try:
            send(server.sock, Signal(self.s.id, signal.SIGINT, group=False))
            while not isinstance(message := recv(server.sock)[0], Signalled):
                server.pending.append(message)
        except (EOFError, OSError):
            self._lost_server()

    def _stalled(self, now: float) -> bool:
        """A rank waits in a collective while another is idle: for a peer that cannot come."""
        timeout = self.s.stall_timeout
        if timeout is None or self.idle_since is None or self.interrupted is not None:
            return False
        if now - self.idle_since < timeout or now < self.next_look:
            return False
        self.next_look = now + timeout
        report = self._ask()
        self.report = report
        return any(where(s).collective for s in report.stacks.values() if s is not None)

    # -- events ---------------------------------------------------------------------------------
    def _on_message(self, r: SessionRank, selector) -> None:
        try:
            message = decode(r.messages.recv_bytes())
        except (EOFError, OSError):
            selector.unregister(r.messages)  # it died: the server's report says how
            return
        if isinstance(message, Display):
            self._read(r, r.out)  # what it printed before comes first
            self._show(r, message.data)
        elif isinstance(message, Done):
            r.busy = None
            if message.number == self.number and r.rank in self.pending:
                self.pending.discard(r.rank)
                self.done[r.rank] = message
                r.last = self.cell if self.number in self.s.labels else r.last
                self.idle_since = self.idle_since or time.monotonic()
                self._read(r, r.out)
                self._read(r, r.err)
            else:
                self._said_late(r, message)

    def _said_late(self, r: SessionRank, done: Done) -> None:
        r.last = self.s.labels.get(done.number, done.number)
        how = "without an error"
        if done.failure is not None:
            how = f"with {done.failure.exception.type}: {done.failure.exception.message}"
        self._say(
            f"rank {r.rank} finished cell {r.last} late, {how} (the cell had already ended "
            "without it)."
        )

    def _on_server(self, message) -> None:
        if not isinstance(message, Exited):
            return
        for r in self.s.ranks:
            if r.pid == message.pid and r.exit_code is None:
                r.exit_code = message.code
                self.dead.append(r)

    def _lost_server(self, selector=None) -> None:
        if selector is not None:
            selector.unregister(self.s.server.sock)
        for r in self.s.ranks:
            if r.exit_code is None:
                r.exit_code = -signal.SIGKILL
                self.dead.append(r)
        when = " between cells" if self.what == "late" else ""
        pid = self.s.server.process.pid
        self.s.broken = f"nbaccel's fork server (pid {pid}) stopped{when}, and the ranks with it."

    def _on_metrics(self, r: SessionRank) -> None:
        drain(r.metrics, self.run)
        if self.run.records and self.s.live:
            if self.view is None:
                from ..observe.live.view import LiveView

                self.view = LiveView()
            self.view.update(self.run)

    def _read(self, r: SessionRank, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                return
            self.s.relay.feed(fd, data)
            if not data:
                return

    def _show(self, r: SessionRank, data: dict[str, str]) -> None:
        if self.s.relay.output == "main" and r.rank != 0:
            return
        self.s.relay.end_line()
        shell = _shell()
        if shell is None or set(data) == {"text/plain"}:
            print(f"[rank {r.rank}] {data.get('text/plain', '')}", flush=True)
            return
        if r.rank != 0:
            print(f"[rank {r.rank}]:", flush=True)
        from IPython.display import publish_display_data

        publish_display_data(data)

    def _end_output(self) -> None:
        relay = self.s.relay
        for r in self.s.ranks:
            for fd in (r.out, r.err):
                self._read(r, fd)
                if relay.partial.get(fd):
                    relay.feed(fd, b"")  # a last line without its newline: shown now
        relay.end_line()
        for r in self.s.ranks:  # the records sent before each Done
            self._on_metrics(r)
        self.run.finished = time.time()
        if self.view is not None:
            self.view.close(self.run)

    def _say(self, text: str) -> None:
        self.s.relay.end_line()
        print(f"nbaccel: {text}", file=sys.stderr, flush=True)

    def _ask(self):
        return ask(self.s.stacks_dir, sorted(self.pending), [], self.run)

    # -- the verdict ----------------------------------------------------------------------------
    def _verdict(self, hung: str | None) -> dict[int, Done]:
        if self.dead:
            raise self._death()
        if hung and self.what == "start" and self.timed_out:
            late = sorted(self.pending)
            raise errors.CellError(
                f"ranks {late} did not join their process group within {self.limit:g} s. "
                f"{self._ask()}"
            )
        if hung and self.what == "start":
            raise KeyboardInterrupt
        if hung:
            raise self._hang(hung)
        failures = [self._failure(r, d) for r, d in sorted(self.done.items()) if d.failure]
        if not failures:
            if self.presses:  # pressed as the ranks finished: the cell still stops here
                raise KeyboardInterrupt
            return self.done
        stopped = all(d.interrupted for d in self.done.values() if d.failure)
        if stopped and (self.presses or self.timed_out):
            places = "; ".join(_at(r, d) for r, d in sorted(self.done.items()) if d.failure)
            if self.timed_out:
                raise errors.CellError(
                    f"cell {self.cell} ran past its timeout ({self.limit:g} s) and was "
                    f"interrupted: {places}. The ranks keep their state.",
                    failures,
                )
            self._say(f"cell {self.cell} interrupted: {places}. The ranks keep their state.")
            raise KeyboardInterrupt
        finished = [r for r, d in self.done.items() if not d.failure]
        failures = by_priority(failures, [f.rank for f in failures])
        report = root_cause_report(failures, set(), finished)
        if self.what == "start":
            raise errors.CellError(f"the ranks could not start: {report}", failures)
        keep = "The ranks keep their state: the next cell runs on them."
        raise errors.CellError(f"{report}\n\n{keep}", failures)

    def _failure(self, rank: int, done: Done) -> RankFailure:
        r, exc = self.s.ranks[rank], done.failure.exception
        secondary = done.failure.collective
        return RankFailure(rank, r.pid, None, exc.type, exc.message, exc.format(), secondary)

    def _death(self) -> errors.CellError:
        deaths = [RankFailure(r.rank, r.pid, r.exit_code) for r in self.dead]
        others = [self._failure(r, d) for r, d in sorted(self.done.items()) if d.failure]
        failures = deaths + [f for f in others if f.rank not in {d.rank for d in deaths}]
        during = f"during cell {self.cell}" if self.what == "cell" else "as the ranks started"
        self.s.broken = self.s.broken or (
            f"{deaths[0].describe()} {during}; the other ranks were stopped."
        )
        hint = ""
        if deaths[0].exit_code == -signal.SIGKILL:  # nbaccel sends none here: memory, most often
            hint = "\n" + memory.killed_hint(deaths[0].rank, self.run, self.s.memory_start)
        return errors.CellError(
            f"{self.s.broken} A process group that lost a rank cannot be trusted: %ranks "
            f"restart (Ranks.restart()) starts fresh ranks; their state is lost.{hint}",
            failures,
        )

    def _hang(self, how: str) -> errors.CellError:
        report = self._ask() if how == "interrupt" else self.report
        stuck = sorted(self.pending)
        idle = [r.rank for r in self.s.ranks if r.busy is None]
        if how == "interrupt":
            cause = "timeout" if self.timed_out else "stop button"
            why = f"did not end the cell within {INTERRUPT_S:g} s of the {cause}"
        else:
            why = f"waited {self.s.stall_timeout:g} s in a collective while other ranks were idle"
        ranks = f"rank {stuck[0]}" if len(stuck) == 1 else f"ranks {', '.join(map(str, stuck))}"
        keep = f"{ranks} {'stays' if len(stuck) == 1 else 'stay'} in cell {self.cell}"
        if idle:
            keep += (
                f": the collective they wait in ends when the idle ranks {idle} call it too "
                f"(%%ranks {','.join(map(str, idle))}); or"
            )
        keep += " %ranks restart for fresh ranks."
        return errors.CellError(
            f"cell {self.cell}: {ranks} {why}. {report}\n\n{keep}", hung=True, stacks=report.stacks
        )


def _at(rank: int, done: Done) -> str:
    frames = done.failure.exception.frames
    if not frames:
        return f"rank {rank}"
    _, line, function, _ = frames[-1]
    return f"rank {rank} at line {line} of {'the cell' if function == '<module>' else function}"


def _shell():  # a Jupyter kernel's, which can show rich output
    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    return shell if hasattr(shell, "kernel") else None
