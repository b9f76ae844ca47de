"""The launcher's handle on the fork server (``forkserver.py``): start it, talk to it, close it.

One server per kernel serves every launch (``shared_server``); ``spawn`` launches start their
own and close it after. The handle sends ``Start`` and ``Signal`` and hears ``Started`` and
``Exited`` (``protocol.py``); the server is the workers' parent, so only it signals and reaps them.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys

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
