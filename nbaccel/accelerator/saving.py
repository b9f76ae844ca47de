"""What the Accelerator's file methods do: ``save``, ``save_state``/``load_state``, and the
objects they keep.

The methods themselves, with their docstrings, are in ``accelerator.py``; each hands this
module what it needs by name: the strategy, the objects a checkpoint holds (``Checkpointed``),
the process facts (the ``PartialState`` the strategies are given too) and the folders'
configuration. Nothing here knows the Accelerator, so nothing here imports it. What a
checkpoint folder holds is in ``checkpoint``; how folders are named, in ``project``; model
files by Hugging Face's names (``save_model``, safetensors), in ``model_files``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.nn import DataParallel, Module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from . import checkpoint, model_files, project
from .data.loader import PreparedDataLoader, SkippedDataLoader

if TYPE_CHECKING:
    import torch

    from .project import ProjectConfiguration
    from .state import PartialState
    from .strategies.base import Strategy


@dataclass
class StateHooks:
    """The hooks ``register_save_state_pre_hook`` and ``register_load_state_pre_hook`` keep,
    in the order they were registered; each is removed by its handle."""

    save: OrderedDict[int, Callable[..., None]] = field(default_factory=OrderedDict)
    load: OrderedDict[int, Callable[..., None]] = field(default_factory=OrderedDict)

    def add(self, kind: str, hook: Callable[..., None]) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"register_{kind}_state_pre_hook() takes a function, not {hook!r}")
        hooks = getattr(self, kind)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle


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
    prepared: list[torch.nn.Module] = field(default_factory=list)  # as the hooks get them
    hooks: StateHooks = field(default_factory=StateHooks)


def save(
    strategy: Strategy,
    obj: Any,
    path: str | os.PathLike,
    is_main_process: bool,
    safe_serialization: bool = False,
) -> None:
    """``obj`` gathered whole by ``strategy`` (every rank calls this), then written by the main
    process only, atomically: pickled, or with ``safe_serialization`` as safetensors (a dict of
    tensors, tied weights once)."""
    obj = strategy.for_save(obj)
    if not is_main_process:
        return
    if safe_serialization:
        model_files.save_safetensors(obj, path)
    else:
        checkpoint.atomic_save(obj, path)


def state_dict(strategy: Strategy, model: torch.nn.Module, unwrap: bool) -> dict[str, Any]:
    """The model's whole state dict (every rank calls this); with ``unwrap=False`` a DDP or
    ``torch.compile`` wrapper's own, its keys prefixed (``module.``, ``_orig_mod.``)."""
    ddp = isinstance(model, DistributedDataParallel | DataParallel)
    if not unwrap and (ddp or isinstance(getattr(model, "_orig_mod", None), Module)):
        return model.state_dict()
    return strategy.state_dict(model)


def save_model(
    strategy: Strategy,
    model: torch.nn.Module,
    folder: str | os.PathLike,
    max_shard_size: int | str,
    safe_serialization: bool,
    is_main_process: bool,
) -> None:
    """``Accelerator.save_model``: the unwrapped model's whole state dict (every rank calls
    this: gathering a sharded model is a collective) into ``folder``, by Hugging Face's names."""
    if Path(folder).is_file():
        raise ValueError(f"save_model() saves into a folder; {folder} is a file")
    model_files.shard_size(max_shard_size)  # checked on every rank, before any work
    state = model_files.offloaded_state_dict(model)
    if state is None:
        meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if meta:
            raise RuntimeError(
                f"save_model() cannot save {', '.join(meta[:3])}: on the meta device, the "
                "parameters hold no values. Load or initialize the weights first."
            )
        state = strategy.state_dict(model)
    model_files.save_model(state, folder, max_shard_size, safe_serialization, is_main_process)


def checkpointable(objects: Iterable[Any]) -> list[Any]:
    """``objects``, each checked to have ``state_dict`` and ``load_state_dict``; a
    ``ValueError`` (Accelerate's type) names each one without them by its position."""
    objects = list(objects)
    lacking = [
        f"\n  - Item at index {i}, a {type(obj).__module__}.{type(obj).__qualname__}"
        for i, obj in enumerate(objects)
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))
    ]
    if lacking:
        raise ValueError(
            "register_for_checkpointing() takes objects with state_dict() and "
            "load_state_dict() methods (a model, an optimizer, your own class with both); "
            f"these lack them:{''.join(lacking)}\nPass a tensor inside such an object, or "
            "as one of a module's buffers."
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
    safe_serialization: bool = True,
    save_model_func_kwargs: dict[str, Any] | None = None,
) -> str:
    """Write ``held`` into ``output_dir`` (or the folder ``held.config`` names, then prune the
    oldest), with the accumulation ``step`` and the run's ``optimizer_steps``; return the
    folder. The save hooks get the prepared models, their state dicts and the folder being
    written (the staging folder that becomes it whole)."""
    if save_model_func_kwargs:
        raise TypeError(
            f"save_state() got {', '.join(save_model_func_kwargs)}: in Accelerate such keyword "
            "arguments go to DeepSpeed's save_checkpoint, which nbaccel calls itself; leave "
            "them out."
        )
    if not isinstance(safe_serialization, bool):
        raise TypeError(f"safe_serialization={safe_serialization!r} must be True or False")
    folder = project.save_folder(held.config, output_dir)

    def before_write(weights: list[dict], staging: Path) -> None:
        for hook in list(held.hooks.save.values()):
            hook(list(held.prepared), weights, str(staging))

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
        safe_serialization=safe_serialization,
        before_write=before_write if held.hooks.save else None,
    )
    if output_dir is None:
        project.saved(held.config, folder, process.is_main_process)
    return str(folder)


_MAP_LOCATIONS = (None, "cpu", "on_device")


def load_state(
    held: Checkpointed,
    input_dir: str | os.PathLike | None,
    rank: int,
    load_kwargs: dict[str, Any] | None = None,
    load_model_func_kwargs: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """Restore ``held`` from ``input_dir`` (or the newest complete automatic checkpoint);
    return the accumulation step and the optimizer steps it saved. The load hooks get the
    prepared models and the folder first; a model a hook removes from the list is not loaded.
    """
    options = dict(load_model_func_kwargs or {})
    location = options.pop("map_location", None)
    if location not in _MAP_LOCATIONS:
        raise TypeError(
            f"Unsupported optimizer map location passed: map_location={location!r}; choose "
            "None, 'cpu' or 'on_device' (the states go where the prepared objects are anyway)."
        )
    if options or any(k != "weights_only" or v is not True for k, v in (load_kwargs or {}).items()):
        given = ", ".join([*options, *(load_kwargs or {})])
        raise TypeError(
            f"load_state() got {given}: nbaccel loads every file with weights_only=True and "
            "takes only map_location; leave the others out."
        )
    folder = project.load_folder(held.config, input_dir)
    models = held.models
    if held.hooks.load:
        prepared = list(held.prepared)
        for hook in list(held.hooks.load.values()):
            hook(prepared, str(folder))
        models = [m for p, m in zip(held.prepared, held.models, strict=True) if _kept(p, prepared)]
    extra = {"custom": held.registered, "loaders": held.loaders}
    state = held.strategy.load_state(
        folder,
        models,
        held.optimizers,
        held.schedulers,
        scaler=held.scaler,
        rank=rank,
        **extra,
    )
    step = checkpoint.restore(state, held.schedulers, held.scaler, rank, **extra)
    return step, state["manifest"].get("optimizer_steps", 0)


def _kept(model: Any, models: list[Any]) -> bool:
    return any(m is model for m in models)
