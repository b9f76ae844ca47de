"""The launch protocol: every message between the launcher, the fork server and the workers.

Both ends import this module, so each message is one frozen dataclass, defined once. Three kinds
of Unix socket carry them, all created by the launcher:

* the control socket, launcher <-> fork server: ``Start`` carries one ``WorkerSpec`` per
  worker, and each worker's ``FDS_PER_WORKER`` file descriptors (stdout and stderr pipes,
  message socket, metrics socket) follow it as passed descriptors, in a one-byte message of
  their own per worker: Linux passes at most 253 in one message (``SCM_MAX_FD``), and a receiver
  that reads a known number per worker can tell a short set. The server answers ``Started``
  with the pids, then ``Exited`` for each worker; or ``Refused`` when a worker's descriptors did
  not all arrive (its open-file limit), having started nothing. ``Signal`` asks the server to
  signal a launch's live workers: the server is their parent and reaps them itself, so it never
  signals a pid that was reused. Framing: a 4-byte length, then the pickle (``send``/``recv``).
* each worker's message socket: the call in (``pack_call``: the function travels by value),
  then ``Result`` or ``Failure`` out (``encode``/``decode``, one message per frame).
* each worker's metrics socket: datagrams of ``Accelerator.log`` records (``observe/channel.py``).

A worker's exception crosses as ``ExceptionData``: this is the one place that turns an exception
into plain data (``ExceptionData.of``) and back into the text Python prints (``format``).
"""

from __future__ import annotations

import collections
import io
import linecache
import os
import pickle
import socket
import struct
import traceback
import types
from dataclasses import dataclass
from typing import Any, ClassVar

FDS_PER_WORKER = 4  # stdout, stderr, message socket, metrics socket
_HEADER = struct.Struct("!I")


# -- the messages --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    """How to set up one worker before it runs the function."""

    env: dict[str, str]  # its whole environment: torchrun's variables and the launch's
    cwd: str
    sys_path: list[str]
    threads: int  # torch.set_num_threads
    local_rank: int
    session: bool = False  # a ranks session's rank: it serves cells (``cells.py``), no function


@dataclass(frozen=True)
class Start:
    """Launcher -> server: fork these workers (their descriptors travel with the message)."""

    launch: int
    workers: tuple[WorkerSpec, ...]


@dataclass(frozen=True)
class Signal:
    """Launcher -> server: send ``signal`` to every live worker of ``launch``: to each one's
    process group (its DataLoader workers too), or with ``group=False`` to the workers alone,
    and then the server answers ``Signalled`` (the signal is pending in each by then)."""

    launch: int
    signal: int
    group: bool = True


@dataclass(frozen=True)
class Signalled:
    """Server -> launcher: the ``Signal`` with ``group=False`` for ``launch`` was sent."""

    launch: int


@dataclass(frozen=True)
class Started:
    """Server -> launcher: the workers of ``launch`` run, in the order of ``Start.workers``."""

    launch: int
    pids: tuple[int, ...]


@dataclass(frozen=True)
class Refused:
    """Server -> launcher: nothing of ``launch`` was started; ``reason`` says why and the fix."""

    launch: int
    reason: str


@dataclass(frozen=True)
class Exited:
    """Server -> launcher: a worker was reaped; a negative ``code`` is the signal that ended it."""

    pid: int
    code: int


@dataclass(frozen=True)
class ExceptionData:
    """An exception as plain data, its chain included: a worker's error, in the launcher."""

    type: str  # the class's qualified name
    module: str
    message: str
    frames: tuple[tuple[str, int | None, str, str | None], ...] = ()  # file, line, function, text
    cause: ExceptionData | None = None  # raise ... from cause
    context: ExceptionData | None = None  # raised while handling context

    @classmethod
    def of(cls, err: BaseException, hide: str | None = None) -> ExceptionData:
        """Describe ``err``; leading frames from the file ``hide`` (the worker's own runner)
        are dropped, since they are noise to the user."""

        def one(exc: BaseException | None, seen: set[int]) -> ExceptionData | None:
            if exc is None or id(exc) in seen:
                return None
            seen.add(id(exc))
            return cls(
                type(exc).__qualname__,
                str(type(exc).__module__),
                _text(exc),
                tuple(
                    (f.filename, f.lineno, f.name, f.line)
                    for f in traceback.extract_tb(exc.__traceback__)
                ),
                one(exc.__cause__, seen),
                None if exc.__suppress_context__ else one(exc.__context__, seen),
            )

        data = one(err, set())
        frames = data.frames
        while frames and frames[0][0] == hide:
            frames = frames[1:]
        return cls(data.type, data.module, data.message, frames, data.cause, data.context)

    def format(self) -> str:
        """The traceback as Python prints it, with source lines filled in on this side.

        Functions defined in notebook cells have their source in the kernel's line cache, not
        in the worker's, so the lines are looked up here.
        """
        parts = []
        if self.cause is not None:
            parts += [
                self.cause.format(),
                "\nThe above exception was the direct cause of the following exception:\n\n",
            ]
        elif self.context is not None:
            parts += [
                self.context.format(),
                "\nDuring handling of the above exception, another exception occurred:\n\n",
            ]
        frames = [
            (filename, lineno, name, line or linecache.getline(filename, lineno or 0).strip())
            for filename, lineno, name, line in self.frames
        ]
        name = (
            self.type if self.module in ("builtins", "__main__") else f"{self.module}.{self.type}"
        )
        parts.append("Traceback (most recent call last):\n")
        parts += traceback.StackSummary.from_list(frames).format()
        parts.append(f"{name}: {self.message}\n" if self.message else f"{name}\n")
        return "".join(parts)


