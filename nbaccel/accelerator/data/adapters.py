"""Accelerate's DataLoader classes, by their names and constructor arguments, on nbaccel's
prepared loader (``loader.PreparedDataLoader``): ``DataLoaderShard`` (this rank's batches, on
its device), ``DataLoaderDispatcher`` (rank 0 reads, every rank gets its slice),
``SkipDataLoader`` (each pass without its first batches) and ``skip_first_batches``.

``Accelerator.prepare`` returns a ``DataLoaderShard`` (a ``DataLoaderDispatcher`` when
``dispatch_batches``) around the sharded loader; built directly, each takes a dataset and the
``DataLoader`` arguments, as Accelerate's do. As in Accelerate, ``isinstance(loader,
DataLoader)`` holds (``StatefulDataLoader`` with ``use_stateful_dataloader=True``), through
the loader's ``__class__``; ``type(loader)`` is the nbaccel class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from ..current import GradientState
from .dispatch import DispatchedDataLoader
from .loader import LoopState, PreparedDataLoader, SkippedDataLoader, workers_of
from .resumable import is_stateful, stateful_loader_class
from .samplers import SkipBatchSampler


class _Adapter(PreparedDataLoader):
    """What the three classes share: how they are built around a loader."""

    @classmethod
    def around(
        cls,
        loader: Any,
        device: torch.device | None,
        state: LoopState,
        recorder: Any = None,
        *,
        non_blocking: bool = False,
    ) -> Any:
        """One of these around an already sharded ``loader`` (what ``prepare`` builds)."""
        made = cls.__new__(cls)
        PreparedDataLoader.__init__(
            made, loader, device, state, recorder, non_blocking=non_blocking
        )
        return made

    @property
    def iteration(self) -> int:
        """Accelerate's name for ``epoch``: the epoch of the next (or current) pass."""
        return self.epoch

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.epoch = value

    @property
    def use_stateful_dataloader(self) -> bool:
        return self._stateful is not None

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global step, every rank's together (None: batches vary in size)."""
        size = self.batch_size
        if size is None:
            return None
        holders = (self.loader, self._batches, self.loader.dataset)
        for holder in holders:  # dispatched, sharded batch sampler, IterableDatasetShard
            processes = getattr(holder, "world_size", getattr(holder, "num_processes", None))
            if isinstance(processes, int):
                return size * processes
        return size

    @property
    def total_dataset_length(self) -> int:
        """Samples in the whole dataset (an IterableDatasetShard's: the stream's)."""
        dataset = self.loader.dataset
        return len(
            getattr(dataset, "dataset", dataset) if hasattr(dataset, "step_size") else dataset
        )

    @property
    def gradient_state(self) -> GradientState:
        """Accelerate's ``GradientState`` of the newest Accelerator (a window onto it)."""
        return GradientState()


def _base(dataset: Any, use_stateful_dataloader: bool, kwargs: dict[str, Any]) -> DataLoader:
    if not isinstance(use_stateful_dataloader, bool):
        raise TypeError(f"use_stateful_dataloader={use_stateful_dataloader!r} must be a bool")
    kind = stateful_loader_class() if use_stateful_dataloader else DataLoader
    return kind(dataset, **kwargs)


def _check_skip(skip_batches: Any) -> int:
    if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0:
        raise ValueError(f"skip_batches={skip_batches!r} must be an int >= 0")
    return skip_batches


def _refuse(rng_types: Any = None, synchronized_generator: Any = None, mesh: Any = None) -> None:
    if rng_types or synchronized_generator is not None:
        raise ValueError(
            "rng_types / synchronized_generator are not supported: Accelerate copies rank 0's "
            "RNG states to every rank at the start of each pass; nbaccel's loader makes the "
            "ranks shuffle alike itself and leaves the RNGs alone. Leave them unset; to align "
            "RNG states yourself, call nbaccel.utils.synchronize_rng_states(rng_types)."
        )
    if mesh is not None:
        raise ValueError(
            "torch_device_mesh is not supported: nbaccel has no tensor- or context-parallel "
            "ranks that share a batch; every rank is a data-parallel rank. Leave it None."
        )


