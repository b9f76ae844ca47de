"""Give each rank its own share of every batch, already on the right device.

Sharding follows Accelerate's ``prepare_data_loader`` exactly (checked index by index in
``tests/test_dataloader_config.py``). The loader's batches are read in *global steps*, one
training step of every rank together:

* Default: a global step is ``world_size`` consecutive batches, and rank ``r`` takes the
  ``r``-th. So one DDP step over ``N`` ranks sees exactly the samples that one process with
  ``batch_size * N`` would see, in the same order; gathering a step in rank order gives it back.
* ``split_batches=True``: a global step is one batch, cut into ``world_size`` equal slices (so
  ``batch_size`` must be a multiple of ``world_size``); rank ``r`` takes the ``r``-th slice.
* A custom ``batch_sampler`` with no ``batch_size`` (batches of any size): whole batches are
  dealt out in turn, ``world_size`` to a global step. One with a ``batch_size`` follows the
  rules above, and only its last batch may be short.

The last global step, when the data does not fill it:

* ``even_batches=True`` (default): it is topped up with the epoch's first samples (first
  batches), so every rank runs the same number of steps: a rank that stopped early would leave
  the others waiting in an all-reduce forever. ``gather_for_metrics`` drops the repeats again
  (``remainder`` counts the real samples).
* ``even_batches=False``: nothing is repeated; the ranks past the data get one batch fewer, and
  the last batch may be short (never empty).
* ``drop_last=True``: it is dropped.

Shuffling: a sampler that draws from torch's global RNG (``RandomSampler`` and friends without a
``generator``) would draw a different order on every rank. Each epoch, rank 0's draw is broadcast
and every rank shuffles with it; rank 0 draws exactly as a single-process loader would. With
``use_seedable_sampler=True`` a ``RandomSampler``'s order instead comes from the seed
``data_seed + epoch`` alone, even on one process. Without ``data_seed`` the Accelerator takes
rank 0's ``torch.initial_seed()`` for every rank, so the ranks shuffle alike even unseeded
(Accelerate takes each rank's own). The prepared loader's ``set_epoch`` picks the epoch, and
each complete pass moves it on by one.

A loader whose sampler is a ``DistributedSampler`` is already split: it is left as it is.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler
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


@dataclass(frozen=True)
class DataLoaderConfiguration:
    """How ``prepare`` shards DataLoaders: Accelerate's options, names and defaults.

    ``split_batches``: cut each batch into ``num_processes`` slices instead of giving each rank
    whole batches (the global batch is then ``batch_size``, not ``batch_size * num_processes``).
    ``even_batches``: top up the last global step so every rank runs it. ``use_seedable_sampler``
    and ``data_seed``: shuffle from ``data_seed + epoch``, independent of the global RNG.
    ``non_blocking``: copy batches to the GPU without waiting (pair it with ``pin_memory=True``).
    ``dispatch_batches`` and ``use_stateful_dataloader`` exist for Accelerate's code; only their
    "off" values work here.

    >>> DataLoaderConfiguration(split_batches=True).even_batches
    True
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        flags = ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking")
        for name in (*flags, "use_stateful_dataloader"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.dispatch_batches is not None and not isinstance(self.dispatch_batches, bool):
            raise TypeError(f"dispatch_batches={self.dispatch_batches!r} must be None or False")
        if self.data_seed is not None and (
            isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)
        ):
            raise TypeError(f"data_seed={self.data_seed!r} must be an int or None")
        if self.dispatch_batches:
            raise ValueError(
                "dispatch_batches=True is not supported: in Accelerate it makes the main process "
                "read every batch and send each rank its slice. nbaccel has no such path: every "
                "rank reads its own shard of a map-style dataset, which is what "
                "dispatch_batches=False means. Leave dispatch_batches unset; to stream an "
                "IterableDataset, shard it yourself with accelerator.process_index and "
                "accelerator.num_processes."
            )
        if self.use_stateful_dataloader:
            raise ValueError(
                "use_stateful_dataloader=True is not supported: in Accelerate it builds the "
                "loader on torchdata's StatefulDataLoader, so that save_state records where an "
                "epoch stopped; nbaccel does not depend on torchdata. Leave it False, and to "
                "resume mid-epoch skip the batches already seen, e.g. "
                "itertools.islice(loader, seen, None)."
            )


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``seed + epoch``: the same on every rank
    whatever the global RNG did, and the same orders as Accelerate's sampler of this name."""

    def __init__(self, sampler: RandomSampler, seed: int) -> None:
        super().__init__(sampler.data_source, sampler.replacement, sampler.num_samples)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        # a fresh generator each epoch: the order cannot depend on how far an earlier pass got
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from super().__iter__()
        self.epoch += 1  # a complete pass moves on, as Accelerate's sampler does


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's batches of each global step of ``batch_sampler`` (see the module docstring).

    ``batch_size`` is this rank's batch size (None: batches of any size); ``remainder`` is set
    while iterating: the real samples of the last global step if it was topped up, else None.
    """

    def __init__(
        self,
        batch_sampler: Sampler[list[int]] | Iterable[list[int]],
        rank: int,
        world_size: int,
        *,
        split_batches: bool = False,
        even_batches: bool = True,
        shared_seed: Callable[[], int] | None = None,
    ) -> None:
        self.batch_sampler, self.rank, self.world_size = batch_sampler, rank, world_size
        self.split_batches, self.even_batches = split_batches, even_batches
        self.shared_seed = shared_seed
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.loader_batch_size = _fixed_batch_size(batch_sampler)
        if split_batches:
            _check_split(self.loader_batch_size, world_size, batch_sampler)
        size = self.loader_batch_size
        self.batch_size = size // world_size if split_batches and size else size
        self.remainder: int | None = None

    def __len__(self) -> int:
        batches = len(self.batch_sampler)  # type: ignore[arg-type]
        if self.split_batches:  # one step per batch; even_batches=False may skip the last
            skipped = not self.even_batches and self._last_slice_empty()
            return batches - int(skipped)
        rounds, left = divmod(batches, self.world_size)
        if left and not self.drop_last and (self.even_batches or self.rank < left):
            rounds += 1
        return rounds

    def _last_slice_empty(self) -> bool:
        """Split batches, short last batch: does it end before this rank's slice begins?"""
        sampler = getattr(self.batch_sampler, "sampler", None)
        if self.drop_last or not hasattr(sampler, "__len__"):
            return False
        short = len(sampler) % self.loader_batch_size  # type: ignore[arg-type, operator]
        return 0 < short <= self.rank * self.batch_size  # type: ignore[operator]

    def __iter__(self) -> Iterator[list[int]]:
        self.remainder = None
        batches = self._epoch_batches()
        if self.loader_batch_size is None:  # batches of any size: deal them out whole
            for step in self._steps(batches, self.world_size, lambda s: sum(map(len, s))):
                if self.rank < len(step):
                    yield step[self.rank]
            return
        step_size = self.loader_batch_size * (1 if self.split_batches else self.world_size)
        piece = step_size // self.world_size
        for step in self._steps(self._indices(batches), step_size, len):
            mine = step[self.rank * piece : (self.rank + 1) * piece]
            if mine:  # even_batches=False: a rank past the data gets no batch, not an empty one
                yield mine

    def _steps(
        self, items: Iterable[Any], size: int, samples: Callable[[list[Any]], int]
    ) -> Iterator[list[Any]]:
        """Consecutive global steps of ``size`` items; a short last one is topped up with the
        epoch's first items (even_batches), kept short, or dropped (drop_last)."""
        head: list[Any] = []
        step: list[Any] = []
        for item in items:
            step.append(item)
            if len(head) < size:
                head.append(item)
            if len(step) == size:
                yield step
                step = []
        if step and not self.drop_last:
            if self.even_batches:
                self.remainder = samples(step)
                step.extend(itertools.islice(itertools.cycle(head), size - len(step)))
            yield step

    def _indices(self, batches: Iterable[list[int]]) -> Iterator[int]:
        """The batches' indices in order. Only the last batch may be short: the sample-wise
        rule above would regroup a short batch in the middle, which Accelerate does not."""
        short = False
        for batch in batches:
            if short or len(batch) > self.loader_batch_size:  # type: ignore[operator]
                raise ValueError(
                    f"the DataLoader's batch_sampler ({type(self.batch_sampler).__name__}) has "
                    f"batch_size={self.loader_batch_size} but yielded a batch of {len(batch)} "
                    "samples before its last batch. Give it no batch_size attribute, so its "
                    "batches are dealt out whole, or make every batch but the last full."
                )
            short = len(batch) < self.loader_batch_size  # type: ignore[operator]
            yield from batch

    def _epoch_batches(self) -> Iterable[list[int]]:
        sampler = getattr(self.batch_sampler, "sampler", None)
        if not _draws_from_global_rng(sampler) or self.shared_seed is None:
            return self.batch_sampler  # deterministic, or seeded alike on every rank
        sampler = copy.copy(sampler)
        sampler.generator = torch.Generator().manual_seed(self.shared_seed())
        batches = copy.copy(self.batch_sampler)
        batches.sampler = sampler  # type: ignore[union-attr]
        return batches