def _text(exc: BaseException) -> str:
    """``str(exc)``, whatever the class does: a ``__str__`` that raises or returns a non-string
    falls back to ``repr``, then to ``<unprintable X>``. Always a plain ``str``, so the
    message unpickles where the exception's class does not exist."""
    for show in (str, repr):
        try:
            text = show(exc)
        except Exception:
            continue
        if isinstance(text, str):
            return str.__str__(text)  # a str subclass from the worker would not unpickle here
    return f"<unprintable {type(exc).__name__}>"


def type_name(value: Any) -> str:
    """``value``'s class as ``module.qualname`` (``builtins`` left out), read in the worker:
    the launcher names a value it cannot unpickle without unpickling it."""
    cls = type(value)
    module = str(getattr(cls, "__module__", "") or "")
    qualname = str(getattr(cls, "__qualname__", cls.__name__))
    return qualname if module in ("", "builtins") else f"{module}.{qualname}"


def returned(value: Any) -> Result:
    """The function's ``value`` as a worker sends it back: its tensors on the CPU (the notebook
    may have no GPU), cloudpickled; a value that cannot be pickled raises TypeError with what
    to return instead."""
    import cloudpickle

    from ..errors import RETURN_INSTEAD
    from ..tensors import to_cpu

    try:
        payload = cloudpickle.dumps(to_cpu(value))
    except Exception as err:
        raise TypeError(
            f"the function returned a {type_name(value)} that cannot be sent back to the "
            f"notebook ({err}); {RETURN_INSTEAD}"
        ) from err
    return Result(payload, type_name(value))


def is_collective_failure(err: BaseException, text: str) -> bool:
    """An error a rank gets when *another* rank died in a collective? (``text``: its message)"""
    import torch.distributed as dist

    backend_errors = tuple(
        getattr(dist, name)
        for name in ("DistBackendError", "DistNetworkError")
        if hasattr(dist, name)
    )
    text = text.lower()
    hints = ("connection closed by peer", "connection reset", "broken pipe", "socket", "gloo")
    return isinstance(err, backend_errors) or (
        isinstance(err, RuntimeError) and any(h in text for h in hints)
    )


@dataclass(frozen=True)
class Result:
    """Worker -> launcher: the function returned; ``value`` is its cloudpickle and ``type``
    its class's name (``type_name``), so a value that cannot be unpickled here is still named.
    ``exited``: it left through ``sys.exit(0)`` (or ``None``) instead of returning."""

    value: bytes
    type: str = ""
    exited: bool = False


@dataclass(frozen=True)
class Failure:
    """Worker -> launcher: the function raised. ``collective``: the error is the kind a rank
    gets when *another* rank died mid-collective, so it is probably not the root cause."""

    exception: ExceptionData
    collective: bool = False
    exit_code: int | None = None  # a SystemExit's: the worker may be stopped before it exits


# -- a ranks session: the kernel and each rank, on the rank's message socket ---------------------
@dataclass(frozen=True)
class Cell:
    """Kernel -> rank: run ``source`` (compiled as ``filename``); or ``push`` these names into
    its namespace; or ``pull`` a name's value. Its ``Done`` echoes ``number``."""

    number: int
    source: str = ""
    filename: str = "<ranks cell>"
    push: bytes | None = None
    pull: str | None = None


@dataclass(frozen=True)
class Display:
    """Rank -> kernel: rich output (a figure, ``display(x)``) as a MIME bundle, text values."""

    data: dict[str, str]


@dataclass(frozen=True)
class Done:
    """Rank -> kernel: request ``number`` finished: ``failure`` if it raised (``interrupted``:
    by the stop button), ``value`` for a pull. Number 0 is the rank's start: its group joined."""

    number: int
    failure: Failure | None = None
    value: Result | None = None
    interrupted: bool = False