class DataLoaderShard(_Adapter):
    """Accelerate's ``DataLoaderShard``: a DataLoader whose batches go to ``device``, that
    knows its last batch (``end_of_dataloader``) and counts its passes (``iteration``).

    >>> [batch.tolist() for batch in DataLoaderShard(range(6), batch_size=4)]
    [[0, 1, 2, 3], [4, 5]]
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device | str | None = None,
        rng_types: Any = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        _refuse(rng_types, synchronized_generator, torch_device_mesh)
        base = _base(dataset, use_stateful_dataloader, kwargs)
        where = None if device is None else torch.device(device)
        super().__init__(base, where, LoopState(), non_blocking=_non_blocking)
        self.skip_batches, self.epoch = _check_skip(skip_batches), iteration


def comm_device(device: torch.device | str | None) -> torch.device:
    """Where a broadcast happens: the given device, else the process group's (CUDA for NCCL)."""
    if device is not None:
        return torch.device(device)
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DataLoaderDispatcher(_Adapter):
    """Accelerate's ``DataLoaderDispatcher``: rank 0 reads each global step and every rank
    gets its slice (``dispatch.DispatchedDataLoader``; one process reads its own batches).

    >>> [batch.tolist() for batch in DataLoaderDispatcher(range(6), batch_size=4)]
    [[0, 1, 2, 3], [4, 5]]
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Callable[..., Any] | None = None,
        torch_device_mesh: Any = None,
        **kwargs: Any,
    ) -> None:
        _refuse(mesh=torch_device_mesh)
        loader: Any = _base(dataset, use_stateful_dataloader, kwargs)
        grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if grouped:
            if use_stateful_dataloader:
                raise ValueError(STATEFUL_DISPATCH)
            rank, world_size = dist.get_rank(), dist.get_world_size()
            device = comm_device(None)
            loader = DispatchedDataLoader(
                loader, rank, world_size, device, split_batches=split_batches, slice_fn=slice_fn
            )
        super().__init__(loader, None, LoopState(), non_blocking=_non_blocking)
        self.skip_batches = _check_skip(skip_batches)


STATEFUL_DISPATCH = (
    "use_stateful_dataloader=True with dispatch_batches=True on several processes is not "
    "supported: rank 0 reads every rank's batches ahead of them, so its StatefulDataLoader's "
    "state would not say where each rank stands. Use dispatch_batches=False (each rank reads "
    "its own shard, and its state resumes exactly), or use_stateful_dataloader=False and "
    "accelerator.skip_first_batches after load_state."
)


class SkipDataLoader(_Adapter):
    """Accelerate's ``SkipDataLoader``: a DataLoader whose every pass leaves out its first
    ``skip_batches`` batches (they are read, then dropped).

    >>> [batch.tolist() for batch in SkipDataLoader(range(6), batch_size=2, skip_batches=2)]
    [[4, 5]]
    """

    def __init__(
        self,
        dataset: Any,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> None:
        base = _base(dataset, use_stateful_dataloader, kwargs)
        super().__init__(base, None, LoopState())
        self.skip_batches = _check_skip(skip_batches)

    def __len__(self) -> int:
        return max(len(self.loader) - self.skip_batches, 0)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """``dataloader`` without its first ``num_batches`` batches, as Accelerate's function.

    A prepared loader (``DataLoaderShard``...): its next pass, in the order a checkpoint saved
    (``loader.SkippedDataLoader``). A torch DataLoader: a new one whose batch sampler skips
    them (``SkipBatchSampler``); one over an IterableDataset, or with no batch sampler, a
    ``SkipDataLoader`` that reads and drops them.
    """
    if isinstance(dataloader, PreparedDataLoader | SkippedDataLoader):
        return dataloader.skip(num_batches)
    if type(dataloader) is not DataLoader and not is_stateful(dataloader):
        raise TypeError(
            "skip_first_batches() takes a torch DataLoader or a loader that prepare() "
            f"returned; got a {type(dataloader).__module__}.{type(dataloader).__qualname__}"
        )
    num_batches = _check_skip(num_batches)
    stateful = is_stateful(dataloader)
    workers = workers_of(dataloader)
    if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_sampler is None:
        where: dict[str, Any] = {"batch_size": dataloader.batch_size}
        if dataloader.batch_sampler is None and not isinstance(dataloader.dataset, IterableDataset):
            where["sampler"] = dataloader.sampler
        else:
            where["drop_last"] = dataloader.drop_last
        return SkipDataLoader(
            dataloader.dataset,
            skip_batches=num_batches,
            use_stateful_dataloader=stateful,
            **where,
            **workers,
        )
    kind = type(dataloader)
    sampler = SkipBatchSampler(dataloader.batch_sampler, skip_batches=num_batches)
    return kind(dataloader.dataset, batch_sampler=sampler, **workers)
