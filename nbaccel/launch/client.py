"""The launcher's handle on the fork server (``forkserver.py``): start it, talk to it, close it.

One server per kernel serves every launch (``shared_server``); ``spawn`` launches start their
own and close it after. The handle sends ``Start`` and ``Signal`` and hears ``Started`` and
``Exited`` (``protocol.py``); the server is the workers' parent, so only it signals and reaps them.

In a Jupyter kernel the shared server is started ahead, when the launcher is imported
(``prestart``): the user then spends seconds or minutes writing the model and the loop while it
imports torch, and the first launch waits only for what is left of that. Starting it does not
wait for it (``Popen`` returns once the interpreter is exec'd; the first ``start`` is what waits
for the server's imports, through its socket). The package's own import in a kernel (``import
nbaccel``) starts the same once the notebook holds the package (``nbaccel._prestart_once_bound``,
after the cell). Nowhere else does anything start at import.

What the launch needs in the kernel itself, ``torch.distributed`` (the workers' store) and the
live view's matplotlib, is imported ahead too, but never in a thread: torch's import (its
``_c10d_init``) and matplotlib's are not safe while another thread imports, and a cell that
imports torch while a thread of ours did killed the kernel (SIGABRT) or deadlocked its import
locks. So the kernel imports them on its main thread, from its event loop, once the cell that
imported the launcher has finished (``_when_idle``): one thread, so no import can race another;
between cells, where the kernel ignores the stop button, so no interrupt can cut an import in
half. A cell run meanwhile waits for it (about a second on 2 cores, once a kernel).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import signal
import socket
import subprocess
import sys

from .. import errors
from ..config import load_config
from ..env import PRESTART_VAR, in_notebook
from ..observe.live.panel import warm_up
from .protocol import Message, Refused, Signal, Start, Started, WorkerSpec, recv, send
from .rendezvous import import_torch_distributed


class ForkServer:
    """The launcher's end of ``forkserver.py``: start workers, signal them, hear their exits."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nbaccel.launch.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # Jupyter's interrupt signals the kernel, not the server
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        theirs.close()
        self.sock = ours
        self.pending: list[Message] = []  # exit reports that arrived while waiting for Started
        self._launches = itertools.count()  # each launch's number, by which the server knows it

    def next_launch(self) -> int:
        """A number for the next launch or session on this server: one no other has had."""
        return next(self._launches)

    def start(self, launch: int, specs: list[WorkerSpec], fds: list[int]) -> tuple[int, ...]:
        """Fork the workers; their pids, or ``LaunchError`` when the server refused (nothing
        started)."""
        send(self.sock, Start(launch, tuple(specs)), fds)
        while True:
            message, _ = recv(self.sock)
            if isinstance(message, Started) and message.launch == launch:
                return message.pids
            if isinstance(message, Refused) and message.launch == launch:
                raise errors.LaunchError(
                    f"nbaccel's fork server (pid {self.process.pid}) refused the launch: "
                    f"{message.reason}"
                )
            self.pending.append(message)

    def signal(self, launch: int, sig: int) -> None:
        send(self.sock, Signal(launch, sig))

    def receive(self) -> Message:
        return self.pending.pop(0) if self.pending else recv(self.sock)[0]

    def close(self, grace: float = 10.0) -> None:
        """End the server: it reads EOF, kills its workers, and exits; after ``grace`` seconds,
        SIGKILL (by the pid this handle started). A server still importing torch reads the EOF
        only once its imports are done (seconds on a loaded machine): the stop button closes
        with a short grace, and its workers, if it forked any, die with it (a parent-death
        signal). A shared server closed here is forgotten: the next launch starts a fresh one
        without calling it dead."""
        if _servers.get(os.getpid()) is self:
            del _servers[os.getpid()]
        self.sock.close()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# Process-wide by design: the kernel's one warm fork server, kept between launches (started
# ahead at import: ``prestart``) so that each launch finds torch imported. Keyed by pid: a
# child forked from this process (a DataLoader worker of a one-process launch, say) inherits
# the dict but finds no server of its own, so it never uses or closes its parent's.
_servers: dict[int, ForkServer] = {}