_LAUNCH = (Start, Signal, Signalled, Started, Refused, Exited, Result, Failure)
MESSAGES = (*_LAUNCH, Cell, Display, Done)  # and a ranks session's
Message = Start | Signal | Signalled | Started | Refused | Exited | Result | Failure
Message = Message | Cell | Display | Done  # a ranks session's


# -- framing -------------------------------------------------------------------------------------
def encode(message: Message) -> bytes:
    if not isinstance(message, MESSAGES):
        raise TypeError(f"{message!r} is not a message of nbaccel's launch protocol")
    return pickle.dumps(message)


def decode(data: bytes) -> Message:
    message = pickle.loads(data)
    if not isinstance(message, MESSAGES):
        raise TypeError(f"received {type(message).__name__}, not a launch protocol message")
    return message


class MissingDescriptors(Exception):
    """A ``Start``'s descriptors did not all arrive: the receiver could not take them all (its
    open-file limit, most often). Those that did are closed, and the stream is in step: the next
    ``recv`` reads the next message."""

    def __init__(self, start: Start, received: int) -> None:
        self.start, self.received = start, received
        self.expected = FDS_PER_WORKER * len(start.workers)
        super().__init__(
            f"received {received} of the {self.expected} file descriptors for "
            f"{len(start.workers)} workers"
        )


def send(sock: socket.socket, message: Message, fds: list[int] | None = None) -> None:
    """One message on the control socket; a ``Start``'s descriptors ``fds`` follow it,
    ``FDS_PER_WORKER`` to a one-byte message."""
    fds = fds or []
    expected = FDS_PER_WORKER * len(message.workers) if isinstance(message, Start) else 0
    if len(fds) != expected:  # the receiver would wait for the missing ones, or misread the rest
        raise ValueError(
            f"this {type(message).__name__} sends {expected} descriptors ({FDS_PER_WORKER} per "
            f"worker of a Start, none with other messages), not {len(fds)}"
        )
    data = encode(message)
    sock.sendall(_HEADER.pack(len(data)) + data)
    for i in range(0, len(fds), FDS_PER_WORKER):
        socket.send_fds(sock, [b"\0"], fds[i : i + FDS_PER_WORKER])


def recv(sock: socket.socket) -> tuple[Message, list[int]]:
    """One message, and for a ``Start`` its workers' descriptors, all of them: a short set
    raises ``MissingDescriptors``. Raises EOFError when the peer is gone."""
    (size,) = _HEADER.unpack(_read(sock, _HEADER.size))
    message = decode(_read(sock, size))
    if not isinstance(message, Start):
        return message, []
    fds, short = [], False
    for _ in message.workers:  # every worker's message is read, whatever arrives: in step
        data, got, flags, _ = socket.recv_fds(sock, 1, FDS_PER_WORKER)
        if not data:
            _close(fds + got)
            raise EOFError("the peer closed the control socket")
        fds += got
        short = short or len(got) != FDS_PER_WORKER or bool(flags & socket.MSG_CTRUNC)
    if short:
        _close(fds)
        raise MissingDescriptors(message, len(fds))
    return message, fds


def _read(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes: never into the next message, whose descriptors would be lost."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the control socket")
        data += chunk
    return bytes(data)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- the call: the function, by value ------------------------------------------------------------
def pack_call(function: Any, args: tuple, kwargs: dict[str, Any]) -> bytes:
    """``(function, args, kwargs)`` by value (cloudpickle), so notebook functions travel."""
    import cloudpickle

    def code_with_filename(code: types.CodeType):
        # cloudpickle replaces the file name of code it sends by value with "<dynamic-code>";
        # keeping the real one lets a worker's traceback point at the notebook cell.
        rebuild, fields = cloudpickle.cloudpickle._code_reduce(code)
        return rebuild, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)

    class Pickler(cloudpickle.Pickler):
        dispatch_table: ClassVar = collections.ChainMap(
            {types.CodeType: code_with_filename}, cloudpickle.Pickler.dispatch_table
        )

    buffer = io.BytesIO()
    try:
        Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((function, tuple(args), kwargs))
        return buffer.getvalue()
    except Exception as err:
        raise TypeError(
            f"cannot send {getattr(function, '__name__', function)!r} and its arguments to the "
            f"workers: {err}. Create unpicklable objects (open files, locks, CUDA tensors) "
            "inside the function instead of passing them in."
        ) from err


def unpack_call(data: bytes) -> tuple[Any, tuple, dict[str, Any]]:
    import cloudpickle

    return cloudpickle.loads(data)
