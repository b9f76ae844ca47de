"""An IterableDataset read by every rank, each keeping its own share: Accelerate's
``IterableDatasetShard``, for a stream that is not dispatched (``dispatch_batches=False``).

A stream has no indices to deal out, so every rank reads the whole stream and keeps its part of
each *global step*: ``batch_size * world_size`` consecutive samples (``split_batches``:
``batch_size``), of which rank ``r`` keeps the ``r``-th slice. The ranks' slices of a step, in
rank order, are the step itself. The last, short step is topped up with the stream's first
step (repeated as often as needed, for a stream shorter than one step), so every rank yields
whole batches and runs the same number of steps; with ``drop_last`` it is dropped instead.
``remainder`` then counts the real samples of that step, for ``gather_for_metrics``.

Every rank pays for reading the whole stream. When the stream is expensive to read, or each
sample's reading must happen once, dispatch it instead (``dispatch.DispatchedDataLoader``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset


class IterableDatasetShard(IterableDataset):
    """The samples of ``dataset`` that rank ``process_index`` of ``num_processes`` keeps.

    ``batch_size`` is the DataLoader's (the whole step's with ``split_batches``). Accelerate's
    name and arguments, so code that builds one keeps working.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"a DataLoader over an IterableDataset with batch_size={batch_size!r} cannot be "
                f"sharded across {num_processes} processes: its global steps are counted in "
                "samples. Give the DataLoader batch_size=<an int >= 1>."
            )
        if split_batches and batch_size % num_processes:
            raise ValueError(
                f"split_batches=True cuts each batch of {batch_size} samples into "
                f"{num_processes} equal slices, so batch_size must be a multiple of "
                f"{num_processes}; use split_batches=False or another batch_size."
            )
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.num_processes, self.process_index = num_processes, process_index
        self.split_batches = split_batches
        self.epoch = 0
        self.remainder: int | None = None  # set when a pass ends (read in this process only)

    @property
    def step_size(self) -> int:
        """Samples in one global step, all ranks together."""
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this rank yields in a pass (needs a sized stream, as ``len`` does)."""
        steps, short = divmod(len(self.dataset), self.step_size)
        steps += int(bool(short) and not self.drop_last)
        return steps * (self.step_size // self.num_processes)

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)  # as Accelerate: a stream's own RNG, per epoch
        self.remainder = None
        size = self.step_size
        piece = size // self.num_processes
        mine = slice(self.process_index * piece, (self.process_index + 1) * piece)
        first: list[Any] | None = None
        step: list[Any] = []
        for sample in self.dataset:
            step.append(sample)
            if len(step) == size:
                yield from step[mine]
                first = first or step
                step = []
        if step and not self.drop_last:
            self.remainder = len(step)
            head = first or list(step)
            while len(step) < size:
                step += head
            yield from step[mine]

    def real_samples_of_last_step(self) -> int | None:
        """``remainder`` as the loader knows it: set by the pass itself when it ran in this
        process; from ``len`` when DataLoader workers ran it (a sized stream); else None."""
        if self.remainder is not None or self.drop_last:
            return self.remainder
        try:
            short = len(self.dataset) % self.step_size
        except TypeError:
            return None
        return short or None
