"""A ranks session: workers that stay across notebook cells (``Ranks``; ``%%ranks`` in
``magics.py``).

The ranks fork from a fork server as a launch's workers do (``forkserver.py``; the kernel's warm
one when it has one, ``client.take_server``), join their process group once (gloo on CPUs, NCCL
on GPUs) and then serve cells (``cells.py``). Kernel and ranks talk over the socketpairs and
pipes a launch uses: nothing listens for code, and only the store the group met at (loopback,
as a launch's) stays open while the session lives. Each rank keeps its own namespace.

A cell waits (``Waiter``, ``waiter.py``) for every rank it runs on, relaying their output with
rank labels, their figures and ``display()`` calls, and the live panel of what they record.
Then:

* an exception on any rank fails the cell with its traceback (every failing rank's, the cause
  first); the ranks keep their state and the next cell runs on them;
* the stop button sends SIGINT to the ranks running the cell (KeyboardInterrupt there); those
  that do not end within ``INTERRUPT_S`` are stuck (in C, in a collective): the cell says where
  each rank is (the hang report) and ends;
* a rank waiting in a collective while another rank is idle, for ``stall_timeout`` seconds,
  waits for a peer that cannot come: the same report ends the cell;
* after a hang, ``on_hang="keep"`` leaves the stuck ranks in their cell (the matching
  collective on the others, ``%%ranks 1``, frees them; their late report is said), and
  ``"restart"`` starts fresh ranks;
* a rank that dies fails the cell naming it and its signal; the others are stopped, since a
  group that lost a rank cannot be trusted, and every later cell says to restart.

``stop()`` (also at the kernel's exit) ends the ranks and leaves nothing running; a kernel killed
outright takes them too (the server kills its workers when the kernel's socket closes, and dies
with them otherwise: a parent-death signal).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import itertools
import linecache
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Literal

import psutil

from .. import errors
from ..config import LaunchConfig, check_seconds, load_config
from ..env import LAUNCH_VAR, STACKS_VAR, device_label
from ..errors import NbaccelError, RankFailure
from . import client, descriptors, leftovers, memory
from .cells import BACKEND
from .protocol import Cell, Done, Exited, Signal, WorkerSpec, recv, send
from .relay import Relay
from .rendezvous import import_torch_distributed, interrupt_held, meeting, worker_envs
from .supervisor import GRACE_SECONDS
from .waiter import LEAVE_S, SessionRank, Waiter

START_S = 120.0  # for the ranks to fork and join their group: only a broken machine takes long


class Ranks:
    """Ranks that stay across cells: each keeps its namespace, its process group stays.

    >>> with Ranks(2, cpu=True) as ranks:  # doctest: +SKIP
    ...     ranks.run("x = torch.tensor([rank + 1.0])")
    ...     ranks.run("dist.all_reduce(x); x")   # [rank 0] tensor([3.]) / [rank 1] tensor([3.])
    ...     ranks.pull("x")                      # [tensor([3.]), tensor([3.])]

    Each rank's namespace starts with ``rank``, ``world_size``, ``local_rank``, ``torch``,
    ``dist`` and ``display``; ``Accelerator()`` in a cell works as in a launched function.

    Args:
        num_processes: ranks on this machine (default as ``notebook_launcher``'s).
        cpu, mixed_precision, fsdp, deepspeed, zero_stage: the defaults of ``Accelerator()``
            on the ranks, as ``notebook_launcher``'s.
        timeout: seconds a cell may run; then it is stopped as by the stop button. None: no limit.
        output: ``"all"`` ranks' lines, or ``"main"`` (rank 0's); a cell may choose its own.
        stall_timeout: seconds a rank may wait in a collective while another rank is idle (so
            cannot join it) before the cell reports the hang and ends.
        on_hang: after a hang: ``"keep"`` the stuck ranks in their cell, or ``"restart"``.
        live: draw the live panel of what the ranks record, as a launch does.
    """

    def __init__(
        self,
        num_processes: int | None = None,
        *,
        cpu: bool | None = None,
        mixed_precision: Literal["no", "fp16", "bf16"] | None = None,
        timeout: float | None = None,
        output: Literal["all", "main"] = "all",
        stall_timeout: float = 10.0,
        on_hang: Literal["keep", "restart"] = "keep",
        live: bool = True,
        fsdp: bool | None = None,
        deepspeed: bool | None = None,
        zero_stage: int | None = None,
    ) -> None:
        self.timeout = check_seconds(
            "timeout", timeout, "600", none="let a cell run as long as it takes", default=False
        )
        self.stall_timeout = check_seconds("stall_timeout", stall_timeout, "10", none="never")
        choices = (("output", output, ("all", "main")), ("on_hang", on_hang, ("keep", "restart")))
        for name, value, allowed in choices:
            if value not in allowed:
                raise NbaccelError(f"{name}={value!r}: give one of {', '.join(allowed)}")
        self.output, self.on_hang, self.live = output, on_hang, bool(live)
        self.config = LaunchConfig.from_arguments(
            num_processes=num_processes,
            mixed_precision=mixed_precision,
            cpu=cpu,
            fsdp=fsdp,
            deepspeed=deepspeed,
            zero_stage=zero_stage,
            defaults=load_config(),
        )
        self.device = device_label("cuda" if self.config.gpus else "cpu")  # the ranks' choice
        self.ranks: list[SessionRank] = []
        self.server: client.ForkServer | None = None
        self.broken: str | None = None  # why the ranks were stopped, said by every later cell
        self._numbers = itertools.count(1)
        self.labels: dict[int, int] = {}  # request number -> the cell's number, as shown
        self._closing = contextlib.ExitStack()
        self.start()

    # -- the ranks' life --------------------------------------------------------------------------
    def start(self) -> None:
        """Fork the ranks and wait until each joined the group (``START_S`` at most)."""
        if self.ranks:
            raise NbaccelError("the ranks are running already: stop() or restart() first")
        self.broken, self.id, self.marker = None, None, os.urandom(8).hex()
        self.stacks_dir = tempfile.mkdtemp(prefix="nbaccel-stacks-")
        self.relay = Relay(self.output)
        self.memory_start = memory.snapshot()  # to tell an out-of-memory kill (memory.py)
        try:
            import_torch_distributed()  # the store needs it; a press mid-import would break torch
            self._fork()
            self._wait(0, list(range(len(self.ranks))), limit=START_S, what="start")
        except BaseException:  # the server may have been cut mid-message: not given back
            self.stop(quiet=True, keep_server=False)
            raise
        atexit.register(self.stop, True)  # the kernel's exit ends the ranks, said or not

    def _fork(self) -> None:
        with interrupt_held():  # a press now ends the start once the server is held
            self.server = client.take_server()
        self.id = self.server.next_launch()  # the server's number for these ranks
        port = self._closing.enter_context(meeting(self.config))
        envs = worker_envs(self.config, port, 0)
        opened = descriptors.check_room(len(envs))
        specs, theirs = [], []
        try:
            for local, env in enumerate(envs):
                env = {**env, STACKS_VAR: self.stacks_dir, LAUNCH_VAR: self.marker}
                env["MPLBACKEND"] = BACKEND
                (out, err, messages, metrics), fds = descriptors.worker_ends(len(envs), opened)
                self.ranks.append(SessionRank(int(env["RANK"]), out, err, messages, metrics))
                self.relay.add(out, self.ranks[-1].rank, "out")
                self.relay.add(err, self.ranks[-1].rank, "err")
                theirs += fds
                threads = int(env["OMP_NUM_THREADS"])
                specs.append(WorkerSpec(env, os.getcwd(), list(sys.path), threads, local, True))
            pids = self.server.start(self.id, specs, theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        for r, pid in zip(self.ranks, pids, strict=True):
            r.pid = pid

    def stop(self, quiet: bool = False, keep_server: bool = True) -> None:
        """End the ranks (their state is lost) and free what they held; safe to call twice.
        The server goes back to the kernel (``keep_server``) or is closed."""
        atexit.unregister(self.stop)
        server, ranks = self.server, self.ranks
        self.ranks, self.server = [], None
        if server is not None:
            end_ranks(server, self.id, ranks)
            for r in ranks:
                r.close()
            pids = {r.pid: r.rank for r in ranks}
            leftovers.sweep(self.marker, pids, server.process.pid, GRACE_SECONDS)
            if keep_server:
                client.give_back(server)
            else:
                server.close(grace=0.5)
        self._closing.close()
        shutil.rmtree(getattr(self, "stacks_dir", ""), ignore_errors=True)
        if ranks and not quiet:
            print(f"nbaccel: stopped {len(ranks)} ranks.", file=sys.stderr, flush=True)

    def restart(self) -> None:
        """Fresh ranks and a new process group (the old ranks' state is lost)."""
        self.stop(quiet=True)
        self.start()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(quiet=True)

    # -- cells ----------------------------------------------------------------------------------
    def run(
        self,
        code: str,
        ranks: int | list[int] | None = None,
        *,
        output: Literal["all", "main"] | None = None,
        filename: str | None = None,
        cell: int | None = None,
    ) -> None:
        """Run ``code`` on ``ranks`` (default: every rank), each in its own namespace.
        ``cell``: the notebook's number for it (``%%ranks`` gives its execution count), said
        in reports and ``status``; by default the session counts its own.

        Raises ``CellError`` when a rank raised (its traceback), died, or hung; and
        KeyboardInterrupt at the stop button, once the ranks ended the cell."""
        ast.parse(code, filename or "<ranks cell>")  # a SyntaxError is said here, once
        targets = self._targets(ranks)
        number = next(self._numbers)
        if filename is None:  # the kernel's copy of the source: tracebacks show its lines
            filename = f"<ranks cell {number}>"
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self.labels[number] = number if cell is None else cell
        self._request(Cell(number, code, filename), targets, output or self.output)

    def push(self, ranks: int | list[int] | None = None, **values: Any) -> None:
        """Put ``values`` (by name) into the namespace of ``ranks`` (default: every rank)."""
        from .protocol import pack_call

        payload = pack_call(dict, (), values)  # cloudpickled: cell-defined classes travel
        self._request(Cell(next(self._numbers), push=payload), self._targets(ranks))

    def pull(self, name: str, ranks: int | list[int] | None = None) -> list[Any]:
        """``name``'s value on each of ``ranks`` (default: every rank), in rank order; tensors
        come back on the CPU."""
        import cloudpickle

        done = self._request(Cell(next(self._numbers), pull=name), self._targets(ranks))
        return [cloudpickle.loads(done[r].value.value) for r in sorted(done)]

    def _request(self, message: Cell, targets: list[int], output: str = "all") -> dict[int, Done]:
        self.relay.output = output
        try:
            return self._wait(message.number, targets, limit=self.timeout, message=message)
        finally:
            self.relay.output = self.output

    def _wait(self, number, targets, limit, what="cell", message=None) -> dict[int, Done]:
        waiter = Waiter(self, number, targets, limit, what)
        try:
            return waiter.wait(message)
        except errors.CellError as err:
            if self.broken:  # a rank died: the group cannot be trusted, the others end too
                end_ranks(self.server, self.id, self.ranks, gentle=False)
            if err.hung and self.on_hang == "restart":
                print("nbaccel: restarting the ranks (on_hang='restart')...", file=sys.stderr)
                self.restart()
                err.add_note("The ranks were restarted: fresh ranks, a new group, no state.")
            raise

    def _targets(self, ranks: int | list[int] | None) -> list[int]:
        if not self.ranks:
            why = f" {self.broken}" if self.broken else ""
            raise NbaccelError(
                f"no ranks are running.{why} Start them: %ranks start N, or Ranks(N); "
                "%ranks restart after a failure."
            )
        poll_deaths(self)
        if self.broken:
            raise NbaccelError(
                f"{self.broken} Start fresh ranks with %ranks restart (Ranks.restart()); their "
                "state is lost."
            )
        world = len(self.ranks)
        chosen = (
            list(range(world)) if ranks is None else [ranks] if isinstance(ranks, int) else ranks
        )
        bad = [r for r in chosen if not isinstance(r, int) or not 0 <= r < world]
        if bad or not chosen or len(set(chosen)) != len(chosen):
            raise NbaccelError(f"ranks={ranks!r}: give ranks between 0 and {world - 1}, each once")
        busy = [self.ranks[r] for r in chosen if self.ranks[r].busy is not None]
        if busy:
            stuck = ", ".join(
                f"rank {r.rank} is still in cell {self.labels.get(r.busy, r.busy)}" for r in busy
            )
            idle = [r.rank for r in self.ranks if r.busy is None]
            free = ""
            if idle:
                free = (
                    f"run the collective it waits in on ranks {idle} (%%ranks "
                    f"{','.join(map(str, idle))}) to free it, or "
                )
            raise NbaccelError(f"{stuck}: {free}%ranks restart for fresh ranks.")
        return sorted(chosen)

    # -- what the ranks are doing ---------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        """Each rank: rank, pid, alive, busy (the cell it runs) or idle, the last cell it ran."""
        if self.ranks:
            poll_deaths(self)
        rows = []
        for r in self.ranks:
            state = "idle" if r.busy is None else f"busy (cell {self.labels.get(r.busy, r.busy)})"
            alive = r.exit_code is None
            rows.append(
                {"rank": r.rank, "pid": r.pid, "alive": alive, "state": state, "last_cell": r.last}
            )
        return rows

    def __repr__(self) -> str:
        alive = sum(r.exit_code is None for r in self.ranks)
        broken = f"; {self.broken}" if self.broken else ""
        return f"<Ranks: {alive} of {len(self.ranks)} alive{broken}>"


# -- ending the ranks ---------------------------------------------------------------------------
def end_ranks(
    server: client.ForkServer, launch: int, ranks: list[SessionRank], gentle: bool = True
) -> None:
    """End every rank still alive: idle ones leave at their socket's end (``gentle``), then
    SIGTERM to each one's process group, SIGKILL after ``GRACE_SECONDS``; their exits heard."""
    ranks = [r for r in ranks if r.pid is not None]  # none forked when the server refused
    steps = [(None, LEAVE_S)] if gentle else []
    steps += [(signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, GRACE_SECONDS)]
    for sig, seconds in steps:
        if all(r.exit_code is not None for r in ranks):
            return
        try:
            if sig is None:
                for r in ranks:
                    r.messages.close()
            else:
                send(server.sock, Signal(launch, sig))
        except OSError:
            return  # the server is gone: its workers died with it
        deadline = time.monotonic() + seconds
        while any(r.exit_code is None for r in ranks) and time.monotonic() < deadline:
            _hear(server, ranks, deadline - time.monotonic())


def _hear(server: client.ForkServer, ranks: list[SessionRank], timeout: float) -> None:
    """Exit reports from the server for up to ``timeout`` seconds (0: those already in)."""
    messages = list(server.pending)
    server.pending.clear()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(server.sock, selectors.EVENT_READ)
            if selector.select(max(timeout, 0)):
                messages.append(recv(server.sock)[0])
    except (EOFError, OSError):
        for r in ranks:  # the server is gone, and its workers with it
            r.exit_code = -signal.SIGKILL if r.exit_code is None else r.exit_code
    for message in messages:
        for r in ranks:
            if isinstance(message, Exited) and r.pid == message.pid:
                r.exit_code = message.code


def poll_deaths(session: Ranks) -> None:
    """What the ranks said since the last request; and a rank that died between cells: the
    session is broken, and the others end. A rank whose process is gone is waited for until
    the server's report of it arrives (the server reaps it), so the death is said here."""
    before = {r.rank for r in session.ranks if r.exit_code is not None}
    if session.broken is None:
        Waiter(session, 0, [], None, "late").drain()
    gone = [r for r in session.ranks if r.exit_code is None and not _running(r.pid)]
    _hear(session.server, session.ranks, 0)
    deadline = time.monotonic() + START_S  # a hang guard: the report follows the reaping
    while any(r.exit_code is None for r in gone) and time.monotonic() < deadline:
        _hear(session.server, session.ranks, 0.1)
    dead = [r for r in session.ranks if r.exit_code is not None and r.rank not in before]
    if dead and session.broken is None:
        failure = RankFailure(dead[0].rank, dead[0].pid, dead[0].exit_code)
        session.broken = f"{failure.describe()} between cells; the other ranks were stopped."
        if session.server.process.poll() is not None:  # its socket closed: the server died
            session.broken = (
                f"nbaccel's fork server (pid {session.server.process.pid}) stopped between "
                "cells, and the ranks with it."
            )
        end_ranks(session.server, session.id, session.ranks, gentle=False)


def _running(pid: int | None) -> bool:
    """Whether ``pid`` runs (a zombie does not: it died, and awaits its reaping)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError):
        return False