def _draws_from_global_rng(sampler: Any) -> bool:
    return getattr(sampler, "generator", False) is None and not isinstance(
        sampler, SeedableRandomSampler
    )


def _fixed_batch_size(batch_sampler: Any) -> int | None:
    """The fixed batch size of a DataLoader's batch sampler, or None (batches of any size)."""
    size = getattr(batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _check_split(batch_size: int | None, world_size: int, batch_sampler: Any) -> None:
    if batch_size is None:
        raise ValueError(
            "split_batches=True cuts each batch into equal slices, so it needs a fixed batch "
            f"size; this DataLoader's batch_sampler ({type(batch_sampler).__name__}) has no "
            "batch_size attribute. Give it one, or use split_batches=False."
        )
    if batch_size % world_size:
        fit = max(world_size, batch_size // world_size * world_size)
        raise ValueError(
            f"split_batches=True cuts each batch of {batch_size} samples into {world_size} "
            f"equal slices, one per process, so batch_size must be a multiple of {world_size}: "
            f"use e.g. batch_size={fit}, or split_batches=False."
        )


def shard_dataloader(
    loader: DataLoader,
    rank: int,
    world_size: int,
    shared_seed: Callable[[], int] | None,
    config: DataLoaderConfiguration | None = None,
) -> DataLoader:
    """A copy of ``loader`` that yields this rank's part of each global step; ``loader`` itself
    when there is nothing to change (one process, no seeded shuffle; a DistributedSampler)."""
    config = config or DataLoaderConfiguration()
    batches = loader.batch_sampler
    # DataLoader(sampler=BatchSampler(...), batch_size=None): the sampler yields whole batches
    as_sampler = batches is None and isinstance(loader.sampler, BatchSampler)
    if as_sampler:
        batches = loader.sampler
    sampler = getattr(batches, "sampler", None)
    if config.split_batches and not isinstance(loader.dataset, IterableDataset):
        _check_split(_fixed_batch_size(batches), world_size, batches)  # on one process too
    if config.use_seedable_sampler and isinstance(sampler, RandomSampler):
        seed = torch.initial_seed() if config.data_seed is None else config.data_seed
        batches = copy.copy(batches)  # the user's loader keeps its own sampler
        sampler = SeedableRandomSampler(sampler, seed)
        batches.sampler = sampler  # type: ignore[union-attr]
        if world_size == 1:
            return _with_batch_sampler(loader, batches, as_sampler)
    if world_size == 1 or isinstance(sampler, DistributedSampler):
        return loader  # nothing to split, or the user already split it
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            f"prepare() cannot shard a DataLoader over an IterableDataset "
            f"({type(loader.dataset).__name__}) across {world_size} processes: it has no "
            "indices to split. Give it a map-style Dataset, or shard the stream yourself "
            "using accelerator.process_index and accelerator.num_processes."
        )
    if batches is None:
        raise TypeError(
            "prepare() cannot shard a DataLoader built with batch_size=None and no "
            f"batch_sampler across {world_size} processes: it reads one item at a time, with no "
            "batches to deal out. Give it batch_size=... or a batch_sampler."
        )
    sharded = ShardedBatchSampler(
        batches,  # type: ignore[arg-type]
        rank,
        world_size,
        split_batches=config.split_batches,
        even_batches=config.even_batches,
        shared_seed=shared_seed,
    )
    return _with_batch_sampler(loader, sharded, as_sampler)


def _with_batch_sampler(loader: DataLoader, batch_sampler: Any, as_sampler: bool) -> DataLoader:
    where = {"sampler": batch_sampler, "batch_size": None} if as_sampler else {}
    return DataLoader(
        loader.dataset,
        **(where or {"batch_sampler": batch_sampler}),
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
    ``accumulate`` then syncs gradients there even if the window is not full. Like Accelerate's
    loader it counts epochs: each pass starts with ``set_epoch(epoch)``, and a complete pass
    adds one.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        state: LoopState,
        on_batch: Callable[[int], None] | None = None,
        on_end: Callable[[], None] | None = None,
        *,
        non_blocking: bool = False,
    ) -> None:
        self.loader, self.device, self.state = loader, device, state
        self.on_batch = on_batch  # told each batch's sample count, for the live view
        self.on_end = on_end  # told when a pass over the data is complete
        # a copy to the GPU can run behind the compute (fully so from pinned memory); a CPU
        # "copy" has nothing to overlap with
        self._non_blocking = (non_blocking or bool(loader.pin_memory)) and device.type == "cuda"
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this rank (None: the batch sampler's batches vary in size)."""
        if self.loader.batch_size is not None:
            return self.loader.batch_size
        return _fixed_batch_size(self._batches)  # ShardedBatchSampler: this rank's

    @property
    def _batches(self) -> Any:
        """What yields this rank's batches: the batch sampler, or a sampler that yields whole
        batches itself (``DataLoader(sampler=BatchSampler(...), batch_size=None)``)."""
        loader = self.loader
        return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next pass as epoch ``epoch``: tells the samplers that have ``set_epoch``
        (the seeded sampler, a ``DistributedSampler``), else the dataset if it has one."""
        self.epoch = epoch
        told = False
        for sampler in _samplers(self._batches):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
                told = True
        if not told and hasattr(self.loader.dataset, "set_epoch"):
            self.loader.dataset.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:  # dataset, sampler, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        self.set_epoch(self.epoch)
        frame = _Pass(None)
        self.state.active.append(frame)
        try:
            batches = iter(self.loader)
            current = next(batches, _DONE)
            while current is not _DONE:
                following = next(batches, _DONE)
                if following is _DONE:  # the sampler is spent: it knows how the epoch ended
                    frame.end = True
                    sharded = self._batches
                    if isinstance(sharded, ShardedBatchSampler):
                        frame.remainder = sharded.remainder
                if self.on_batch is not None:
                    self.on_batch(_batch_len(current))
                yield send_to_device(current, self.device, self._non_blocking)
                current = following
            self.epoch += 1
            if self.on_end is not None:
                self.on_end()
        finally:
            self.state.active.remove(frame)


def _samplers(batch_sampler: Any) -> Iterator[Any]:
    """A batch sampler, the batch sampler it shards, and their samplers."""
    while batch_sampler is not None:
        yield batch_sampler
        if getattr(batch_sampler, "sampler", None) is not None:
            yield batch_sampler.sampler
        batch_sampler = getattr(batch_sampler, "batch_sampler", None)


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
