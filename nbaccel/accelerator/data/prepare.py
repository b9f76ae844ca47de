"""``prepare_data_loader``: Accelerate's free function, for code that shards a DataLoader
without an Accelerator (``from accelerate.data_loader import prepare_data_loader``).

It takes Accelerate's parameters and gives the batches Accelerate gives; its loader is the one
``Accelerator.prepare`` builds (``sharding``), with a loop state of its own. Its sharded batch
sampler keeps Accelerate's shape: ``loader.batch_sampler.batch_sampler`` is the original batch
sampler, and ``.sampler`` below it the (seedable) sampler. The parameters nbaccel cannot honour
are refused with the reason; none is accepted and then ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from ...env import DistEnv
from .adapters import DataLoaderDispatcher, DataLoaderShard, comm_device
from .loader import LoopState, PreparedDataLoader
from .sharding import DataLoaderConfiguration, SharedSeed, shard_dataloader


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | str | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Sequence[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> PreparedDataLoader:
    """``dataloader`` for rank ``process_index`` of ``num_processes`` (default: the process
    group's, else torchrun's variables, else 1 process); batches on ``device`` when
    ``put_on_device`` and a device is given. ``dispatch_batches`` unset means: for an
    IterableDataset when ``put_on_device``, as in Accelerate.

    >>> loader = prepare_data_loader(DataLoader(range(8), batch_size=2), num_processes=2,
    ...                              process_index=1)
    >>> [batch.tolist() for batch in loader]
    [[2, 3], [6, 7]]
    """
    if rng_types:
        raise ValueError(
            f"rng_types={list(rng_types)!r} is not supported: Accelerate copies rank 0's RNG "
            "states to every rank at the start of each pass, so that the ranks shuffle alike. "
            "nbaccel's loader does that job itself (each epoch its shuffle takes rank 0's "
            "draw), and leaves the RNGs alone. Leave rng_types unset; to align RNG states "
            "yourself, call nbaccel.utils.synchronize_rng_states(rng_types)."
        )
    if torch_device_mesh is not None:
        raise ValueError(
            "torch_device_mesh is not supported: nbaccel has no tensor- or context-parallel "
            "ranks that share a batch; every rank is a data-parallel rank. Leave it None."
        )
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError(
            "dispatch_batches=True needs put_on_device=True: the dispatched batches are "
            "broadcast on the device (as in Accelerate). Pass put_on_device=True."
        )
    config = DataLoaderConfiguration(
        split_batches=split_batches,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
        non_blocking=non_blocking,
        use_stateful_dataloader=use_stateful_dataloader,
    )
    rank, world_size, grouped = _place(num_processes, process_index)
    comm = comm_device(device)
    if dispatch_batches and world_size > 1 and not grouped:
        raise ValueError(
            f"dispatch_batches=True on {world_size} processes needs their process group: rank "
            "0 broadcasts every batch. Initialise torch.distributed (an Accelerator does) with "
            f"{world_size} processes, this one rank {rank}, before preparing the loader."
        )
    shared_seed = None
    if grouped and world_size > 1:
        shared_seed = SharedSeed(comm)
        if use_seedable_sampler and data_seed is None:
            seed = [torch.initial_seed()]  # rank 0's, as Accelerator.prepare does
            dist.broadcast_object_list(seed, src=0)
            config = dataclasses.replace(config, data_seed=seed[0])
    sharded = shard_dataloader(
        dataloader,
        rank,
        world_size,
        shared_seed,
        config,
        device=comm,
        slice_fn=slice_fn_for_dispatch,
    )
    # as Accelerate: no device, no move (a dispatched batch arrives on ``comm`` anyway)
    target = torch.device(device) if put_on_device and device is not None else None
    kind = DataLoaderDispatcher if dispatch_batches else DataLoaderShard
    return kind.around(sharded, target, LoopState(), non_blocking=non_blocking)


def _place(num_processes: int | None, process_index: int | None) -> tuple[int, int, bool]:
    """This rank, the world size, and whether the process group is theirs."""
    if dist.is_available() and dist.is_initialized():
        group = (dist.get_rank(), dist.get_world_size())
    else:
        env = DistEnv.from_environ()
        group = (env.rank, env.world_size)
    rank = group[0] if process_index is None else process_index
    world_size = group[1] if num_processes is None else num_processes
    for name, value in (("num_processes", world_size), ("process_index", rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    if world_size < 1 or rank >= world_size:
        raise ValueError(
            f"process_index={rank} must be below num_processes={world_size} (and that >= 1)"
        )
    grouped = dist.is_available() and dist.is_initialized() and group == (rank, world_size)
    return rank, world_size, grouped
