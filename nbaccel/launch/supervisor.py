"""The supervisor of one launch's attempt, on the launcher's side. Over 400 lines because an
attempt's event loop is one idea: its start, its select loop and what each event and the clock
decide all read and write the attempt's state, and split they would scatter it.

``Attempt`` starts the workers through the fork server (``ForkServer``, in ``client.py``),
relays their output line by line, receives their results, errors and metrics (typed messages
of ``protocol.py`` on each worker's message socket; records on its channel), stops everyone
when one fails, and hands what it saw (``verdict.Facts``) to ``verdict.py``, which decides
which failure was the root cause (``errors.py`` words it).

Before it stops ranks that had not finished (a timeout, the stop button), and when they stop
making progress, it asks each where it is (``stacks.py``) and says so (``hang.py``).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

from .. import errors
from ..env import LAUNCH_VAR, STACKS_VAR
from ..observe.channel import drain
from ..observe.hang import Report, Stall, ask
from ..observe.records import Run
from . import descriptors, leftovers, memory, verdict
from .client import ForkServer, shared_server
from .protocol import Exited, Failure, Message, Result, WorkerSpec, decode
from .relay import Relay

GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL when stopping workers (a session's too)
# How long a rank that lost a peer in a collective waits before the others are stopped: the
# peer that left may still be on its way to say why (a `finally` that ended its process group
# before its exception reached nbaccel). Only a hang lasts this long.
PEER_REPORT_SECONDS = 3.0
# The stop button's grace for a fork server that is starting: one that serves exits at once on
# its socket's end; one still importing torch would read it only seconds later, so it is killed.
STOP_GRACE_SECONDS = 0.5


# -- one attempt ---------------------------------------------------------------------------------
@dataclass
class _Worker:
    """One worker of an attempt, as the supervisor holds it: the launcher's ends of its pipes
    and sockets, and what it reported so far."""

    rank: int
    out: int  # read ends of the worker's stdout and stderr pipes
    err: int
    messages: Connection  # its message socket: the call in, Result or Failure out
    pid: int | None = None
    exit_code: int | None = None
    result: Result | None = None  # its value, still pickled (results.py unpickles it)
    error: Failure | None = None
    metrics: socket.socket | None = None  # datagrams from the worker's channel.Channel
    signaled: bool = False  # still running when the launch began to stop the workers
    unseen: bool = False  # its exit was never reported: its fork server died first


@dataclass(frozen=True)
class LaunchSpec:
    """What one attempt starts, and how it is watched.

    ``monitor_interval`` is the longest the supervisor sleeps between its own checks (the
    timeout, the grace before SIGKILL, a live view's redraw); exits, errors and output wake it
    at once.
    """

    envs: tuple[dict[str, str], ...]  # one whole environment per worker on this machine
    payload: bytes  # the call, packed by protocol.pack_call
    threads: int = 1  # torch threads per worker
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    timeout: float | None = None  # seconds, then every unfinished rank is stopped
    output: Literal["all", "main"] = "all"  # whose output to show
    monitor_interval: float = 0.1
    stall_warning: float | None = None  # seconds without a record, then say where ranks are
    return_all: bool = False  # the call returns every local rank's value, not rank 0's alone


class Attempt:
    """One attempt of a launch: start the workers, supervise them to the end, return or raise.

    The caller owns ``view`` (a live view to update while waiting) and closes it.
    """

    def __init__(self, spec: LaunchSpec, *, run: Run | None = None, view=None) -> None:
        self.spec = spec
        self.run, self.view = run if run is not None else Run(), view
        self.id: int | None = None  # the fork server's number for it, once started
        self.marker = os.urandom(8).hex()  # see leftovers.py
        self.ranks: list[_Worker] = []
        self.relay = Relay(spec.output)
        self.failed_order: list[int] = []
        self.stopping_since: float | None = None
        self.waiting_since: float | None = None  # a collective failed: for the peers' reports
        self.killed = False
        self.timed_out = False
        self.server_died, self.server_pid = False, None  # the server that started them
        self.stacks_dir: str | None = None  # where the ranks answer stack requests
        self.stall = Stall(spec.stall_warning)
        self.found: Report | None = None  # where the ranks were when the timeout struck
        self.memory_start = memory.snapshot()  # to tell an out-of-memory kill (memory.py)

    def execute(self) -> list[Any]:
        server = shared_server() if self.spec.start_method == "forkserver" else ForkServer()
        try:
            try:
                self._start(server)
            except KeyboardInterrupt:
                # mid-message, perhaps, or still importing torch: the next launch starts anew
                server.close(grace=STOP_GRACE_SECONDS)
                print(
                    "nbaccel: interrupted while the workers started; they were stopped.",
                    file=sys.stderr,
                    flush=True,
                )
                raise
            except (EOFError, OSError) as err:
                raise errors.LaunchError(
                    f"nbaccel's fork server (pid {server.process.pid}) stopped while starting "
                    f"the workers ({err}); its own error, if any, is in the kernel's log. The "
                    "next launch starts a new server."
                ) from err
            try:
                self._supervise(server)
            except KeyboardInterrupt:
                self._interrupted(server)
                raise
            finally:
                self._drain_metrics()
            return verdict.judge(self.facts())
        finally:
            self.run.finished = time.time()
            self._finish(server)

    def _interrupted(self, server: ForkServer) -> None:
        """The stop button: find where every unfinished rank is, stop them all (SIGTERM, SIGKILL
        after the grace), and say both. Pressed again meanwhile, it cuts the asking short, or the
        grace (SIGKILL at once); what was found is said either way."""
        try:
            found: object = self._where()
        except KeyboardInterrupt:
            found = "(Pressed twice: where the ranks were was not asked.)"
        self._stop(server)
        while True:
            try:
                self._supervise(server)
                self.relay.end_line()
                print(
                    f"nbaccel: interrupted; the workers were stopped. {found}",
                    file=sys.stderr,
                    flush=True,
                )
                return
            except KeyboardInterrupt:  # pressed again: the grace is over, _on_clock kills
                self.stopping_since = time.monotonic() - GRACE_SECONDS

    @property
    def worker_failed(self) -> bool:
        """A worker raised or died: what a restart may cure. Not a timeout (the next attempt
        would wait as long) nor a lost fork server (nbaccel's own failure)."""
        return bool(self.failed_order) and not self.timed_out and not self.server_died

    def facts(self) -> verdict.Facts:
        """What this attempt saw, for its verdict."""
        ranks = tuple(
            verdict.RankFacts(r.rank, r.pid, r.exit_code, r.result, r.error, r.signaled, r.unseen)
            for r in self.ranks
        )
        return verdict.Facts(
            ranks,
            tuple(self.failed_order),
            self.run,
            return_all=self.spec.return_all,
            timeout=self.spec.timeout,
            timed_out=self.timed_out,
            found=self.found,
            killed=self.killed,
            server_died=self.server_died,
            server_pid=self.server_pid,
            memory_start=self.memory_start,
        )

    def _start(self, server: ForkServer) -> None:
        workers = len(self.spec.envs)
        opened = descriptors.check_room(workers)  # before any is made: the limit, and the fix
        specs, worker_fds = [], []
        self.server_pid, self.id = server.process.pid, server.next_launch()
        self.stacks_dir = tempfile.mkdtemp(prefix="nbaccel-stacks-")
        try:  # the ranks' own ends are closed by _finish, whatever happens here
            for rank, env in enumerate(self.spec.envs):
                env = {**env, STACKS_VAR: self.stacks_dir, LAUNCH_VAR: self.marker}
                (out, err, messages, metrics), theirs = descriptors.worker_ends(workers, opened)
                self.ranks.append(_Worker(int(env["RANK"]), out, err, messages, metrics=metrics))
                self.relay.add(out, self.ranks[-1].rank, "out")
                self.relay.add(err, self.ranks[-1].rank, "err")
                worker_fds += theirs
                specs.append(WorkerSpec(env, os.getcwd(), list(sys.path), self.spec.threads, rank))
            pids = server.start(self.id, specs, worker_fds)
        finally:  # the server has its copies now, or nothing started
            for fd in worker_fds:
                os.close(fd)
        for r, pid in zip(self.ranks, pids, strict=True):
            r.pid = pid
            try:
                r.messages.send_bytes(self.spec.payload)
            except OSError:
                pass  # it died already; its exit report says how

    def _supervise(self, server: ForkServer) -> None:
        """Relay output and messages until every worker has exited; stop them all on failure."""
        selector = selectors.DefaultSelector()
        for r in self.ranks:
            for fd in (r.out, r.err):
                if fd >= 0:
                    selector.register(fd, selectors.EVENT_READ, (r, fd))
            if not r.messages.closed:
                selector.register(r.messages, selectors.EVENT_READ, (r, "messages"))
            selector.register(r.metrics, selectors.EVENT_READ, (r, "metrics"))
        selector.register(server.sock, selectors.EVENT_READ, (None, "server"))
        started = time.monotonic()
        drain_until = None
        try:
            while True:
                now = time.monotonic()
                if all(r.exit_code is not None for r in self.ranks):
                    drain_until = drain_until or now + 1.0  # late output from a dying process
                    if now > drain_until or not self._open_streams(selector):
                        return
                self._on_clock(now, now - started, server)
                if self.view is not None:
                    self.view.update(self.run)
                while server.pending:
                    self._on_server(server.pending.pop(0), server, selector)
                for key, _ in selector.select(timeout=self.spec.monitor_interval):
                    if key.fileobj not in _watched(selector):
                        continue  # unregistered by an earlier event of this round
                    rank, what = key.data
                    if what == "server":
                        try:
                            self._on_server(server.receive(), server, selector)
                        except (EOFError, OSError):
                            _forget(selector, server.sock)
                            self._on_server_death()
                    elif what == "messages":
                        self._on_message(rank, selector, server)
                    elif what == "metrics":
                        self._on_metrics(rank)
                    else:
                        self._on_output(what, selector)
        finally:
            selector.close()
            self.relay.close()  # a bar still open ends its line before anything else prints

    def _on_clock(self, now: float, elapsed: float, server: ForkServer) -> None:
        """What the time alone decides: the timeout, the wait for a peer's report, the stall
        warning, and SIGKILL for ranks that outlived the grace after SIGTERM."""
        timeout = self.spec.timeout
        if timeout is not None and elapsed > timeout and not self.stopping_since:
            self.timed_out = True
            self.found = self._where()  # before anyone is stopped
            self._stop(server, now)
        if not self.stopping_since:
            self._check_stall(now)
            if self.waiting_since and now - self.waiting_since > PEER_REPORT_SECONDS:
                self._stop(server, now)
        if self.stopping_since and not self.killed and now - self.stopping_since > GRACE_SECONDS:
            server.signal(self.id, signal.SIGKILL)
            self.killed = True

    def _open_streams(self, selector) -> bool:
        return any(isinstance(key.data[1], int) for key in selector.get_map().values())

    def _on_server(self, message: Message, server: ForkServer, selector) -> None:
        if not isinstance(message, Exited):
            return
        for r in self.ranks:
            if r.pid == message.pid and r.exit_code is None:
                r.exit_code = message.code
                # What it sent before exiting is already in the socket: read it before judging.
                while r.messages in _watched(selector) and r.messages.poll(0):
                    self._on_message(r, selector, server)
                if r.exit_code != 0 or r.result is None:
                    self._fail(r, server, selector)

    def _on_server_death(self) -> None:
        """The server that would report the exits is gone: no exit is seen from now on. The
        ranks die with it (a parent-death signal); the sweep ends any that did not, by pid."""
        self.server_died = True
        for r in self.ranks:
            if r.exit_code is None:
                r.exit_code, r.unseen = -signal.SIGKILL, True

    def _on_message(self, r: _Worker, selector, server: ForkServer) -> None:
        try:
            message = decode(r.messages.recv_bytes())
        except (EOFError, OSError):
            _forget(selector, r.messages)  # also reached from an exit report in this round
            return
        if isinstance(message, Result):
            r.result = message
        elif isinstance(message, Failure):
            r.error = message
            self._fail(r, server, selector)

    def _on_metrics(self, r: _Worker) -> None:
        if drain(r.metrics, self.run):
            self.stall.heard_from(r.rank, time.monotonic())

    def _running(self) -> list[int]:
        """Ranks that have not finished: neither returned, failed nor exited."""
        return [
            r.rank
            for r in self.ranks
            if r.exit_code is None and r.result is None and r.rank not in self.failed_order
        ]

    def _where(self) -> Report:
        """Where every rank that has not finished is (a fraction of a second at most)."""
        self._drain_metrics()  # the step counts, as up to date as they come
        returned = [r.rank for r in self.ranks if r.result is not None]
        return ask(self.stacks_dir, self._running(), returned, self.run)

    def _check_stall(self, now: float) -> None:
        quiet = self.stall.quiet(self._running(), now)
        if quiet:
            self.relay.end_line()
            print(
                f"nbaccel: no step, sample or log from ranks {quiet} for "
                f"{self.stall.seconds:g} s; they are still running, nothing was stopped. "
                f"{self._where()}",
                file=sys.stderr,
                flush=True,
            )

    def _drain_metrics(self) -> None:
        for r in self.ranks:
            if r.metrics is not None:
                self._on_metrics(r)

    def _on_output(self, fd: int, selector) -> None:
        data = os.read(fd, 65536)
        if not data:
            _forget(selector, fd)
        self.relay.feed(fd, data)

    def _fail(self, r: _Worker, server: ForkServer, selector) -> None:
        """A rank failed. A real error stops everyone at once. A rank that only lost a peer in
        a collective waits for that peer's own report: whatever the order the two arrive in,
        the peer's is the root cause, and a SIGTERM must not cut it short."""
        if r.rank in self.failed_order:
            return
        self.failed_order.append(r.rank)
        if self.stopping_since is not None:
            return
        if self._lost_a_peer(r):
            # What the peers sent before this rank failed is in their sockets already: read it.
            for other in self.ranks:
                while other.messages in _watched(selector) and other.messages.poll(0):
                    self._on_message(other, selector, server)
        if self.stopping_since is not None:
            return
        real = not all(self._lost_a_peer(f) for f in self.ranks if f.rank in self.failed_order)
        if real or not self._running():  # or everyone has spoken: stop those in their cleanup
            self._stop(server)
        else:
            self.waiting_since = self.waiting_since or time.monotonic()

    @staticmethod
    def _lost_a_peer(r: _Worker) -> bool:
        return r.error is not None and r.error.collective

    def _stop(self, server: ForkServer, now: float | None = None) -> None:
        if self.stopping_since is not None:
            return
        self.stopping_since = time.monotonic() if now is None else now
        for r in self.ranks:
            if r.exit_code is None and r.rank not in self.failed_order:
                r.signaled = True
        try:
            server.signal(self.id, signal.SIGTERM)
        except OSError:
            self._on_server_death()

    def _finish(self, server: ForkServer) -> None:
        if any(r.exit_code is None for r in self.ranks):  # an error inside the launcher itself
            try:
                server.signal(self.id, signal.SIGKILL)
            except OSError:
                pass
        for r in self.ranks:
            for fd in (r.out, r.err):
                try:
                    os.close(fd)
                except OSError:
                    pass
            r.messages.close()
            if r.metrics is not None:
                r.metrics.close()
        if self.stacks_dir is not None:
            shutil.rmtree(self.stacks_dir, ignore_errors=True)
        pids = {r.pid: r.rank for r in self.ranks}
        leftovers.sweep(self.marker, pids, server.process.pid, GRACE_SECONDS)
        if self.spec.start_method == "spawn":
            server.close()


def _forget(selector, fileobj) -> None:
    if fileobj in _watched(selector):
        selector.unregister(fileobj)


def _watched(selector) -> list:
    return [key.fileobj for key in selector.get_map().values()]
