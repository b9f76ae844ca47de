"""The launcher's side of a launch: the fork server client and the supervisor of one launch.

``ForkServer`` starts ``forkserver.py`` (one per kernel) and talks to it; ``Launch`` starts a
launch's workers through it, relays their output line by line, receives their results, errors
and metrics, stops everyone when one fails, and decides which failure was the root cause.
"""

from __future__ import annotations

import atexit
import itertools
import linecache
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

from .errors import LaunchError, RankFailure
from .metrics import Run, decode

GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL when stopping workers


# -- the fork server, one per kernel -------------------------------------------------------------
class ForkServer:
    """The launcher's end of ``forkserver.py``: start workers, signal them, hear their exits."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nbaccel.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # Jupyter's interrupt signals the kernel, not the server
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        theirs.close()
        self.sock = ours
        self.pending: list[dict] = []  # exit reports that arrived while waiting for "started"

    def start(self, launch: int, specs: list[dict], fds: list[int]) -> list[int]:
        from .forkserver import recv_message, send_message

        send_message(self.sock, {"kind": "launch", "launch": launch, "workers": specs}, fds)
        while True:
            message, _ = recv_message(self.sock)
            if message["kind"] == "started" and message["launch"] == launch:
                return message["pids"]
            self.pending.append(message)

    def signal(self, launch: int, sig: int) -> None:
        from .forkserver import send_message

        send_message(self.sock, {"kind": "signal", "launch": launch, "signal": sig})

    def receive(self) -> dict:
        from .forkserver import recv_message

        return self.pending.pop(0) if self.pending else recv_message(self.sock)[0]

    def close(self) -> None:
        self.sock.close()  # the server sees EOF, kills any workers, and exits
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_servers: dict[int, ForkServer] = {}  # process-wide by design: one helper per kernel, by pid


def shared_server() -> ForkServer:
    server = _servers.get(os.getpid())
    if server is not None and server.process.poll() is not None:
        server.sock.close()  # it died between launches: replace it
        server = None
    if server is None:
        server = _servers[os.getpid()] = ForkServer()
    return server


@atexit.register
def _close_servers() -> None:
    server = _servers.pop(os.getpid(), None)
    if server is not None:
        server.close()


# -- one launch ----------------------------------------------------------------------------------
_launch_ids = itertools.count()


@dataclass
class _Rank:
    rank: int
    out: int  # read ends of the worker's stdout and stderr pipes
    err: int
    channel: Connection
    pid: int | None = None
    exit_code: int | None = None
    result: bytes | None = None
    error: dict | None = None
    metrics: socket.socket | None = None  # datagrams from the worker's metrics.Channel
    signaled: bool = False  # still running when the launch began to stop the workers
    partial: dict[int, bytes] = field(default_factory=dict)


class Launch:
    """One attempt: start the workers, supervise them to the end, return or raise.

    ``monitor_interval`` is the longest the supervisor sleeps between its own checks (the
    timeout, the grace before SIGKILL, a live view's redraw); exits, errors and output wake it
    at once. The caller owns ``view`` and closes it.
    """

    def __init__(
        self,
        start_method,
        envs,
        threads,
        payload,
        timeout,
        output,
        run=None,
        view=None,
        monitor_interval=0.1,
    ) -> None:
        self.start_method, self.envs, self.threads = start_method, envs, threads
        self.payload, self.timeout, self.output = payload, timeout, output
        self.run, self.view = run if run is not None else Run(), view
        self.monitor_interval = monitor_interval
        self.id = next(_launch_ids)
        self.ranks: list[_Rank] = []
        self.failed_order: list[int] = []
        self.stopping_since: float | None = None
        self.killed = False
        self.timed_out = False
        self.server_died = False

    def execute(self) -> list[Any]:
        server = shared_server() if self.start_method == "forkserver" else ForkServer()
        try:
            try:
                self._start(server)
            except (EOFError, OSError) as err:
                raise LaunchError(
                    f"nbaccel's fork server (pid {server.process.pid}) stopped while starting "
                    f"the workers ({err}); its own error, if any, is in the kernel's log. The "
                    "next launch starts a new server."
                ) from err
            try:
                self._supervise(server)
            except KeyboardInterrupt:
                self._stop(server)
                self._supervise(server)
                raise
            finally:
                self._drain_metrics()
            return self._outcome()
        finally:
            self.run.finished = time.time()
            self._finish(server)

    @property
    def worker_failed(self) -> bool:
        """A worker raised or died: what a restart may cure. Not a timeout (the next attempt
        would wait as long) nor a lost fork server (nbaccel's own failure)."""
        return bool(self.failed_order) and not self.timed_out and not self.server_died

    def _start(self, server: ForkServer) -> None:
        specs, worker_fds = [], []
        for rank, env in enumerate(self.envs):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            ours, theirs = socket.socketpair()
            metrics, their_metrics = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            metrics.setblocking(False)
            self.ranks.append(
                _Rank(int(env["RANK"]), out_r, err_r, Connection(ours.detach()), metrics=metrics)
            )
            worker_fds += [out_w, err_w, theirs.detach(), their_metrics.detach()]
            specs.append(
                {
                    "env": env,
                    "cwd": os.getcwd(),
                    "sys_path": list(sys.path),
                    "threads": self.threads,
                    "local_rank": rank,
                }
            )
        try:
            pids = server.start(self.id, specs, worker_fds)
        finally:
            for fd in worker_fds:
                os.close(fd)
        for r, pid in zip(self.ranks, pids, strict=True):
            r.pid = pid
            try:
                r.channel.send_bytes(self.payload)
            except OSError:
                pass  # it died already; its exit report says how

    def _supervise(self, server: ForkServer) -> None:
        """Relay output and messages until every worker has exited; stop them all on failure."""
        selector = selectors.DefaultSelector()
        for r in self.ranks:
            for fd in (r.out, r.err):
                if fd >= 0:
                    selector.register(fd, selectors.EVENT_READ, (r, fd))
            if not r.channel.closed:
                selector.register(r.channel, selectors.EVENT_READ, (r, "channel"))
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
                if (
                    self.timeout is not None
                    and now - started > self.timeout
                    and not self.stopping_since
                ):
                    self.timed_out = True
                    self._stop(server)
                if (
                    self.stopping_since
                    and not self.killed
                    and now - self.stopping_since > GRACE_SECONDS
                ):
                    server.signal(self.id, signal.SIGKILL)
                    self.killed = True
                if self.view is not None:
                    self.view.update(self.run)
                while server.pending:
                    self._on_server(server.pending.pop(0), server, selector)
                for key, _ in selector.select(timeout=self.monitor_interval):
                    if key.fileobj not in _watched(selector):
                        continue  # unregistered by an earlier event of this round
                    rank, what = key.data
                    if what == "server":
                        try:
                            self._on_server(server.receive(), server, selector)
                        except (EOFError, OSError):
                            _forget(selector, server.sock)
                            self._on_server_death()
                    elif what == "channel":
                        self._on_channel(rank, selector, server)
                    elif what == "metrics":
                        self._on_metrics(rank)
                    else:
                        self._on_output(rank, what, selector)
        finally:
            selector.close()

    def _open_streams(self, selector) -> bool:
        return any(isinstance(key.data[1], int) for key in selector.get_map().values())

    def _on_server(self, message: dict, server: ForkServer, selector) -> None:
        if message["kind"] != "exited":
            return
        for r in self.ranks:
            if r.pid == message["pid"] and r.exit_code is None:
                r.exit_code = message["code"]
                # What it sent before exiting is already in the socket: read it before judging.
                while r.channel in _watched(selector) and r.channel.poll(0):
                    self._on_channel(r, selector, server)
                if r.exit_code != 0 or r.result is None:
                    self._fail(r, server)

    def _on_server_death(self) -> None:
        self.server_died = True
        for r in self.ranks:
            if r.exit_code is None:
                r.exit_code = -signal.SIGKILL

    def _on_channel(self, r: _Rank, selector, server: ForkServer) -> None:
        try:
            message = pickle.loads(r.channel.recv_bytes())
        except (EOFError, OSError):
            _forget(selector, r.channel)  # also reached from an exit report in this round
            return
        if message["kind"] == "result":
            r.result = message["value"]
        elif message["kind"] == "error":
            r.error = message
            self._fail(r, server)

    def _on_metrics(self, r: _Rank) -> None:
        while True:
            try:
                datagram = r.metrics.recv(1 << 16)
            except (BlockingIOError, OSError):
                return
            records, rank, dropped = decode(datagram)
            self.run.add(records)
            self.run.dropped[rank] = dropped

    def _drain_metrics(self) -> None:
        for r in self.ranks:
            if r.metrics is not None:
                self._on_metrics(r)

    def _on_output(self, r: _Rank, fd: int, selector) -> None:
        data = os.read(fd, 65536)
        buffered = r.partial.get(fd, b"") + data
        *lines, rest = buffered.split(b"\n")
        if not data:  # EOF: print what is left, stop watching
            _forget(selector, fd)
            lines, rest = ([rest] if rest else []), b""
        r.partial[fd] = rest
        if self.output == "main" and r.rank != 0:
            return
        stream = sys.stdout if fd == r.out else sys.stderr
        for line in lines:
            print(f"[rank {r.rank}] {line.decode(errors='replace')}", file=stream)
        if lines:
            stream.flush()

    def _fail(self, r: _Rank, server: ForkServer) -> None:
        if r.rank not in self.failed_order:
            self.failed_order.append(r.rank)
        self._stop(server)

    def _stop(self, server: ForkServer) -> None:
        if self.stopping_since is not None:
            return
        self.stopping_since = time.monotonic()
        for r in self.ranks:
            if r.exit_code is None and r.rank not in self.failed_order:
                r.signaled = True
        try:
            server.signal(self.id, signal.SIGTERM)
        except OSError:
            self._on_server_death()

    def _outcome(self) -> list[Any]:
        import cloudpickle

        if not self.failed_order and not self.timed_out and not self.server_died:
            values = [cloudpickle.loads(r.result) for r in self.ranks]
            self.run.results = {r.rank: v for r, v in zip(self.ranks, values, strict=True)}
            return values
        failures = self.run.failures = self._failures()
        if self.timed_out and not any(f.exc_type for f in failures if not f.secondary):
            late = [r.rank for r in self.ranks if r.signaled]
            raise LaunchError(
                f"timeout: ranks {late} had not finished after {self.timeout} s and were stopped. "
                "A rank stuck in a collective usually means another rank skipped it.",
                failures,
                self.run,
            ) from None
        if self.server_died and not failures:
            raise LaunchError("nbaccel's fork server died; the next launch starts a new one")
        root = failures[0]
        lines = [root.describe()]
        if root.traceback:
            header = f"Traceback on rank {root.rank} (most recent call last):"
            text = root.traceback.replace("Traceback (most recent call last):", header)
            lines += ["", text.rstrip()]
        others = [
            f.describe() + (" (stopped by nbaccel)" if self._by_us(f) else "") for f in failures[1:]
        ]
        if others:
            lines += ["", "Other ranks:"] + [f"  {o}" for o in others]
        finished = [r.rank for r in self.ranks if self._returned(r.rank)]
        if root.secondary and finished:
            lines += [
                "",
                f"Ranks {finished} had already returned while rank {root.rank} waited for them "
                "in a collective: the ranks ran different numbers of steps (a different number "
                "of batches, or a loop that stops on one rank's clock or data). Make every "
                "rank stop at the same step.",
            ]
        raise LaunchError("\n".join(lines), failures, self.run) from None

    def _returned(self, rank: int) -> bool:
        return any(r.rank == rank and r.result is not None for r in self.ranks)

    def _by_us(self, f: RankFailure) -> bool:
        """Died of our SIGTERM, or of our SIGKILL once we sent one (not of its own doing)."""
        r = next(r for r in self.ranks if r.rank == f.rank)
        ours = {-signal.SIGTERM} | ({-signal.SIGKILL} if self.killed else set())
        return r.signaled and r.exit_code in ours

    def _failures(self) -> list[RankFailure]:
        failures = []
        for r in self.ranks:
            if r.error is not None:
                exc = r.error["exception"]
                failures.append(
                    RankFailure(
                        r.rank,
                        r.pid,
                        r.exit_code,
                        exc["type"],
                        exc["message"],
                        format_exception(exc),
                        secondary=r.error["collective"],
                    )
                )
            elif r.exit_code not in (0, None) or (r.exit_code == 0 and r.result is None):
                note = "without returning a result" if r.exit_code == 0 else ""
                failures.append(RankFailure(r.rank, r.pid, r.exit_code, message=note))
        failures = [replace(f, secondary=f.secondary or self._by_us(f)) for f in failures]
        # A rank that returned its value and was stopped while leaving did nothing wrong.
        failures = [f for f in failures if not (self._returned(f.rank) and self._by_us(f))]
        order = {rank: i for i, rank in enumerate(self.failed_order)}

        def priority(f: RankFailure):
            # real errors first, then hard deaths, then ranks that only lost a peer or that we
            # stopped; ties broken by the order in which the failures arrived
            return (
                f.secondary,
                f.exc_type is None,
                order.get(f.rank, len(order)),
                f.rank,
            )

        return sorted(failures, key=priority)

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
            r.channel.close()
            if r.metrics is not None:
                r.metrics.close()
        if self.start_method == "spawn":
            server.close()


def _forget(selector, fileobj) -> None:
    if fileobj in _watched(selector):
        selector.unregister(fileobj)


def _watched(selector) -> list:
    return [key.fileobj for key in selector.get_map().values()]


def format_exception(exc: dict) -> str:
    """A worker's exception (plain data) as Python prints it, with source lines filled in here.

    Functions defined in notebook cells have their source in this kernel's line cache, not in
    the worker's, so the lines are looked up on this side.
    """
    parts = []
    if exc.get("cause"):
        parts += [
            format_exception(exc["cause"]),
            "\nThe above exception was the direct cause of the following exception:\n\n",
        ]
    elif exc.get("context"):
        parts += [
            format_exception(exc["context"]),
            "\nDuring handling of the above exception, another exception occurred:\n\n",
        ]
    frames = [
        (filename, lineno, name, line or linecache.getline(filename, lineno or 0).strip())
        for filename, lineno, name, line in exc["frames"]
    ]
    name = (
        exc["type"]
        if exc["module"] in ("builtins", "__main__")
        else f"{exc['module']}.{exc['type']}"
    )
    parts.append("Traceback (most recent call last):\n")
    parts += traceback.StackSummary.from_list(frames).format()
    parts.append(f"{name}: {exc['message']}\n" if exc["message"] else f"{name}\n")
    return "".join(parts)
