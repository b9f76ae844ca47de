"""Dispatched batches (``dispatch_batches=True``): rank 0 reads the DataLoader, every rank gets
its slice. Accelerate's ``DataLoaderDispatcher``, batch for batch.

Why: some data can be read only once per step, or only cheaply in one place: a stream over the
network, a web-scale loader, an IterableDataset that every rank would otherwise read whole. Rank
0 reads a *global step* and sends it to every rank, which keeps its slice:

* Default: a global step is ``world_size`` consecutive batches of the loader, joined into one
  (so they must hold tensors whose shapes agree past the first dimension); rank ``r`` takes the
  ``r``-th slice of ``len(step) / world_size`` samples. For full batches, that is the ``r``-th
  batch, as without dispatch.
* ``split_batches=True``: a global step is one batch, cut into ``world_size`` slices.

The last step may be short. It is shared out evenly anyway: each rank gets ``len // world_size``
samples, and when that does not divide, one more, the step being topped up with the first
samples of the epoch (``remainder`` counts its real samples for ``gather_for_metrics``). With
``drop_last`` a step with fewer than ``world_size`` batches is dropped. ``even_batches`` has no
say here: every rank always gets a batch, so ``even_batches=False`` is refused (in Accelerate it
is silently ignored).

How: rank 0 reads one step ahead, so it knows which step is the last; it broadcasts the step's
shapes and dtypes (a small pickled object) and whether it is the last, then the tensors
themselves. Slicing happens after the broadcast, as in Accelerate, so every rank's memory holds
the whole step for a moment: a scatter would send less, but would not take ``slice_fn``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ...errors import NbaccelError
from ...tensors import map_tensors


@dataclass(frozen=True)
class TensorSpec:
    """What a rank needs to receive a tensor: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def slice_tensors(batch: Any, where: slice, process_index: int = 0, num_processes: int = 1) -> Any:
    """Every tensor of ``batch`` cut to ``where`` (first dimension); other leaves unchanged.
    The default ``slice_fn``; a custom one takes the same arguments (Accelerate's)."""
    return map_tensors(batch, lambda t: t[where])


class DispatchedDataLoader:
    """Iterates ``loader`` on rank 0 and yields this rank's slice of each global step.

    It stands where a sharded DataLoader stands inside ``PreparedDataLoader``: ``len``,
    ``batch_size`` (this rank's), ``remainder``, and the loader's own attributes
    (``dataset``, ``batch_sampler``, ``pin_memory``...) through to ``loader``.
    """

    def __init__(
        self,
        loader: DataLoader,
        rank: int,
        world_size: int,
        device: torch.device,
        *,
        split_batches: bool = False,
        slice_fn: Callable[..., Any] | None = None,
    ) -> None:
        self.loader, self.rank, self.world_size = loader, rank, world_size
        self.device = device  # where the broadcast happens: the process group's device
        self.split_batches = split_batches
        self.slice_fn = slice_tensors if slice_fn is None else slice_fn
        self.drop_last = loader.drop_last
        size = loader.batch_size
        self.batch_size = size // world_size if split_batches and size else size
        self.remainder: int | None = None

    def __len__(self) -> int:
        batches = len(self.loader)
        if self.split_batches:
            return batches
        steps, left = divmod(batches, self.world_size)
        return steps + int(bool(left) and not self.drop_last)

    def __getattr__(self, name: str) -> Any:  # dataset, batch_sampler, pin_memory, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        self.remainder = None
        # every rank starts an iterator, as Accelerate's do: it draws the same random numbers
        # (the workers' base seed) on every rank; only rank 0 reads from it (with num_workers,
        # the other ranks' workers start too and prefetch a few batches nobody reads)
        batches = iter(self.loader)
        ahead = self._read_step(batches)
        head = None  # the epoch's first samples, to top up a short last step
        while True:
            step, ahead = ahead, self._read_step(batches)
            info = [self._announce(step, ahead)]
            dist.broadcast_object_list(info, src=0)
            if isinstance(info[0], str):  # rank 0 could not read: every rank stops, and says so
                if isinstance(step, BaseException) or isinstance(ahead, BaseException):
                    raise step if isinstance(step, BaseException) else ahead  # type: ignore[misc]
                raise NbaccelError(info[0])
            if info[0] is None:
                return  # the loader was empty, or only held a step that drop_last dropped
            spec, last = info[0]
            step = self._receive(step, spec)
            if head is None:
                head = self._slice(step, slice(0, self.world_size))
            size = _batch_size(step)
            piece, short = divmod(size, self.world_size)
            if last and short and not self.drop_last:
                self.remainder = size
                step = _concatenate([step, head])
                piece += 1
            yield self._slice(step, slice(self.rank * piece, (self.rank + 1) * piece))
            if last:
                return

    def _slice(self, step: Any, where: slice) -> Any:
        return self.slice_fn(step, where, process_index=self.rank, num_processes=self.world_size)

    def _read_step(self, batches: Iterator[Any]) -> Any:
        """Rank 0: the next global step, None when there is none, or the error reading it
        raised (sent on to the other ranks before it is raised). Other ranks: None."""
        if self.rank != 0:
            return None
        try:
            if self.split_batches:
                return next(batches, None)
            step = list(itertools.islice(batches, self.world_size))
            if not step or (self.drop_last and len(step) < self.world_size):
                return None
            return _concatenate(step)
        except Exception as err:  # re-raised on rank 0, reported on the others
            return err

    def _announce(self, step: Any, ahead: Any) -> Any:
        """Rank 0's word on this step: its shapes and whether it is the last; None: no step;
        a message: reading failed."""
        if self.rank != 0:
            return None
        failed = next((e for e in (step, ahead) if isinstance(e, BaseException)), None)
        if failed is not None:
            return (
                f"rank 0 failed reading the dispatched DataLoader ({type(failed).__name__}: "
                f"{failed}); its traceback is rank 0's"
            )
        if step is None:
            return None
        if _batch_size(step) is None:
            return "dispatch_batches=True needs batches that hold a tensor (none found)"
        return (_spec(step), ahead is None)

    def _receive(self, step: Any, spec: Any) -> Any:
        """Rank 0's step, on every rank, on the process group's device."""
        if self.rank == 0:
            step = map_tensors(step, lambda t: t.to(self.device))
        else:
            step = _empty_like(spec, self.device)
        map_tensors(step, lambda t: dist.broadcast(t, src=0))
        return step


