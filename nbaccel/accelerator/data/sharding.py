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

Two other ways to share the data, as Accelerate has them:

* An IterableDataset has no indices: every rank reads the whole stream and keeps its slices of
  each global step (``streams.IterableDatasetShard``), when ``dispatch_batches=False``.
* ``dispatch_batches=True`` (the default for an IterableDataset): rank 0 reads each global step
  and sends it to every rank, which keeps its slice (``dispatch.DispatchedDataLoader``).

Both always give every rank a batch of every step, the last topped up with the epoch's first
samples unless ``drop_last``: so ``even_batches=False`` is refused for them (Accelerate ignores
it there).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from .. import collectives
from .adapters import STATEFUL_DISPATCH, DataLoaderDispatcher, DataLoaderShard
from .dispatch import DispatchedDataLoader
from .loader import LoopState, PreparedDataLoader, with_batch_sampler, with_dataset, workers_of
from .resumable import as_stateful
from .samplers import SeedableRandomSampler, ShardedBatchSampler, check_split, fixed_batch_size
from .streams import IterableDatasetShard

if TYPE_CHECKING:
    from ...env import DistEnv
    from ...observe.rank_recorder import Recorder


_FLAGS = ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking")


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards DataLoaders: Accelerate's options, names and defaults.

    ``split_batches``: cut each batch into ``num_processes`` slices instead of giving each rank
    whole batches (the global batch is then ``batch_size``, not ``batch_size * num_processes``).
    ``even_batches``: top up the last global step so every rank runs it. ``use_seedable_sampler``
    and ``data_seed``: shuffle from ``data_seed + epoch``, independent of the global RNG.
    ``non_blocking``: copy batches to the GPU without waiting (pair it with ``pin_memory=True``).
    ``dispatch_batches``: rank 0 reads every batch and sends each rank its slice (``dispatch``);
    None means "for an IterableDataset", as in Accelerate. ``use_stateful_dataloader``: build
    the prepared loader on torchdata's ``StatefulDataLoader`` (``pip install
    'nbaccel[stateful]'``): its ``state_dict()``, kept by ``save_state``, resumes the pass
    where it stopped, with no ``skip_first_batches`` (``resumable``).

    As in Accelerate, fields can be assigned (``config.data_seed = 43``); each value is checked
    when it is set, and a loader prepared earlier keeps the values it was prepared with.

    >>> config = DataLoaderConfiguration(split_batches=True)
    >>> config.even_batches = False
    >>> config.even_batches
    False
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

    def __setattr__(self, name: str, value: object) -> None:
        _check_field(name, value)  # the dataclass's __init__ sets each field through here too
        super().__setattr__(name, value)


def _check_field(name: str, value: object) -> None:
    if name in (*_FLAGS, "use_stateful_dataloader") and not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")
    if name == "dispatch_batches" and value is not None and not isinstance(value, bool):
        raise TypeError(f"dispatch_batches={value!r} must be None, True or False")
    if (
        name == "data_seed"
        and value is not None
        and (isinstance(value, bool) or not isinstance(value, int))
    ):
        raise TypeError(f"data_seed={value!r} must be an int or None")


