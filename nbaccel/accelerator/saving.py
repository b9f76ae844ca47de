"""What the Accelerator's file methods do: ``save``, ``save_state``/``load_state``, and the
objects they keep.

The methods themselves, with their docstrings, are in ``accelerator.py``; each hands this
module what it needs by name: the strategy, the objects a checkpoint holds (``Checkpointed``),
the process facts (the ``PartialState`` the strategies are given too) and the folders'
configuration. Nothing here knows the Accelerator, so nothing here imports it. What a
checkpoint folder holds is in ``checkpoint``; how folders are named, in ``project``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import checkpoint, project
from .data.loader import PreparedDataLoader, SkippedDataLoader

if TYPE_CHECKING:
    import torch

    from .project import ProjectConfiguration
    from .state import PartialState
    from .strategies.base import Strategy


@dataclass(frozen=True)
class Checkpointed:
    """What ``save_state`` writes and ``load_state`` restores: the user's models, optimizers
    and schedulers as a checkpoint holds them (unwrapped), the prepared DataLoaders, the
    objects given to ``register_for_checkpointing``, and the fp16 GradScaler; through
    ``strategy``, into the folders ``config`` names."""

    strategy: Strategy
    config: ProjectConfiguration
    models: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    loaders: list[PreparedDataLoader]
    registered: list[Any]
    scaler: torch.amp.GradScaler | None


def save(strategy: Strategy, obj: Any, path: str | os.PathLike, is_main_process: bool) -> None:
    """``obj`` gathered whole by ``strategy`` (every rank calls this), then written by the main
    process only, atomically."""
    obj = strategy.for_save(obj)
    if is_main_process:
        checkpoint.atomic_save(obj, path)


def checkpointable(objects: Iterable[Any]) -> list[Any]:
    """``objects``, each checked to have ``state_dict`` and ``load_state_dict``."""
    objects = list(objects)
    for obj in objects:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(
                "register_for_checkpointing() takes objects with state_dict() and "
                f"load_state_dict(); a {type(obj).__name__} lacks them"
            )
    return objects


def skip_first_batches(dataloader: Any, num_batches: int) -> Any:
    """The prepared ``dataloader``'s next pass without its first ``num_batches`` batches."""
    if not isinstance(dataloader, PreparedDataLoader | SkippedDataLoader):
        raise TypeError("skip_first_batches() takes a DataLoader that prepare() returned")
    return dataloader.skip(num_batches)


def save_state(
    held: Checkpointed,
    output_dir: str | os.PathLike | None,
    process: PartialState,
    step: int,
    optimizer_steps: int,
) -> None:
    """Write ``held`` into ``output_dir`` (or the folder ``held.config`` names, then prune the
    oldest), with the accumulation ``step`` and the run's ``optimizer_steps``."""
    folder = project.save_folder(held.config, output_dir)
    held.strategy.save_state(
        folder,
        held.models,
        held.optimizers,
        held.schedulers,
        scaler=held.scaler,
        rank=process.rank,
        step=step,
        world_size=process.num_processes,
        barrier=process.wait_for_everyone,
        custom=held.registered,
        loaders=held.loaders,
        counters={"optimizer_steps": optimizer_steps},
    )
    if output_dir is None:
        project.saved(held.config, folder, process.is_main_process)


def load_state(
    held: Checkpointed, input_dir: str | os.PathLike | None, rank: int
) -> tuple[int, int]:
    """Restore ``held`` from ``input_dir`` (or the newest complete automatic checkpoint);
    return the accumulation step and the optimizer steps it saved."""
    folder = project.load_folder(held.config, input_dir)
    extra = {"custom": held.registered, "loaders": held.loaders}
    state = held.strategy.load_state(
        folder,
        held.models,
        held.optimizers,
        held.schedulers,
        scaler=held.scaler,
        rank=rank,
        **extra,
    )
    step = checkpoint.restore(state, held.schedulers, held.scaler, rank, **extra)
    return step, state["manifest"].get("optimizer_steps", 0)
