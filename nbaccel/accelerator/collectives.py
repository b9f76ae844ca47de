"""Collectives on tensors and objects: gather, reduce, pad, broadcast, across every rank.

Each function works on torch's default process group: the one an ``Accelerator`` or a
``PartialState`` joined (or any other). Without one, or with a single process, a function
returns its input as it is. Tensors may sit inside lists, tuples, dicts and named tuples.
``nbaccel.utils`` re-exports them under Accelerate's names (``from accelerate.utils import
gather`` becomes ``from nbaccel.utils import gather``), and the ``Accelerator``'s methods of the
same names call them.

Shapes are checked, always. Handing a collective tensors of different shapes is undefined in
torch, and gloo shows every kind of undefined: ``broadcast`` returns garbage without a word,
``gather`` returns garbage or aborts, and ``reduce`` kills the process with SIGABRT ("data size
doesn't match"). So ``gather``, ``reduce``, ``broadcast`` and ``pad_across_processes`` first
compare what each rank passed: the collective's name and, for every tensor in the structure,
its place, shape and dtype, hashed into one number. That is one all_gather of ``1 + _SLOTS``
int64 per rank and per call, however many tensors the structure holds. When the ranks disagree,
every rank raises the same ``DistributedOperationException`` (also a ``ValueError``), which says
which ranks passed which shapes, before any data moves, so the process group stays usable.
Accelerate makes this check only in its debug mode; nbaccel makes it on every call, because the
alternative is a dead or silently wrong process and the price is one small collective
(measured in ``benchmarks/results/collective-checks-cpu.md``).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException
from ..tensors import has_tensor, map_tensors

__all__ = [
    "CannotPadNestedTensorWarning",
    "Reduction",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "world_size",
]

Reduction = Literal["sum", "mean", "max", "min"]
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_SLOTS = 8  # pad's sizes that travel with the check; a larger structure sends its own after it
_SHOWN = 4  # tensors named in an error; the rest are counted

# What each checked collective needs of the ranks, and how to give it that.
_NEEDS = {
    "gather": "the same shape and dtype on every rank",
    "reduce": "the same shape and dtype on every rank (it combines them element by element)",
    "broadcast": "the same shape and dtype on every rank (each rank's tensor is overwritten in "
    "place by from_process's)",
    "pad_across_processes": "tensors with the same number of dimensions on every rank (it pads "
    "one dimension only)",
}
_FIXES = {
    "gather": "Pad first, e.g. gather(pad_across_processes(t, dim=0)), cast to one dtype "
    "(t.float()), or use gather_object for Python values.",
    "reduce": "Reduce something of one shape on every rank (a sum, a mean, a count: "
    "reduce(t.sum())), cast to one dtype (t.float()), or keep every element with "
    "gather(pad_across_processes(t, dim=0)).",
    "broadcast": "Allocate the receiving tensors with from_process's shape and dtype (send the "
    "shape first: broadcast_object_list([t.shape]), then torch.empty(shape)), or send Python "
    "values with broadcast_object_list.",
    "pad_across_processes": "Give every rank's tensor the same number of dimensions first, "
    "e.g. t.reshape(len(t), -1) or t.unsqueeze(0).",
}


def world_size() -> int:
    """Processes in the default group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# -- the check: one small all_gather before the data moves ------------------------------------
def _check(op: str, data: Any, dim: int | None = None) -> list[int]:
    """Raise the same ``DistributedOperationException`` on every rank unless all of them called
    ``op`` with the same structure and, tensor by tensor, the same shape and dtype.

    ``pad_across_processes`` (``dim`` given) needs only the same numbers of dimensions, and
    gets back each tensor's largest size along ``dim`` on any rank, which it needs anyway.
    """
    leaves = _leaves(data)
    if dim is None:
        seen: list = [(place, _spec(t)) for place, t in leaves]
        sizes = []
    else:
        seen = [(place, t.dim()) for place, t in leaves]
        sizes = [t.shape[dim] if -t.dim() <= dim < t.dim() else -1 for _, t in leaves]
    # Python's hash() differs between processes; blake2b gives every rank the same number.
    digest = hashlib.blake2b(repr((op, seen)).encode(), digest_size=8).digest()
    row = [int.from_bytes(digest, "little", signed=True), *(sizes + [-1] * _SLOTS)[:_SLOTS]]
    device = leaves[0][1].device if leaves else _default_device()
    rows = _all_gather_ints(row, device)
    if any(r[0] != rows[0][0] for r in rows):
        raise DistributedOperationException(_mismatch(op, leaves, dim))
    if dim is None:
        return []
    if -1 in sizes:  # the numbers of dimensions agree, so every rank finds the same
        ndim = next(t.dim() for _, t in leaves if not -t.dim() <= dim < t.dim())
        raise DistributedOperationException(
            f"pad_across_processes(dim={dim}) got a tensor with {ndim} dimensions, where dim "
            f"must lie between {-ndim} and {ndim - 1}. Pass the dimension to pad, e.g. dim=0 "
            "for the batch."
        )
    if len(sizes) <= _SLOTS:
        per_rank = [r[1 : 1 + len(sizes)] for r in rows]
    else:  # the structures agree, so every rank sends as many sizes
        per_rank = _all_gather_ints(sizes, device)
    return [max(column) for column in zip(*per_rank, strict=True)]


