"""The Accelerator's files: ``save``, ``save_state``/``load_state`` and what they keep.

Each function here is a method of the ``Accelerator``, written in this module to keep
``accelerator.py`` one sitting's read: its first argument, ``self``, is the Accelerator, and
the class assigns the function to its name (``save_state = saving.save_state``). They read
what the Accelerator holds (its strategy, its prepared objects, its process facts) and keep
nothing of their own. What a checkpoint
folder holds is in ``checkpoint``; how folders are named, in ``project``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from . import checkpoint, project
from .data.loader import PreparedDataLoader, SkippedDataLoader

if TYPE_CHECKING:
    from .accelerator import Accelerator


def save(self: Accelerator, obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` on the main process only, atomically (temporary file, then rename).

    Sharded tensors (FSDP) and a DeepSpeed model's state dict (recognised by its keys) are
    gathered whole first, so every rank must call it then, as
    ``accelerator.save(accelerator.unwrap_model(model).state_dict(), path)`` is.
    """
    obj = self.strategy.for_save(obj)
    if self.is_main_process:
        checkpoint.atomic_save(obj, path)


def register_for_checkpointing(self: Accelerator, *objects: Any) -> None:
    """Keep ``objects`` (anything with ``state_dict``/``load_state_dict``: an epoch counter,
    an EMA) in every ``save_state``, restored by ``load_state`` in this order."""
    for obj in objects:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(
                "register_for_checkpointing() takes objects with state_dict() and "
                f"load_state_dict(); a {type(obj).__name__} lacks them"
            )
    self._registered.extend(objects)


def skip_first_batches(self: Accelerator, dataloader: Any, num_batches: int = 0) -> Any:
    """The prepared ``dataloader``'s next pass without its first ``num_batches`` batches:
    after ``load_state``, the rest of the interrupted epoch, in the order it had."""
    if not isinstance(dataloader, PreparedDataLoader | SkippedDataLoader):
        raise TypeError("skip_first_batches() takes a DataLoader that prepare() returned")
    return dataloader.skip(num_batches)


def save_state(self: Accelerator, output_dir: str | os.PathLike | None = None) -> None:
    """Checkpoint models, optimizers, schedulers, scaler, RNG states, ``step``, the registered
    objects and where each prepared DataLoader stands.

    Every rank must call it. The directory is replaced whole, or not at all. With no folder,
    ``ProjectConfiguration(automatic_checkpoint_naming=True)`` names it.
    """
    config = self.project_configuration
    folder = project.save_folder(config, output_dir)
    self._trackers.flush()  # a resumed run's records go on from here, none missing
    self.strategy.save_state(
        folder,
        *_checkpointed(self),
        scaler=self.scaler,
        rank=self.rank,
        step=self.step,
        world_size=self.num_processes,
        barrier=self.wait_for_everyone,
        custom=self._registered,
        loaders=self._dataloaders,
        counters={"optimizer_steps": self._steps_before + self.recorder.optimizer_steps},
    )
    if output_dir is None:
        project.saved(config, folder, self.is_main_process)


def load_state(self: Accelerator, input_dir: str | os.PathLike | None = None) -> None:
    """Restore what ``save_state`` wrote, after preparing the same objects in the same order
    (with no folder: the newest complete automatic checkpoint).

    Raises ``CheckpointError`` (a ``ValueError``) for a missing, partial or corrupt
    checkpoint, before any object is changed. Files load with ``weights_only=True``.
    """
    folder = project.load_folder(self.project_configuration, input_dir)
    models, optimizers, schedulers = _checkpointed(self)
    extra = {"custom": self._registered, "loaders": self._dataloaders}
    state = self.strategy.load_state(
        folder,
        models,
        optimizers,
        schedulers,
        scaler=self.scaler,
        rank=self.rank,
        **extra,
    )
    self.step = checkpoint.restore(state, schedulers, self.scaler, self.rank, **extra)
    steps = state["manifest"].get("optimizer_steps", 0)  # the trackers' step counts on
    self._steps_before = steps - self.recorder.optimizer_steps


def _checkpointed(self: Accelerator) -> tuple[list, list, list]:
    """The user's models, optimizers and schedulers, as a checkpoint holds them."""
    return (
        [self.unwrap_model(m) for m in self._models],
        [o.optimizer for o in self._optimizers],
        [s.scheduler for s in self._schedulers],
    )