class SharedSeed:
    """Rank 0's draw from the global RNG, on every rank: one shuffle order for all. A class,
    not a closure, so that a prepared loader (and its Accelerator) can be pickled."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self) -> int:
        seed = torch.empty((), dtype=torch.int64).random_()
        return int(collectives.broadcast(seed.to(self.device)).item())


def prepare_dataloader(
    loader: DataLoader,
    env: DistEnv,
    device: torch.device,
    config: DataLoaderConfiguration,
    state: LoopState,
    recorder: Recorder | None = None,
    slice_fn: Callable[..., Any] | None = None,
    device_placement: bool = True,
) -> PreparedDataLoader:
    """What ``Accelerator.prepare`` makes of a DataLoader: this rank's shard, on ``device``
    (left where it is made with ``device_placement=False``), counted by ``recorder`` (samples,
    epochs, and the time spent waiting for batches). ``slice_fn`` cuts a dispatched step
    (Accelerate's ``slice_fn_for_dispatch``)."""
    rank, world_size = env.rank, env.world_size
    if config.use_seedable_sampler and config.data_seed is None and world_size > 1:
        # every rank must shuffle alike, seeded by the user or not (Accelerate takes each
        # rank's own initial seed, so unseeded ranks would read different orders)
        seed = collectives.broadcast_object_list([torch.initial_seed()])[0]
        config = dataclasses.replace(config, data_seed=seed)
    sharded = shard_dataloader(
        loader, rank, world_size, SharedSeed(device), config, device=device, slice_fn=slice_fn
    )
    kind = DataLoaderDispatcher if dispatches(loader, config) else DataLoaderShard
    place = device if device_placement else None
    return kind.around(sharded, place, state, recorder, non_blocking=config.non_blocking)


def stateful_if_asked(sharded: Any, config: DataLoaderConfiguration) -> Any:
    """``sharded`` on a StatefulDataLoader when ``use_stateful_dataloader`` asks for one."""
    if not config.use_stateful_dataloader:
        return sharded
    if isinstance(sharded, DispatchedDataLoader):
        raise ValueError(STATEFUL_DISPATCH)
    return as_stateful(sharded, workers_of(sharded))


def dispatches(loader: DataLoader, config: DataLoaderConfiguration) -> bool:
    """Does rank 0 read for everyone? ``dispatch_batches``; unset, for an IterableDataset (the
    default of Accelerate's ``Accelerator``)."""
    if config.dispatch_batches is None:
        return isinstance(loader.dataset, IterableDataset)
    return config.dispatch_batches


def shard_dataloader(
    loader: DataLoader,
    rank: int,
    world_size: int,
    shared_seed: Callable[[], int] | None,
    config: DataLoaderConfiguration | None = None,
    *,
    device: torch.device | None = None,
    slice_fn: Callable[..., Any] | None = None,
) -> Any:
    """A copy of ``loader`` that yields this rank's part of each global step; ``loader`` itself
    when there is nothing to change (one process, no seeded shuffle; a DistributedSampler).
    A dispatched loader (``dispatch.DispatchedDataLoader``) broadcasts on ``device``."""
    config = config or DataLoaderConfiguration()
    dispatch = dispatches(loader, config)
    stream = isinstance(loader.dataset, IterableDataset)
    batches = loader.batch_sampler
    # DataLoader(sampler=BatchSampler(...), batch_size=None): the sampler yields whole batches
    as_sampler = batches is None and isinstance(loader.sampler, BatchSampler)
    if as_sampler:
        batches = loader.sampler
    sampler = getattr(batches, "sampler", None)
    _check_combination(loader, config, world_size, dispatch, slice_fn, sampler)
    if config.split_batches and not stream:
        check_split(fixed_batch_size(batches), world_size, batches)  # on one process too
    if config.use_seedable_sampler and isinstance(sampler, RandomSampler):
        seed = torch.initial_seed() if config.data_seed is None else config.data_seed
        batches = copy.copy(batches)  # the user's loader keeps its own sampler
        sampler = SeedableRandomSampler.from_sampler(sampler, seed)
        batches.sampler = sampler  # type: ignore[union-attr]
        loader = with_batch_sampler(loader, batches, as_sampler)
    if world_size == 1 or isinstance(sampler, DistributedSampler):
        return stateful_if_asked(loader, config)  # nothing to split, or the user split it
    if dispatch:
        if config.split_batches and stream:
            check_split(loader.batch_size, world_size, loader.batch_sampler)
        return stateful_if_asked(
            DispatchedDataLoader(
                loader,
                rank,
                world_size,
                device or torch.device("cpu"),
                split_batches=config.split_batches,
                slice_fn=slice_fn,
            ),
            config,
        )
    if stream:
        shard = IterableDatasetShard(
            loader.dataset,
            batch_size=loader.batch_size,  # type: ignore[arg-type]
            drop_last=loader.drop_last,
            num_processes=world_size,
            process_index=rank,
            split_batches=config.split_batches,
        )
        sharded = with_dataset(loader, shard, shard.step_size // world_size)
        return stateful_if_asked(sharded, config)
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
    return stateful_if_asked(with_batch_sampler(loader, sharded, as_sampler), config)


def _check_combination(
    loader: DataLoader,
    config: DataLoaderConfiguration,
    world_size: int,
    dispatch: bool,
    slice_fn: Callable[..., Any] | None,
    sampler: Any,
) -> None:
    """Refuse the combinations that have no sensible meaning, saying why."""
    if slice_fn is not None and not dispatch:
        raise ValueError(
            "slice_fn_for_dispatch cuts the steps that rank 0 dispatches, but this DataLoader "
            "is not dispatched (dispatch_batches=False, or unset for a map-style dataset), so "
            "it would never be called. Pass dispatch_batches=True, or leave slice_fn out."
        )
    stream = isinstance(loader.dataset, IterableDataset)
    if world_size > 1 and not config.even_batches and (dispatch or stream):
        how = "dispatched" if dispatch else "an IterableDataset's"
        raise ValueError(
            f"even_batches=False cannot apply to {how} batches: every rank always gets a batch "
            "of every step, the last step topped up with the epoch's first samples (Accelerate "
            "ignores even_batches here; nbaccel refuses rather than ignore it). Use "
            "even_batches=True for the same batches as Accelerate, or DataLoader(..., "
            "drop_last=True) for no repeated samples."
        )
    if dispatch and world_size > 1 and isinstance(sampler, DistributedSampler):
        raise ValueError(
            "dispatch_batches=True with a DistributedSampler: the sampler already gives each "
            "rank its own share, so rank 0 would send its share to every rank. Use one or "
            "the other: a plain sampler with dispatch_batches=True, or the DistributedSampler "
            "with dispatch_batches=False."
        )
