"""The launcher's handle on the fork server (``forkserver.py``): start it, talk to it, close it.

One server per kernel serves every launch (``shared_server``); ``spawn`` launches start their
own and close it after. The handle sends ``Start`` and ``Signal`` and hears ``Started`` and
``Exited`` (``protocol.py``); the server is the workers' parent, so only it signals and reaps them.

In a Jupyter kernel the shared server is started ahead, when the launcher is imported
(``prestart``): the user then spends seconds or minutes writing the model and the loop while it
imports torch, and the first launch waits only for what is left of that. Starting it does not
wait for it (``Popen`` returns once the interpreter is exec'd; the first ``start`` is what waits
for the server's imports, through its socket). The live view's matplotlib is loaded then too,
in a thread of the kernel (``panel.warm_up``: 0.4 s of one core, 35 MiB), and, unless the
notebook imported it already, ``torch.distributed`` in another (``_import_torch``: the launch
hosts the workers' store with it), so the first launch waits for neither. The package's own
import in a kernel (``import nbaccel``) starts the same once the notebook holds the package
(``nbaccel._prestart_once_bound``, after the cell). Nowhere else does anything start at import.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading

from ..config import load_config
from ..env import PRESTART_VAR, in_notebook
from ..observe.live.panel import warm_up
from .protocol import Message, Signal, Start, Started, WorkerSpec, recv, send


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

    def start(self, launch: int, specs: list[WorkerSpec], fds: list[int]) -> tuple[int, ...]:
        send(self.sock, Start(launch, tuple(specs)), fds)
        while True:
            message, _ = recv(self.sock)
            if isinstance(message, Started) and message.launch == launch:
                return message.pids
            self.pending.append(message)

    def signal(self, launch: int, sig: int) -> None:
        send(self.sock, Signal(launch, sig))

    def receive(self) -> Message:
        return self.pending.pop(0) if self.pending else recv(self.sock)[0]

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


def prestart() -> ForkServer | None:
    """Start this kernel's shared server now, and load the live view's matplotlib in a thread,
    if this process is a Jupyter kernel that has none and the user did not opt out
    (``NBACCEL_PRESTART=0``, or ``nbaccel config --no-prestart``). Scripts, workers, the server
    itself and torchrun's processes are not kernels: nothing starts there. Returns the server
    started, if one was."""
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
    warm_up()  # the view's first panel, in a thread: the first launch's view is then ready
    if "torch.distributed" not in sys.modules:  # the launch hosts the workers' store with it
        threading.Thread(target=_import_torch, name="nbaccel-torch-import", daemon=True).start()
    return server


def _import_torch() -> None:
    """What a launch needs of torch in the kernel: ``torch.distributed``, whose TCPStore is where
    the workers meet (``rendezvous.py``). A notebook whose cells never imported torch (a first
    launch of a function that prints its rank) would wait for it at the launch, about a second
    on 2 cores. A cell that imports torch meanwhile waits for this import, not for a second."""
    try:
        import torch.distributed  # noqa: F401
    except Exception:
        pass  # the launch imports it again, and says what is wrong there


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
