"""One rank of a ranks session (``session.py``): join the process group once, then run cells.

The fork server starts it as it starts a launch's worker (``forkserver.run_worker``: the same
environment, stack listener and output pipes), but instead of one function it serves requests on
its message socket until the kernel lets go (EOF): a cell's source, names to put into its
namespace (push), a name to send back (pull). Each request ends with one ``Done``, which
carries the cell's error as data (``ExceptionData``) if it raised; the rank itself carries on
with its state.

The namespace is a module of its own, installed as ``__main__`` (so classes and dataclasses
defined in cells work and travel by value), holding ``rank``, ``world_size``, ``local_rank``,
``torch``, ``dist`` (``torch.distributed``) and ``display``. A cell whose last statement is an
expression prints that value's ``repr``, as a notebook shows it; the relay labels it.

The stop button reaches a rank as SIGINT (the kernel sends it to the ranks that are running
the cell, never to their process groups). It raises KeyboardInterrupt only while a cell runs:
a rank between cells, or sending its report, ignores it, so a late signal cannot cut a message
in half or interrupt the next cell. A rank blocked in a collective that its peers never joined
does not return to Python until the collective ends; the kernel then reports where it is.

Figures: matplotlib draws through ``figures.py`` here (``MPLBACKEND``), which hands
``plt.show()``'s figures to ``send_figures``; what a cell leaves open is sent when it ends, and
closed, as the inline backend does in a kernel.
"""

from __future__ import annotations

import ast
import base64
import builtins
import io
import signal
import sys
import threading
import types
from multiprocessing.connection import Connection
from typing import Any

from .protocol import (
    Cell,
    Display,
    Done,
    ExceptionData,
    Failure,
    decode,
    encode,
    is_collective_failure,
    returned,
)

BACKEND = "module://nbaccel.launch.figures"

# Process-wide on purpose: this process is one rank of one session, and what needs these has
# no other way to them: ``display()``, called from the user's cells (or threads they start),
# and the SIGINT handler, which Python calls with no argument of ours.
_messages: Connection | None = None  # the rank's message socket, once serve_cells has it
_lock = threading.Lock()  # display() from a thread the cell started: one message at a time
_running = False  # a cell's own code runs: only then does SIGINT raise KeyboardInterrupt


def serve_cells(messages: Connection) -> int:
    """Join the group, say so (``Done(0)``), then serve until EOF; the exit code."""
    global _messages
    _messages = messages
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        namespace = _start()
    except BaseException as err:
        _send(Done(0, _failure(err)))
        return 1
    _send(Done(0))
    while True:
        try:
            message = decode(messages.recv_bytes())
        except (EOFError, OSError):
            break
        if isinstance(message, Cell):
            _send(_serve(message, namespace))
    _leave()
    return 0


def _start() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..config import LaunchConfig
    from ..env import DistEnv, backend_for, choose_device

    if "matplotlib" in sys.modules:  # loaded before MPLBACKEND was read: say it here too
        sys.modules["matplotlib"].rcParams["backend"] = BACKEND
    env = DistEnv.from_environ()
    device = choose_device(env.local_rank, cpu=bool(LaunchConfig.from_environ().cpu))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), rank=env.rank, world_size=env.world_size)
    main = types.ModuleType("__main__", "A ranks session's namespace on this rank.")
    main.__dict__.update(
        __builtins__=builtins,
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        torch=torch,
        dist=dist,
        display=display,
    )
    sys.modules["__main__"] = main
    return main.__dict__


def _serve(message: Cell, namespace: dict[str, Any]) -> Done:
    """One request, as a ``Done``; a KeyboardInterrupt anywhere in it is the stop button."""
    global _running
    try:
        try:
            if message.push is not None:
                import cloudpickle

                _, _, values = cloudpickle.loads(message.push)  # session.push's pack_call
                namespace.update(values)
                return Done(message.number)
            if message.pull is not None:
                if message.pull not in namespace:
                    raise NameError(f"name {message.pull!r} is not defined on this rank")
                return Done(message.number, value=returned(namespace[message.pull]))
            body, last = _compile(message.source, message.filename)
            _running = True
            exec(body, namespace)
            if last is not None:
                value = eval(last, namespace)
                if value is not None:
                    print(repr(value))
        finally:
            _running = False
        _finish_cell()
        return Done(message.number)
    except BaseException as err:  # the cell's error, as data; the rank goes on
        try:
            _finish_cell()
        except BaseException:
            pass
        return Done(message.number, _failure(err), interrupted=isinstance(err, KeyboardInterrupt))


def _compile(source: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
    """The cell's statements, and its last one apart when it is an expression (to show)."""
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return compile(tree, filename, "exec"), last


def _finish_cell() -> None:
    """What ends every cell: its figures sent, its records and output on their way."""
    from ..observe.channel import flush_all

    if "matplotlib.pyplot" in sys.modules:
        send_figures()
    flush_all()  # an Accelerator's numbers so far, before the Done: the panel shows them
    sys.stdout.flush()
    sys.stderr.flush()


def _failure(err: BaseException) -> Failure:
    try:
        data = ExceptionData.of(err, hide=__file__)
        frames = tuple(f for f in data.frames if f[0] != __file__)  # the SIGINT handler's too
        data = ExceptionData(data.type, data.module, data.message, frames, data.cause, data.context)
    except Exception:
        data = ExceptionData(type(err).__qualname__, str(type(err).__module__), "")
    return Failure(data, is_collective_failure(err, data.message))


def _on_interrupt(signum, frame) -> None:
    if _running:
        raise KeyboardInterrupt


def _send(message: Done | Display) -> None:
    if _messages is None:
        raise RuntimeError("display() works in a cell of a ranks session (%%ranks)")
    data = encode(message)
    with _lock:
        _messages.send_bytes(data)


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


# -- rich output -----------------------------------------------------------------------------------
def display(*objects: Any) -> None:
    """Show ``objects`` in the notebook's cell as a kernel would: a figure as PNG, an object
    with ``_repr_png_``, ``_repr_html_`` or ``_repr_markdown_`` as those, else its ``repr``."""
    sys.stdout.flush()  # what the cell printed before comes first
    for obj in objects:
        _send(Display(bundle(obj)))


def bundle(obj: Any) -> dict[str, str]:
    """``obj``'s MIME bundle: binary formats base64-encoded, as Jupyter sends them."""
    if type(obj).__module__.startswith("matplotlib.figure"):
        return _figure(obj)
    data = {"text/plain": repr(obj)}
    for method, mime in (
        ("_repr_png_", "image/png"),
        ("_repr_html_", "text/html"),
        ("_repr_markdown_", "text/markdown"),
        ("_repr_svg_", "image/svg+xml"),
    ):
        try:
            made = getattr(obj, method, lambda: None)()
        except Exception:
            continue
        if isinstance(made, bytes):
            data[mime] = base64.b64encode(made).decode()
        elif isinstance(made, str):
            data[mime] = made
    return data


def _figure(figure: Any) -> dict[str, str]:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return {"image/png": base64.b64encode(buffer.getvalue()).decode(), "text/plain": repr(figure)}


def send_figures() -> None:
    """Send every open figure, then close them all (``plt.show()`` here, and each cell's end)."""
    import matplotlib.pyplot as plt

    numbers = plt.get_fignums()
    if not numbers:
        return
    sys.stdout.flush()
    for number in numbers:
        _send(Display(_figure(plt.figure(number))))
    plt.close("all")