def _leaves(data: Any, place: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``data`` with its place in it (``['x'][0]``), in ``map_tensors``'s order."""
    if isinstance(data, torch.Tensor):
        return [(place, data)]
    if isinstance(data, Mapping):
        items = [(f"{place}[{k!r}]", v) for k, v in data.items()]
    elif isinstance(data, tuple) and hasattr(data, "_fields"):  # named tuple
        items = [(f"{place}.{f}", v) for f, v in zip(data._fields, data, strict=True)]
    elif isinstance(data, list | tuple):
        items = [(f"{place}[{i}]", v) for i, v in enumerate(data)]
    else:
        return []
    return [leaf for p, v in items for leaf in _leaves(v, p)]


def _spec(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":  # NCCL moves only GPU tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows).tolist()


def _mismatch(op: str, leaves: list, dim: int | None) -> str:
    """The message every rank raises. Only a rank that knows every rank's shapes can name them,
    so this takes a second collective, on the error path alone (every rank is on it)."""
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, (op, [(p, list(t.shape), str(t.dtype)) for p, t in leaves]))
    ops = [o for o, _ in everyone]
    if len(set(ops)) > 1:
        return (
            f"the ranks called different collectives at the same point: {_by_rank(ops)}. Every "
            "rank must call the same collectives in the same order; a collective inside "
            "`if accelerator.is_main_process:` is the usual cause."
        )
    tensors = [{p: (shape, dtype) for p, shape, dtype in passed} for _, passed in everyone]
    places = list(dict.fromkeys(p for per_rank in tensors for p in per_rank))
    differ = []
    for place in places:
        at = [per_rank.get(place) for per_rank in tensors]
        compared = [len(a[0]) if a and dim is not None else a for a in at]
        if any(c != compared[0] for c in compared):
            shown = [f"{a[0]} {a[1].removeprefix('torch.')}" if a else "no tensor" for a in at]
            differ.append(f"{place + ': ' if place else ''}{_by_rank(shown)}")
    if not differ:  # the same tensors, in another order
        differ = [_by_rank([", ".join(per_rank) for per_rank in tensors])]
    more = f"; and {len(differ) - _SHOWN} more tensors" if len(differ) > _SHOWN else ""
    return f"{op} needs {_NEEDS[op]}, got {'; '.join(differ[:_SHOWN])}{more}. {_FIXES[op]}"


def _by_rank(values: list[str]) -> str:
    """``rank 0: a, ranks 1, 2: b``: the ranks that passed the same thing share one entry."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ", ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}" for v, r in ranks.items()
    )


# -- collectives -----------------------------------------------------------------------------
def gather(tensor: Any) -> Any:
    """Concatenate each tensor across ranks along dim 0, in rank order (0-d tensors stack).

    Every rank must pass the same structure, shapes and dtypes; otherwise every rank raises a
    ``DistributedOperationException`` naming each rank's shapes (pad first with
    ``pad_across_processes``).
    """
    if world_size() == 1:
        return tensor
    _check("gather", tensor)
    return map_tensors(tensor, lambda t: _gather_one(t, check=False))


def _gather_one(tensor: torch.Tensor, check: bool = True) -> torch.Tensor:
    if check:
        _check("gather", tensor)
    tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor[None]
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def gather_object(object: Any) -> list[Any]:
    """Concatenate each rank's list of picklable objects, in rank order (as Accelerate does:
    ``gather_object([x])`` gives ``[x_0, x_1, ...]``). One process: ``object`` as it is."""
    if world_size() == 1:
        return object
    if not isinstance(object, list | tuple):
        raise TypeError(
            f"gather_object concatenates a list from each rank; got a {type(object).__name__}. "
            "Wrap one value in a list: gather_object([value])."
        )
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, object)
    return [x for part in parts for x in part]


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Overwrite each tensor with ``from_process``'s, in place; returns the same structure.

    Every rank must pass the same structure, shapes and dtypes (else every rank raises a
    ``DistributedOperationException``): torch copies bytes into the tensors already there.
    """
    if world_size() > 1:
        _check("broadcast", tensor)
        _broadcast(tensor, from_process)
    return tensor


