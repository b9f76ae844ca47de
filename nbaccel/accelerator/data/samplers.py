"""The samplers that shard a DataLoader: this rank's batches of each global step, and a
shuffle that depends on a seed and the epoch alone. The rules they follow are in ``sharding``'s
docstring; ``shard_dataloader`` builds them.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``data_seed + epoch``: the same on every
    rank whatever the global RNG did. Accelerate's class, arguments and orders: without
    ``data_seed`` the seed is ``torch.initial_seed()`` when it is built; a given ``generator``
    is re-seeded each epoch, else one is made. ``from_sampler`` is what ``use_seedable_sampler``
    builds from a loader's ``RandomSampler`` (with a generator of its own: the user's is left
    alone)."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = torch.initial_seed() if data_seed is None else data_seed
        self.epoch = 0

    @classmethod
    def from_sampler(cls, sampler: RandomSampler, seed: int) -> SeedableRandomSampler:
        return cls(sampler.data_source, sampler.replacement, sampler._num_samples, data_seed=seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        # re-seeded each epoch: the order cannot depend on how far an earlier pass got
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
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
        self.loader_batch_size = fixed_batch_size(batch_sampler)
        if split_batches:
            check_split(self.loader_batch_size, world_size, batch_sampler)
        size = self.loader_batch_size
        self.batch_size = size // world_size if split_batches and size else size
        self.remainder: int | None = None
        # where the pass stands, for torchdata's StatefulDataLoader (state_dict): the shuffle's
        # shared seed and the batches yielded; and a state to resume, until the next pass
        self._seed: int | None = None
        self._yielded = 0
        self._resume: dict[str, Any] | None = None

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

    def state_dict(self) -> dict[str, Any]:
        """Where this pass stands: the seed its shuffle shares across ranks (None: it drew
        none) and the batches it yielded. A StatefulDataLoader keeps it, so that a resumed
        pass shuffles as the interrupted one did, not from the RNG as it is then."""
        return {"seed": self._seed, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass is the one ``state`` saved, without the batches it had yielded."""
        self._resume = dict(state)

    def __iter__(self) -> Iterator[list[int]]:
        resume, self._resume = self._resume, None
        skip = resume["yielded"] if resume else 0
        self._yielded = 0
        for batch in self._pass(resume["seed"] if resume else None):
            self._yielded += 1
            if self._yielded > skip:
                yield batch

    def _pass(self, seed: int | None) -> Iterator[list[int]]:
        self.remainder = None
        batches = self._epoch_batches(seed)
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

    def _epoch_batches(self, seed: int | None) -> Iterable[list[int]]:
        """The pass's batches: shuffled with ``seed`` (a resumed pass's), else with rank 0's
        draw when the sampler would draw from the global RNG."""
        self._seed = None
        sampler = getattr(self.batch_sampler, "sampler", None)
        if not _draws_from_global_rng(sampler) or (self.shared_seed is None and seed is None):
            return self.batch_sampler  # deterministic, or seeded alike on every rank
        self._seed = self.shared_seed() if seed is None else seed  # type: ignore[misc]
        sampler = copy.copy(sampler)
        sampler.generator = torch.Generator().manual_seed(self._seed)
        batches = copy.copy(self.batch_sampler)
        batches.sampler = sampler  # type: ignore[union-attr]
        return batches


class BatchSamplerShard(ShardedBatchSampler):
    """Accelerate's name and arguments for ``ShardedBatchSampler``: the batches of
    ``batch_sampler`` that process ``process_index`` of ``num_processes`` takes."""

    def __init__(
        self,
        batch_sampler: Sampler[list[int]] | Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        super().__init__(
            batch_sampler,
            process_index,
            num_processes,
            split_batches=split_batches,
            even_batches=even_batches,
        )

    @property
    def num_processes(self) -> int:
        return self.world_size

    @property
    def process_index(self) -> int:
        return self.rank

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


class SkipBatchSampler(Sampler[list[int]]):
    """``batch_sampler`` without its first ``skip_batches`` batches (Accelerate's class)."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"skip_batches={skip_batches!r} must be an int >= 0")
        self.batch_sampler, self.skip_batches = batch_sampler, skip_batches

    @property
    def batch_size(self) -> int | None:
        return fixed_batch_size(self.batch_sampler)

    @property
    def drop_last(self) -> bool:
        return bool(getattr(self.batch_sampler, "drop_last", False))

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)


def counted_batches(loader: Any) -> int | None:
    """How many batches a pass of ``loader`` yields, where that is known without reading one
    ahead and reading a batch only when it is asked for changes nothing else; else None.

    That is: a plain ``DataLoader`` over a ``TensorDataset`` read in this process with the
    default collate (indexing tensors draws no random numbers, so the RNG's draws fall in the
    same order against the model's as when reading ahead, and the numbers are Accelerate's),
    batched by torch's ``BatchSampler``, or nbaccel's shard of one, over a sequential or random
    sampler (their lengths are exact). A random sampler counts only with a generator of its
    own: one given to the DataLoader may be drawn from by the loop too, and the sampler draws
    from it as it goes (``replacement=True``, and at a pass's end)."""
    if (
        type(loader) is not DataLoader
        or type(loader.dataset) is not TensorDataset
        or loader.num_workers
        or loader.collate_fn is not default_collate
    ):
        return None
    batches = loader.batch_sampler
    inner = batches.batch_sampler if type(batches) is ShardedBatchSampler else batches
    if type(inner) is not BatchSampler or type(inner.sampler) not in _EXACT:
        return None
    if type(inner.sampler) is RandomSampler and inner.sampler.generator is not None:
        return None
    return len(batches)


_EXACT = (SequentialSampler, RandomSampler, SeedableRandomSampler)


def _draws_from_global_rng(sampler: Any) -> bool:
    return getattr(sampler, "generator", False) is None and not isinstance(
        sampler, SeedableRandomSampler
    )


def fixed_batch_size(batch_sampler: Any) -> int | None:
    """The fixed batch size of a DataLoader's batch sampler, or None (batches of any size)."""
    size = getattr(batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def check_split(batch_size: int | None, world_size: int, batch_sampler: Any) -> None:
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
            f"equal slices, one per process, so batch_size must be a multiple of {world_size} "
            "(a round multiple of the number of processes): "
            f"use e.g. batch_size={fit}, or split_batches=False."
        )


class Replay(Sampler[list[int]]):
    """``batch_sampler`` without its first ``skip`` batches; given ``rng``, the torch RNG
    state that the pass first began with, it also reproduces that pass's shuffle.

    A shuffling sampler draws its order from the global RNG when its pass begins (and the
    DataLoader draws a base seed for its workers when it is iterated). Resuming, the loader
    sets the RNG to ``rng`` before it iterates (``loader.PreparedDataLoader``), so both draws
    repeat; here, right after the sampler drew, the RNG goes back to the checkpoint's state,
    before any batch is read: the rest of the pass draws what it drew the first time.
    """

    def __init__(self, batch_sampler: Any, skip: int, rng: torch.Tensor | None) -> None:
        self.batch_sampler, self.skip, self.rng = batch_sampler, skip, rng
        self.resumed: torch.Tensor | None = None  # the RNG state to go back to, once drawn

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.batch_sampler)
        first = next(batches, None)  # the sampler has drawn its order now
        self.restore()
        if first is None:
            return
        yield from itertools.islice(itertools.chain([first], batches), self.skip, None)

    def restore(self) -> None:
        """Give back the RNG state the loader put aside (once)."""
        if self.resumed is not None:
            torch.set_rng_state(self.resumed)
            self.resumed = None
