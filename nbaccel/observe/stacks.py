"""Where a hung rank is stuck: every rank's Python stack, and the collective it waits in.

Worker side: code about to block in communication says so with ``waiting_in`` (one assignment,
cheap enough for every step), so a rank's report can name the collective even where its Python
stack shows only ``backward``. A launched worker also runs ``listen``: a daemon thread on a Unix
socket that answers every connection with a snapshot of this process's threads. A Python thread
gets its turn while the main thread is blocked in a collective (torch releases the interpreter
lock while it waits), sleeps, or loops in Python; only C code that keeps the lock can silence it.

Launcher side: ``collect`` asks every rank at once and waits a fraction of a second in all, so a
stop stays as fast as before; ``hang.py`` turns the answers into words. The socket paths live in
one temporary folder per launch (``STACKS_VAR``), which the launcher removes at the end.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ..env import STACKS_VAR

#: What this process is blocked in right now, if it said so (``waiting_in``); read by the
#: stack reporter, never by training code.
waiting: str | None = None

#: The pid whose listener runs: one per process, and a forked child (a DataLoader worker)
#: inherits the value but not the thread, so the pid tells them apart.
_listening: int | None = None

COLLECT_SECONDS = 0.3  # every rank's answer, in parallel; a stop waits no longer for them


def waiting_in(label: str | None) -> None:
    """Say that this process now waits in ``label`` (e.g. "DDP's gradient all_reduce"), or
    that it no longer waits (``None``)."""
    global waiting
    waiting = label


# -- what crosses: plain data ---------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str


@dataclass(frozen=True)
class ThreadStack:
    name: str
    main: bool
    frames: tuple[Frame, ...]  # outermost first, as a traceback lists them


@dataclass(frozen=True)
class RankStack:
    """One rank's answer: its threads (the listener's own left out) and what it waits in."""

    rank: int
    pid: int
    threads: tuple[ThreadStack, ...]
    waiting: str | None = None

    @property
    def main(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.main), None)

    def to_json(self) -> bytes:
        threads = [
            {
                "name": t.name,
                "main": t.main,
                "frames": [[f.filename, f.lineno, f.function] for f in t.frames],
            }
            for t in self.threads
        ]
        data = {"rank": self.rank, "pid": self.pid, "waiting": self.waiting, "threads": threads}
        return json.dumps(data).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RankStack:
        raw = json.loads(data)
        threads = tuple(
            ThreadStack(t["name"], t["main"], tuple(Frame(*f) for f in t["frames"]))
            for t in raw["threads"]
        )
        return cls(raw["rank"], raw["pid"], threads, raw["waiting"])


def snapshot(rank: int, skip: int | None = None) -> RankStack:
    """This process's threads now, except the thread ``skip`` (the listener asking)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        summary = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
        frames = tuple(Frame(f.filename, f.lineno or 0, f.name) for f in reversed(summary))
        threads.append(ThreadStack(names.get(ident, f"thread {ident}"), ident == main, frames))
    threads.sort(key=lambda t: not t.main)  # the main thread first
    return RankStack(rank, os.getpid(), tuple(threads), waiting)


# -- worker side: the listener --------------------------------------------------------------------
def socket_path(folder: str, rank: int) -> str:
    return os.path.join(folder, str(rank))


def listen_from_environ() -> None:
    """Start the listener if a launcher asked for one (``STACKS_VAR``); idempotent."""
    folder, rank = os.environ.get(STACKS_VAR), os.environ.get("RANK", "0")
    if folder and rank.isdigit():
        listen(socket_path(folder, int(rank)), int(rank))


def listen(path: str, rank: int) -> None:
    """Answer every connection on ``path`` with this process's stacks, from a daemon thread.

    Never raises: a rank that cannot listen (its folder is gone) trains on, unheard."""
    global _listening
    if _listening == os.getpid():
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):  # left by this rank's previous attempt (torchrun's restarts)
            os.unlink(path)
        sock.bind(path)
        sock.listen(16)
    except OSError:
        sock.close()
        return
    _listening = os.getpid()
    threading.Thread(target=_answer, args=(sock, rank), name="nbaccel-stacks", daemon=True).start()


def _answer(sock: socket.socket, rank: int) -> None:
    me = threading.get_ident()
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            try:
                conn.settimeout(1.0)
                conn.sendall(snapshot(rank, skip=me).to_json())
            except Exception:  # the launcher gave up waiting, or a frame was odd: ask again
                pass


# -- launcher side: ask every rank at once --------------------------------------------------------
def collect(paths: dict[int, str], timeout: float = COLLECT_SECONDS) -> dict[int, RankStack | None]:
    """Every rank's stacks, asked in parallel. ``None``: the rank took the call but did not
    answer within ``timeout`` seconds in all (busy in C code that holds the GIL); a rank left
    out: nobody listens at its path (its listener had not started, or it had exited)."""
    answers: dict[int, RankStack | None] = {}
    selector = selectors.DefaultSelector()
    buffers: dict[int, bytearray] = {}
    try:
        for rank, path in paths.items():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(path)  # a Unix socket connects at once, or not at all
            except OSError:
                sock.close()
                continue
            selector.register(sock, selectors.EVENT_READ, rank)
            answers[rank], buffers[rank] = None, bytearray()
        deadline = time.monotonic() + timeout
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                rank, sock = key.data, key.fileobj
                try:
                    chunk = sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    buffers[rank] += chunk
                    continue
                selector.unregister(sock)
                sock.close()
                try:
                    answers[rank] = RankStack.from_json(bytes(buffers[rank]))
                except (ValueError, KeyError, TypeError):
                    pass  # it was stopped mid-answer
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()
    return answers
