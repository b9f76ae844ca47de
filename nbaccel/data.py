"""Give each rank its own slice of every batch, already on the right device.

Sharding rule (per-process batch size, as Accelerate does by default): the loader's sampler is
read in global steps of ``batch_size * world_size`` indices, and rank ``r`` takes the ``r``-th
block of ``batch_size``. So one DDP step over ``N`` ranks sees exactly the samples that one
process with ``batch_size * N`` would see, in the same order; gathering a step's outputs in rank
order gives the original order back.

Even batches: when the data does not fill the last global step, it is topped up with the epoch's
first indices, so every rank runs the same number of steps (a rank that stopped early would leave
the others waiting in an all-reduce forever). ``gather_for_metrics`` drops those repeats again.

Shuffling: a sampler that draws from torch's global RNG (``RandomSampler`` and friends without a
``generator``) would draw a different order on every rank. Each epoch, rank 0's draw is broadcast
and every rank shuffles with it; rank 0 draws exactly as a single-process loader would.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler
from torch.utils.data.distributed import DistributedSampler


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any], lists: bool = False) -> Any:
    """Apply ``fn`` to every tensor inside tuples, lists, dicts and named tuples, keeping the
    structure; with ``lists``, also to lists that hold no tensor (Python objects per sample)."""
    if isinstance(data, torch.Tensor):
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
    """Move every tensor inside tuples, lists, dicts and named tuples to ``device``."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking))


def to_cpu(obj: Any) -> Any:
    """Detached CPU copies of every tensor inside: plain data that can leave the process."""
    return map_tensors(obj, lambda t: t.detach().cpu())


@dataclass(eq=False)  # compared by identity: two passes may hold equal values
class _Pass:
    remainder: int | None
    end: bool = False


@dataclass
class LoopState:
    """Which prepared loader is being iterated, and whether this is its last batch.

    ``accumulate`` reads it to sync gradients at the end of the data, and ``gather_for_metrics``
    to drop the repeats that topped up the last step. One per Accelerator: no global state.
    """

    active: list[_Pass] = field(default_factory=list)  # a stack: eval loop inside a train loop

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.active) and self.active[-1].end

    @property
    def remainder(self) -> int | None:
        """Real samples in the last global step, when that step was topped up; else None."""
        return self.active[-1].remainder if self.active else None


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's ``batch_size`` indices of each global step (see the module docstring)."""

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        shared_seed: Callable[[], int] | None = None,
    ) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.rank, self.world_size, self.shared_seed = rank, world_size, shared_seed
        self.global_batch = batch_size * world_size

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.global_batch if self.drop_last else math.ceil(n / self.global_batch)

    @property
    def remainder(self) -> int | None:
        n = len(self.sampler)  # type: ignore[arg-type]
        return None if self.drop_last or n % self.global_batch == 0 else n % self.global_batch

    def _epoch_sampler(self) -> Sampler[int]:
        if getattr(self.sampler, "generator", False) is not None or self.shared_seed is None:
            return self.sampler  # deterministic, or seeded by the user on every rank alike
        sampler = copy.copy(self.sampler)
        sampler.generator = torch.Generator().manual_seed(self.shared_seed())
        return sampler

    def __iter__(self) -> Iterator[list[int]]:
        head: list[int] = []  # the epoch's first indices, to top up the last step
        step: list[int] = []
        for index in self._epoch_sampler():
            step.append(index)
            if len(head) < self.global_batch:
                head.append(index)
            if len(step) == self.global_batch:
                yield self._mine(step)
                step = []
        if step and not self.drop_last:
            step.extend(itertools.islice(itertools.cycle(head), self.global_batch - len(step)))
            yield self._mine(step)

    def _mine(self, step: list[int]) -> list[int]:
        start = self.rank * self.batch_size
        return step[start : start + self.batch_size]


def shard_dataloader(
    loader: DataLoader, rank: int, world_size: int, shared_seed: Callable[[], int] | None
) -> DataLoader:
    """A copy of ``loader`` that yields this rank's part of each global step."""
    if world_size == 1 or isinstance(loader.sampler, DistributedSampler):
        return loader  # nothing to split, or the user already split it
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            f"prepare() cannot shard a DataLoader over an IterableDataset "
            f"({type(loader.dataset).__name__}) across {world_size} processes: it has no "
            "indices to split. Give it a map-style Dataset, or shard the stream yourself "
            "using accelerator.process_index and accelerator.num_processes."
        )
    if loader.batch_size is None:
        raise TypeError(
            "prepare() shards DataLoaders built with batch_size=...; this one has a custom "
            f"batch_sampler ({type(loader.batch_sampler).__name__}). Wrap its sampler in a "
            "DistributedSampler yourself; prepare() will then leave the loader's order alone."
        )
    batches = ShardedBatchSampler(
        loader.sampler, loader.batch_size, loader.drop_last, rank, world_size, shared_seed
    )
    return DataLoader(
        loader.dataset,
        batch_sampler=batches,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=loader.persistent_workers,
    )


class PreparedDataLoader:
    """Iterates a (sharded) DataLoader and yields batches already on ``device``.

    It looks one batch ahead so that it knows, before yielding it, which batch is the last:
    ``accumulate`` then syncs gradients there even if the window is not full.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        state: LoopState,
        on_batch: Callable[[int], None] | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self.loader, self.device, self.state = loader, device, state
        self.on_batch = on_batch  # told each batch's sample count, for the live view
        self.on_end = on_end  # told when a pass over the data is complete
        self._non_blocking = bool(loader.pin_memory) and device.type == "cuda"
        sampler = loader.batch_sampler
        self._remainder = sampler.remainder if isinstance(sampler, ShardedBatchSampler) else None

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this rank."""
        sampler = self.loader.batch_sampler
        if isinstance(sampler, ShardedBatchSampler):
            return sampler.batch_size
        return self.loader.batch_size

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, sampler, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        frame = _Pass(self._remainder)
        self.state.active.append(frame)
        try:
            batches = iter(self.loader)
            current = next(batches, _DONE)
            while current is not _DONE:
                following = next(batches, _DONE)
                frame.end = following is _DONE
                if self.on_batch is not None:
                    self.on_batch(_batch_len(current))
                yield send_to_device(current, self.device, self._non_blocking)
                current = following
            if self.on_end is not None:
                self.on_end()
        finally:
            self.state.active.remove(frame)


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if it has none)."""
    while True:
        if isinstance(batch, torch.Tensor):
            return batch.shape[0] if batch.dim() else 1
        if isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        elif isinstance(batch, list | tuple) and batch:
            batch = batch[0]
        else:
            return 0


_DONE = object()
