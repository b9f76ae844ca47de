"""Give each rank its own share of every batch, already on the right device.

Sharding follows Accelerate's ``prepare_data_loader`` exactly (checked index by index in
``tests/accelerator/data/test_dataloader_config.py``). The loader's batches are read in *global
steps*, one training step of every rank together:

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
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from .. import collectives
from .loader import LoopState, PreparedDataLoader, with_batch_sampler
from .samplers import SeedableRandomSampler, ShardedBatchSampler, check_split, fixed_batch_size

if TYPE_CHECKING:
    from ...env import DistEnv
    from ...observe.rank_recorder import Recorder


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

    @classmethod
    def checked(cls, config: object) -> DataLoaderConfiguration:
        """``config``, or the defaults for None; anything else is refused."""
        if not isinstance(config, cls | None):
            raise TypeError(
                f"dataloader_config={config!r} must be a nbaccel.utils.DataLoaderConfiguration"
            )
        return config or cls()

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
                "epoch stopped; nbaccel does not depend on torchdata, and its save_state "
                "records that anyway. Leave it False, and after load_state resume the epoch "
                "with accelerator.skip_first_batches(loader, batches_seen)."
            )


def prepare_dataloader(
    loader: DataLoader,
    env: DistEnv,
    device: torch.device,
    config: DataLoaderConfiguration,
    state: LoopState,
    recorder: Recorder | None = None,
) -> PreparedDataLoader:
    """What ``Accelerator.prepare`` makes of a DataLoader: this rank's shard, on ``device``,
    counted by ``recorder`` (samples, epochs, and the time spent waiting for batches)."""
    rank, world_size = env.rank, env.world_size
    if config.use_seedable_sampler and config.data_seed is None and world_size > 1:
        # every rank must shuffle alike, seeded by the user or not (Accelerate takes each
        # rank's own initial seed, so unseeded ranks would read different orders)
        seed = collectives.broadcast_object_list([torch.initial_seed()])[0]
        config = dataclasses.replace(config, data_seed=seed)

    def shared_seed() -> int:
        """Rank 0's draw from the global RNG, on every rank: one shuffle order for all."""
        seed = torch.empty((), dtype=torch.int64).random_()
        return int(collectives.broadcast(seed.to(device)).item())

    sharded = shard_dataloader(loader, rank, world_size, shared_seed, config)
    if recorder is None:
        return PreparedDataLoader(sharded, device, state, non_blocking=config.non_blocking)
    return PreparedDataLoader(
        sharded,
        device,
        state,
        recorder.count,
        recorder.epoch_done,
        non_blocking=config.non_blocking,
        breakdown=recorder.breakdown,
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
        check_split(fixed_batch_size(batches), world_size, batches)  # on one process too
    if config.use_seedable_sampler and isinstance(sampler, RandomSampler):
        seed = torch.initial_seed() if config.data_seed is None else config.data_seed
        batches = copy.copy(batches)  # the user's loader keeps its own sampler
        sampler = SeedableRandomSampler(sampler, seed)
        batches.sampler = sampler  # type: ignore[union-attr]
        if world_size == 1:
            return with_batch_sampler(loader, batches, as_sampler)
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
    return with_batch_sampler(loader, sharded, as_sampler)
