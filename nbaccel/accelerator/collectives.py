"""Collectives on tensors and objects: gather, reduce, pad, broadcast, across every rank.

Each function works on torch's default process group: the one an ``Accelerator`` or a
``PartialState`` joined (or any other). Without one, or with a single process, a function
returns its input as it is. Tensors may sit inside lists, tuples, dicts and named tuples.
``nbaccel.utils`` re-exports them under Accelerate's names (``from accelerate.utils import
gather`` becomes ``from nbaccel.utils import gather``), and the ``Accelerator``'s methods of the
same names call them.

Shapes are checked. Gathering tensors of different shapes is undefined in torch (gloo returns
garbage or aborts the process). ``gather`` and ``pad_across_processes`` first exchange each
tensor's shape and dtype in one small collective: ``_DIMS + 2`` integers from every rank. When
the ranks disagree, every rank raises the same ``ValueError``, which names each rank's shape.
The cost, measured beside the unchecked gather, is in ``benchmarks/results/collectives-cpu.md``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..tensors import has_tensor, map_tensors

__all__ = [
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
_DIMS = 8  # dimensions compared one by one; the rest are compared by their product


def world_size() -> int:
    """Processes in the default group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# -- shapes ----------------------------------------------------------------------------------
def _shapes(tensor: torch.Tensor) -> list[tuple[tuple[int, ...], str]]:
    """Every rank's (shape, dtype) of ``tensor``, in rank order: one small all_gather."""
    dims = list(tensor.shape)
    if len(dims) > _DIMS:  # keep the message fixed-size: fold the trailing dimensions
        dims = [*dims[: _DIMS - 1], math.prod(dims[_DIMS - 1 :])]
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    row = [tensor.dim(), code, *dims, *[-1] * (_DIMS - len(dims))]
    mine = torch.tensor(row, dtype=torch.int64, device=tensor.device)
    rows = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(rows, mine)
    out = []
    for r in torch.stack(rows).tolist():
        ndim, code, dims = r[0], r[1], r[2 : 2 + min(r[0], _DIMS)]
        dtype = str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "other"
        out.append((tuple(dims) if ndim <= _DIMS else (*dims[:-1], "..."), dtype))
    return out


_DTYPES = [
    *(torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64),
    *(torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool),
]


def _describe(shapes: list[tuple[tuple[int, ...], str]]) -> str:
    return ", ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(shapes))


# -- collectives -----------------------------------------------------------------------------
def gather(tensor: Any) -> Any:
    """Concatenate each tensor across ranks along dim 0, in rank order (0-d tensors stack).

    Every rank must pass the same shape and dtype; otherwise every rank raises a
    ``ValueError`` naming each rank's shape (pad first with ``pad_across_processes``).
    """
    if world_size() == 1:
        return tensor
    return map_tensors(tensor, _gather_one)


def _gather_one(tensor: torch.Tensor, check: bool = True) -> torch.Tensor:
    tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor[None]
    if check:
        shapes = _shapes(tensor)
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                f"gather needs the same shape and dtype on every rank, got {_describe(shapes)}. "
                "Pad first, e.g. gather(pad_across_processes(t, dim=0)), or use gather_object "
                "for Python values."
            )
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
    """Overwrite each tensor with ``from_process``'s, in place; returns the same structure."""
    if world_size() > 1:
        map_tensors(tensor, lambda t: dist.broadcast(t, src=from_process))
    return tensor


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Overwrite the list's items with ``from_process``'s (picklable objects), in place."""
    if world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(tensor: Any, reduction: Reduction = "mean", scale: float = 1.0) -> Any:
    """Sum, average, max or min each tensor across ranks; every rank gets a new tensor.

    ``scale`` is accepted only as 1.0: Accelerate applies it on TPUs alone, so a script that
    relies on it elsewhere would already be wrong.
    """
    if reduction not in _OPS:
        raise ValueError(f"reduction={reduction!r} must be one of {sorted(_OPS)}")
    if scale != 1.0:
        raise ValueError(
            f"reduce(scale={scale}): Accelerate applies scale only on TPUs (XLA), nbaccel "
            "never; multiply the result yourself: reduce(t) * scale."
        )
    world = world_size()

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if world > 1:
            dist.all_reduce(t, _OPS[reduction])
        return t / world if reduction == "mean" else t

    return map_tensors(tensor, one)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor along ``dim`` to the largest size on any rank, so it can be gathered.

    Every rank must pass tensors with the same number of dimensions (else a ``ValueError``
    naming each rank's shape, on every rank); ``pad_first`` puts the padding in front.
    """
    if world_size() == 1:
        return tensor

    def one(t: torch.Tensor) -> torch.Tensor:
        shapes = _shapes(t)
        if any(len(s) != t.dim() for s, _ in shapes) or not -t.dim() <= dim < t.dim():
            raise ValueError(
                f"pad_across_processes(dim={dim}) needs tensors with the same number of "
                f"dimensions on every rank, and dim among them; got {_describe(shapes)}."
            )
        d = dim % t.dim()
        longest = max(s[d] for s, _ in shapes)
        if longest == t.shape[d]:
            return t
        size = list(t.shape)
        size[d] = longest
        out = t.new_full(size, pad_index)
        start = longest - t.shape[d] if pad_first else 0
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