def _broadcast(tensor: Any, from_process: int) -> None:
    map_tensors(tensor, lambda t: dist.broadcast(t, src=from_process))


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Overwrite the list's items with ``from_process``'s (picklable objects), in place."""
    if world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(tensor: Any, reduction: Reduction = "mean", scale: float = 1.0) -> Any:
    """Sum, average, max or min each tensor across ranks; every rank gets a new tensor.

    Every rank must pass the same structure, shapes and dtypes (else every rank raises a
    ``DistributedOperationException``). ``scale`` is accepted only as 1.0: Accelerate applies
    it on TPUs alone, so a script that relies on it elsewhere would already be wrong.
    """
    if reduction not in _OPS:
        raise ValueError(f"reduction={reduction!r} must be one of {sorted(_OPS)}")
    if scale != 1.0:
        raise ValueError(
            f"reduce(scale={scale}): Accelerate applies scale only on TPUs (XLA), nbaccel "
            "never; multiply the result yourself: reduce(t) * scale."
        )
    if world_size() > 1:
        _check("reduce", tensor)
    return _reduce(tensor, reduction)


def _reduce(tensor: Any, reduction: Reduction) -> Any:
    world = world_size()

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if world > 1:
            dist.all_reduce(t, _OPS[reduction])
        return t / world if reduction == "mean" else t

    return map_tensors(tensor, one)


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested tensor (``torch.nested``), whose rows have sizes
    of their own, and left it as it is."""


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor along ``dim`` to the largest size on any rank, so it can be gathered.

    Every rank must pass the same structure, with the same number of dimensions per tensor, and
    ``dim`` must be one of them (else every rank raises a ``DistributedOperationException``
    naming each rank's shapes); ``pad_first`` puts the padding in front. A nested tensor
    (``torch.nested``) is left as it is, with a ``CannotPadNestedTensorWarning``.
    """
    nested = any(t.is_nested for _, t in _leaves(tensor))
    if nested:
        warnings.warn(
            "pad_across_processes cannot pad a nested tensor (its rows have sizes of their "
            "own) and leaves it as it is; pad its rows yourself, e.g. "
            "torch.nested.to_padded_tensor(t, pad_index), before padding across processes.",
            CannotPadNestedTensorWarning,
            stacklevel=2,
        )
    if world_size() == 1:
        return tensor
    # the ranks compare and pad the other tensors; the nested ones are left out of the check
    flat = map_tensors(tensor, lambda t: None if t.is_nested else t) if nested else tensor
    longest = iter(_check("pad_across_processes", flat, dim))

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.is_nested:
            return t
        d, size = dim % t.dim(), next(longest)
        if size == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = size
        out = t.new_full(shape, pad_index)
        start = size - t.shape[d] if pad_first else 0
        out.narrow(d, start, t.shape[d]).copy_(t)
        return out

    return map_tensors(tensor, one)


def gather_for_metrics(input_data: Any, loop: Any, use_gather_object: bool = False) -> Any:
    """``gather``, or ``gather_object`` for non-tensor data, minus the repeated samples that
    topped up the last global batch of the loop that ``loop`` (a ``data.LoopState``) follows."""
    if has_tensor(input_data) and not use_gather_object:
        gathered = gather(input_data)
    else:
        listed = input_data if isinstance(input_data, list | tuple) else [input_data]
        gathered = gather_object(listed)
    if loop.end_of_dataloader and loop.remainder is not None:
        gathered = map_tensors(gathered, lambda t: t[: loop.remainder], lists=True)
    return gathered