def shared_server() -> ForkServer:
    server = _servers.get(os.getpid())
    if server is not None and (code := server.process.poll()) is not None:
        server.sock.close()  # it died between launches: replace it, and say so
        print(
            f"nbaccel: the worker server (pid {server.process.pid}) {_ended(code)} since the "
            "last launch; starting a fresh one (a few seconds: it imports torch).",
            file=sys.stderr,
            flush=True,
        )
        server = None
    if server is None:
        server = _servers[os.getpid()] = ForkServer()
    return server


def take_server() -> ForkServer:
    """A server for a ranks session alone (``session.py``): this kernel's shared one if it is
    alive (warm: its torch is imported already), which the next launch then replaces, else a
    new one. The session reads every report its server sends, so it shares it with no launch."""
    server = _servers.pop(os.getpid(), None)
    if server is not None and server.process.poll() is None:
        return server
    if server is not None:
        server.sock.close()
    return ForkServer()


def give_back(server: ForkServer) -> None:
    """A session's server whose workers are all gone: the kernel's shared one again if it has
    none (and the server is alive), else closed."""
    server.pending.clear()
    if server.process.poll() is None and os.getpid() not in _servers:
        _servers[os.getpid()] = server
    else:
        server.close(grace=1.0)


def prestart() -> ForkServer | None:
    """Start this kernel's shared server now, and have the kernel import what a launch needs of
    torch and matplotlib once the current cell has finished, if this process is a Jupyter
    kernel that has none and the user did not opt out (``NBACCEL_PRESTART=0``, or ``nbaccel
    config --no-prestart``). Scripts, workers, the server itself and torchrun's processes are
    not kernels: nothing starts there. Returns the server started, if one was."""
    if not in_notebook() or os.getpid() in _servers:
        return None
    if os.environ.get(PRESTART_VAR, "1").strip() == "0":
        return None
    try:
        if not load_config().prestart:
            return None
    except ValueError:
        return None  # a broken config file is said by the launch that reads it, not here
    server = _servers[os.getpid()] = ForkServer()
    _when_idle(warm_kernel)
    return server


def warm_kernel() -> None:
    """What a launch needs in this process, imported now: ``torch.distributed``, whose TCPStore
    is where the workers meet (``rendezvous.py``; a notebook whose cells never imported torch
    would wait for it at its first launch, about a second on 2 cores), and the live view's
    first panel (``panel.warm_up``: matplotlib and its fonts, 0.4 s). Call it on the thread
    that runs the cells, never beside it (``_when_idle``). Raises nothing: a warm-up only saves
    time, and the launch meets the same error and says it."""
    try:
        import_torch_distributed()
    except Exception:
        pass
    warm_up()  # contains its own errors


def _when_idle(work, cells: int = 3) -> None:
    """Run ``work`` on this thread's event loop (a kernel's main thread, the one that runs the
    cells) once no cell is running: never at the same time as a cell's own code, since both run
    on one thread, and never while the stop button could interrupt it (ipykernel ignores
    SIGINT between cells; a cell that awaits lets the loop run with it armed: then the work
    waits for the cell's end). Gives up after ``cells`` cells (a kernel that never ignores
    SIGINT), or where no loop runs here: the launch imports what it needs itself."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return

    def run() -> None:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            work()
        elif cells > 1:  # a cell is running (at an await): after it ends
            shell = sys.modules["IPython"].get_ipython()

            def after_cell(*_) -> None:
                shell.events.unregister("post_run_cell", after_cell)
                _when_idle(work, cells - 1)

            shell.events.register("post_run_cell", after_cell)

    loop.call_soon(run)


def _ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == 0:  # it never exits by itself while the kernel holds its socket: a 0 is also
        return "ended"  # what Popen reports when something else collected its exit status
    return f"exited with code {code}"


@atexit.register
def _close_servers() -> None:
    server = _servers.pop(os.getpid(), None)
    if server is not None:
        server.close()
