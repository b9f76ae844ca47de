"""What the integrations for loops that are not nbaccel's share (``tracker`` for Hugging
Face Accelerate, ``callback`` for transformers' Trainer): one ``Recorder`` per process, the
numbers out of what those libraries log, and the notes of what their hooks cannot time apart.

The recorder sends to the launching notebook through the same channel and records as nbaccel's
own Accelerator (``rank_recorder``); with no launcher listening, rank 0 draws it itself.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any

from ..channel import UNMEASURED
from ..rank_recorder import Recorder

_current: list[Recorder] = []  # this process's recorder for a loop that is not nbaccel's


def recorder(device: Any = None) -> Recorder:
    """This process's recorder, made on first use (again after ``close``); ``device`` names
    its device if the first use did not (a ``log`` before the watch)."""
    if not _current:
        _current.append(Recorder(device=device))
    else:
        _current[0].on_device(device)
    return _current[0]


def current() -> Recorder | None:
    return _current[0] if _current else None


def close() -> None:
    """Send the last numbers and draw the final view; the next ``recorder()`` is a new one."""
    if _current:
        _current.pop().close()


def numbers(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers in what a library logs (ints, floats, one-element tensors and numpy scalars;
    nested dicts as ``outer/inner``): the rest (text, images) is not drawn."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(numbers(value, f"{name}/"))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int | float):
            out[name] = float(value)
        elif hasattr(value, "item") and _elements(value) == 1:
            out[name] = float(value.item())  # a one-element tensor or numpy array, a numpy scalar
    return out


def _elements(value: Any) -> int | None:
    if hasattr(value, "numel"):
        return value.numel()  # torch
    size = getattr(value, "size", None)
    return size if isinstance(size, int) else None  # numpy


def unmeasured(recorder: Recorder, *parts: str) -> None:
    """Say once that this rank's breakdown cannot time ``parts`` apart (``Run.unmeasured``)."""
    recorder.channel.add(0, {UNMEASURED + part: 1.0 for part in parts})


#: What draws a loop written for another library, said when a launch of it recorded nothing.
INTEGRATIONS = {
    "transformers": "transformers' Trainer: Trainer(..., callbacks=[nbaccel.LiveCallback()])",
    "accelerate": "HF Accelerate: Accelerator(log_with=nbaccel.LiveTracker())",
}


def empty_hint(function: Any) -> str | None:
    """The line the live view shows when a launch of ``function`` recorded nothing, where the
    function uses transformers or HF Accelerate (a name it reads, or imports, comes from them)."""
    used = [lib for lib in INTEGRATIONS if lib in _libraries(function)]
    if not used:
        return None
    ways = "; ".join(INTEGRATIONS[lib] for lib in used)
    return f"live panel: this launch recorded nothing. To draw {ways}"


def _libraries(function: Any, seen: set[int] | None = None) -> set[str]:
    """The top-level packages of what ``function``'s code names (its globals, its imports,
    nested functions', and those of the notebook's functions it calls)."""
    code = getattr(function, "__code__", None)
    seen = set() if seen is None else seen
    if code is None or id(code) in seen:
        return set()
    seen.add(id(code))
    names = {name for c in _codes(code) for name in c.co_names}
    found = set()
    scope = getattr(function, "__globals__", {})
    for name in names:
        value = scope.get(name)
        if isinstance(value, types.FunctionType) and value.__module__ == function.__module__:
            found |= _libraries(value, seen)  # a helper of the same notebook or module
            continue
        module = value.__name__ if isinstance(value, types.ModuleType) else None
        module = module or getattr(value, "__module__", None) or name
        found.add(str(module).split(".")[0])
    return found


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)
