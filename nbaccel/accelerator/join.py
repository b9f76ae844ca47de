"""Uneven inputs: when some ranks run out of batches before the others.

DDP's all-reduce needs every rank, so a rank that stopped early would leave the others waiting
forever. torch's ``Join`` lets the finished ranks stand in: they answer each all-reduce with
zeros (so a late step's gradient is divided by all the ranks), and DDP copies the final weights
to every rank at the end. ``Accelerator.join_uneven_inputs`` is this context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch.distributed.algorithms import Join, Joinable

from .data.loader import PreparedDataLoader
from .data.samplers import ShardedBatchSampler


@contextlib.contextmanager
def join_uneven(
    joinables: Sequence[Any],
    loaders: Sequence[PreparedDataLoader],
    even_batches: bool | None,
    default: bool,
) -> Iterator[None]:
    """Join ``joinables`` when the batches are uneven: ``even_batches``, else ``default`` (the
    ``DataLoaderConfiguration``'s), which ``even_batches`` also overrides inside the block in
    the prepared ``loaders``' samplers."""
    samplers = [
        d.loader.batch_sampler
        for d in loaders
        if isinstance(d.loader.batch_sampler, ShardedBatchSampler)
    ]
    saved = [s.even_batches for s in samplers]
    if even_batches is not None:
        for sampler in samplers:
            sampler.even_batches = even_batches
    uneven = not (default if even_batches is None else even_batches)
    for joinable in joinables if uneven else ():
        if not isinstance(joinable, Joinable):
            raise TypeError(
                f"join_uneven_inputs joins what torch's Join can (a DDP model, "
                f"ZeroRedundancyOptimizer); got a {type(joinable).__name__}. FSDP and "
                "DeepSpeed need even batches: use DataLoaderConfiguration(even_batches=True)."
            )
    try:
        with Join(list(joinables), enable=uneven, throw_on_early_termination=False):
            yield
    finally:
        for sampler, value in zip(samplers, saved, strict=True):
            sampler.even_batches = value
