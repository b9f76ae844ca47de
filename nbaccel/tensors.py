"""Walk nested batches: apply a function to every tensor inside tuples, lists, dicts and named
tuples, keeping the structure. Moving a batch to a device, copying it to the CPU and every
collective on a nested structure are built on ``map_tensors``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any], lists: bool = False) -> Any:
    """Apply ``fn`` to every tensor inside tuples, lists, dicts and named tuples, keeping the
    structure; with ``lists``, also to lists that hold no tensor (Python objects per sample)."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    kind = type(data)
    if kind is tuple or kind is list:  # the common batch, checked before the ABCs (slower)
        if not lists or kind is tuple or has_tensor(data):
            return kind([map_tensors(v, fn, lists) for v in data])
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: map_tensors(v, fn, lists) for k, v in data.items()})
    if lists and isinstance(data, list) and not has_tensor(data):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # named tuple
        return type(data)(*(map_tensors(v, fn, lists) for v in data))
    if isinstance(data, list | tuple):
        return type(data)(map_tensors(v, fn, lists) for v in data)
    return data


def has_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return any(has_tensor(v) for v in data.values())
    if isinstance(data, list | tuple):
        return any(has_tensor(v) for v in data)
    return False


def send_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor inside tuples, lists, dicts and named tuples to ``device``. A tensor
    already there is kept as it is, as ``to`` would keep it, without calling ``to``: the
    prepared DataLoader's batches on the CPU cost no operator call (an ``aten::to`` in every
    profile of a step). The common batch, a tuple or list of tensors all already there (a CPU
    run's), is returned as it is, without walking it a second time."""
    kind = type(obj)
    if kind is tuple or kind is list:
        for t in obj:
            if type(t) is not torch.Tensor or t.device != device:
                break
        else:
            return obj
    return map_tensors(
        obj, lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking)
    )


def to_cpu(obj: Any) -> Any:
    """Detached CPU copies of every tensor inside: plain data that can leave the process."""
    return map_tensors(obj, lambda t: t.detach().cpu())


def samples_in(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if it has none)."""
    while True:
        if isinstance(batch, torch.Tensor):
            return batch.shape[0] if batch.dim() else 1
        if isinstance(batch, list | tuple) and batch:  # before the Mapping ABC (slower)
            batch = batch[0]
        elif isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        else:
            return 0