def _spec(batch: Any) -> Any:
    """``batch`` with each tensor replaced by its ``TensorSpec`` (other leaves travel as they
    are: a list of strings reaches every rank whole, as in Accelerate)."""
    return map_tensors(batch, lambda t: TensorSpec(tuple(t.shape), t.dtype))


def _empty_like(spec: Any, device: torch.device) -> Any:
    if isinstance(spec, TensorSpec):
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if isinstance(spec, Mapping):
        return type(spec)({k: _empty_like(v, device) for k, v in spec.items()})
    if isinstance(spec, tuple) and hasattr(spec, "_fields"):
        return type(spec)(*(_empty_like(v, device) for v in spec))
    if isinstance(spec, list | tuple):
        return type(spec)(_empty_like(v, device) for v in spec)
    return spec


def _concatenate(batches: list[Any]) -> Any:
    """Batches of the same structure joined along the first dimension."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        try:
            return torch.cat(batches)
        except RuntimeError as err:
            raise ValueError(
                "dispatch_batches=True joins world_size batches into one step, but these "
                f"batches' tensors do not fit together ({err}). Give every batch the same "
                "shape past the first dimension (pad them in collate_fn), or use "
                "split_batches=True, so that rank 0 reads one batch per step and cuts it."
            ) from err
    if isinstance(first, Mapping):
        return type(first)({k: _concatenate([b[k] for b in batches]) for k in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_concatenate(list(parts)) for parts in zip(*batches, strict=True)))
    if isinstance(first, list | tuple):
        return type(first)(_concatenate(list(parts)) for parts in zip(*batches, strict=True))
    if len(batches) == 1:
        return first
    raise TypeError(
        f"dispatch_batches=True joins world_size batches into one step, and can join only "
        f"tensors (and lists, tuples and dicts of them); this batch holds a "
        f"{type(first).__name__}. Make collate_fn return tensors, or use split_batches=True."
    )


def _batch_size(batch: Any) -> int | None:
    """The first dimension of the batch's first tensor (None: it holds no tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, list | tuple) or isinstance(batch, Mapping):
        for value in values:
            size = _batch_size(value)
            if size is not None:
                return size
    return None
