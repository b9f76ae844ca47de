"""Saving that cannot half-happen, and checkpoints that load whole or not at all.

``atomic_save`` writes to a temporary file beside the target, flushes it to disk, then renames
it over the target: ``os.replace`` is atomic on POSIX and Windows, so a reader (or a crash) sees
the old file or the new one, never a mix.

A checkpoint written by ``save_state`` is a directory::

    nbaccel_state.json          what is inside (counts, step, world size, file names): last
    model.safetensors,          weights, without DDP's ``module.`` prefix, by Accelerate's
      model_1.safetensors ...   names (tied weights once: ``model_files``); with
                                ``safe_serialization=False``, pickled: model_0.pt, model_1.pt
    optimizer_0.pt ...          optimizer state (identical on every rank under DDP)
    scheduler_0.pt ...          learning-rate schedulers
    scaler.pt                   the fp16 GradScaler, when there is one
    rng_0.pt, rng_1.pt ...      each rank's random generators (python, numpy, torch, cuda)
    dataloaders_0.pt ...        each rank's prepared DataLoaders: epoch, and for a pass in
                                progress its batches so far and the RNG it began with
    custom_checkpoint_0.pt ...  the objects given to ``register_for_checkpointing``
    deepspeed/                  under DeepSpeed, the engine's own (sharded) checkpoint, in
                                place of model_*.pt and optimizer_*.pt

It is assembled in a staging directory and swapped in by rename, so an interrupted save leaves
the previous checkpoint in place. ``load_state`` reads and checks every file before it touches
a single object, and loads with ``weights_only=True`` (no code runs from a checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .model_files import atomic_write, load_safetensors, save_safetensors, with_aliases

logger = logging.getLogger(__name__)

MANIFEST = "nbaccel_state.json"
FORMAT = 3  # 2 added dataloaders_<rank>.pt and custom_checkpoint_<i>.pt; 3 model_files


def model_file(i: int, safe_serialization: bool) -> str:
    """Model ``i``'s file: Accelerate's safetensors names, or nbaccel's pickled ones."""
    if safe_serialization:
        return "model.safetensors" if i == 0 else f"model_{i}.safetensors"
    return f"model_{i}.pt"


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, but an interruption leaves the previous file intact."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def rng_state() -> dict[str, Any]:
    """Every generator a training loop may draw from, as data ``weights_only`` can load."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def restore(
    state: dict[str, Any],
    schedulers: Sequence[Any],
    scaler: Any,
    rank: int,
    custom: Sequence[Any] = (),
    loaders: Sequence[Any] = (),
) -> int:
    """Load what ``read_state`` read into the schedulers, the scaler, the registered objects,
    this rank's DataLoaders and RNGs; return the accumulation ``step`` it saved."""
    for i, obj in enumerate(custom):
        obj.load_state_dict(state[f"custom_checkpoint_{i}.pt"])
    for loader, loader_state in zip(loaders, state.get(f"dataloaders_{rank}.pt", ()), strict=False):
        loader.load_state_dict(loader_state)
    for i, scheduler in enumerate(schedulers):
        scheduler.load_state_dict(state[f"scheduler_{i}.pt"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler.pt"])
    if f"rng_{rank}.pt" in state:
        set_rng_state(state[f"rng_{rank}.pt"])
    return state["manifest"]["step"]


def _as_tuple(obj: Any) -> Any:
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, list | tuple) else obj


def save_state(
    directory: str | os.PathLike,
    *,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    schedulers: Sequence[Any],
    scaler: torch.amp.GradScaler | None,
    step: int,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    engine: Callable[[Path], None] | None = None,
    custom: Sequence[Any] = (),
    loaders: Sequence[Any] = (),
    counters: dict[str, int] | None = None,
    safe_serialization: bool = False,
    before_write: Callable[[list[dict], Path], None] | None = None,
) -> Path:
    """Write a checkpoint directory; every rank must call it (each saves its RNG state and its
    ``loaders``' states; rank 0 the rest). ``custom``: objects with ``state_dict``;
    ``counters``: numbers kept in the manifest (the optimizer steps taken).

    ``engine``, when given, is called on every rank with the staging directory to write a
    training engine's own checkpoint (DeepSpeed's, in ``deepspeed/``) beside nbaccel's files.
    ``before_write``, when given, is called on every rank with the models' state dicts and the
    staging directory before they are written (``register_save_state_pre_hook``'s hooks): it
    may write files there, and remove state dicts from the list to leave them unsaved.
    """
    final = Path(directory)
    staging = final.with_name(f".{final.name}.staging")
    if rank == 0:
        if not final.parent.is_dir():
            raise FileNotFoundError(
                f"cannot save a checkpoint to {final}: the folder {final.parent} does not exist"
            )
        shutil.rmtree(staging, ignore_errors=True)  # left by an earlier interrupted save
        staging.mkdir()
    barrier()
    atomic_save(rng_state(), staging / f"rng_{rank}.pt")
    atomic_save([loader.state_dict() for loader in loaders], staging / f"dataloaders_{rank}.pt")
    if engine is not None:
        engine(staging)
    weights = [model.state_dict() for model in models]
    if before_write is not None:
        before_write(weights, staging)
    model_files = [model_file(i, safe_serialization) for i in range(len(weights))]
    if rank == 0:
        for weight, name in zip(weights, model_files, strict=True):
            if safe_serialization:
                save_safetensors(weight, staging / name)
            else:
                atomic_save(weight, staging / name)
        for i, optimizer in enumerate(optimizers):
            atomic_save(optimizer.state_dict(), staging / f"optimizer_{i}.pt")
        for i, scheduler in enumerate(schedulers):
            atomic_save(scheduler.state_dict(), staging / f"scheduler_{i}.pt")
        if scaler is not None:
            atomic_save(scaler.state_dict(), staging / "scaler.pt")
        for i, obj in enumerate(custom):
            atomic_save(obj.state_dict(), staging / f"custom_checkpoint_{i}.pt")
    barrier()  # every rank's RNG file is in place
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size,
            "models": len(weights),
            "model_files": model_files,
            "optimizers": len(optimizers),
            "schedulers": len(schedulers),
            "scaler": scaler is not None,
            "engine": "deepspeed" if engine is not None else None,
            "custom": len(custom),
            "dataloaders": len(loaders),
            **(counters or {}),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _swap_in(staging, final)
    barrier()
    return final


def _swap_in(staging: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def read_state(
    directory: str | os.PathLike,
    *,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    schedulers: Sequence[Any],
    scaler: torch.amp.GradScaler | None,
    rank: int,
    engine: tuple[str, int] | None = None,
    custom: Sequence[Any] = (),
    loaders: Sequence[Any] = (),
) -> dict[str, Any]:
    """Read and check a whole checkpoint; raise ``CheckpointError`` before anything is applied.

    ``engine``: ``(folder, world_size)`` of a DeepSpeed engine's checkpoint expected inside,
    which the engine itself loads afterwards.
    """
    folder = Path(directory)
    if not folder.is_dir():
        hint = ""
        if folder.with_name(f".{folder.name}.old").is_dir():
            hint = (
                " A save was interrupted while swapping folders; the previous checkpoint is in "
                f".{folder.name}.old: rename it back to {folder.name}."
            )
        raise CheckpointError(f"no checkpoint at {folder}: the folder does not exist.{hint}")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder} is not a complete checkpoint: {MANIFEST} is missing (save_state writes "
            "it last, so the save was interrupted or this folder was not written by save_state)."
        ) from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{folder / MANIFEST} is corrupt: {err}") from err

    saved_by = "DeepSpeed" if manifest.get("engine") == "deepspeed" else "DDP or FSDP"
    wanted = "DeepSpeed" if engine is not None else "DDP or FSDP"
    if saved_by != wanted:
        raise CheckpointError(
            f"{folder} was saved by a run with {saved_by}, but this Accelerator trains with "
            f"{wanted}: load it with the same strategy as the run that saved it."
        )
    if engine is not None:
        tag, world_size = engine
        if manifest["world_size"] != world_size:
            raise CheckpointError(
                f"{folder} holds a DeepSpeed checkpoint sharded over {manifest['world_size']} "
                f"processes; it loads on {manifest['world_size']}, not {world_size}."
            )
        if not (folder / tag).is_dir():
            raise CheckpointError(f"{folder} is incomplete: the folder {tag}/ is missing.")
    objects = {"models": models, "optimizers": optimizers, "schedulers": schedulers}
    if manifest.get("format", 1) >= 2:  # format 1 had no loaders and no registered objects
        objects.update(custom=custom)
        if manifest["dataloaders"] != len(loaders):  # evaluating a checkpoint needs none
            logger.warning(
                "%s holds %d DataLoaders' places and %d were prepared: those in both are "
                "restored in order, and a resumed epoch may read other batches",
                folder,
                manifest["dataloaders"],
                len(loaders),
            )
    elif custom:
        raise CheckpointError(
            f"{folder} was written before register_for_checkpointing existed and holds none of "
            f"the {len(custom)} registered objects."
        )
    _check_counts(folder, manifest, **objects)
    if manifest["scaler"] != (scaler is not None):
        saved = "with" if manifest["scaler"] else "without"
        raise CheckpointError(
            f"{folder} was saved {saved} an fp16 GradScaler, but this Accelerator "
            f"{'has one' if scaler is not None else 'has none'}: use the same mixed_precision "
            "as the run that saved it."
        )
    model_files = manifest.get("model_files") or [model_file(i, False) for i in range(len(models))]
    names = list(model_files)
    names += [f"optimizer_{i}.pt" for i in range(len(optimizers))]
    names += [f"scheduler_{i}.pt" for i in range(len(schedulers))]
    names += ["scaler.pt"] if scaler is not None else []
    names += [f"custom_checkpoint_{i}.pt" for i in range(len(custom))]
    if rank < manifest["world_size"]:
        names.append(f"rng_{rank}.pt")
        names += [f"dataloaders_{rank}.pt"] if manifest.get("format", 1) >= 2 else []
    else:
        logger.warning(
            "%s was saved by %d processes; rank %d keeps its own RNG state",
            folder,
            manifest["world_size"],
            rank,
        )
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is incomplete: missing {', '.join(missing)}.")
    loaded = {name: _load(folder / name) for name in names}
    for i, (model, name) in enumerate(zip(models, model_files, strict=True)):
        state = loaded.pop(name)
        if name.endswith(".safetensors"):  # tied weights were saved once
            state = with_aliases(state, model.state_dict())
        _check_model(folder / name, state, model)
        loaded[f"model_{i}.pt"] = state  # model i's state, whichever file held it
    return {"manifest": manifest, **loaded}


def _check_counts(folder: Path, manifest: dict, **objects: Sequence[Any]) -> None:
    for kind, objs in objects.items():
        if manifest.get(kind) != len(objs):
            raise CheckpointError(
                f"{folder} holds {manifest.get(kind)} {kind}, but {len(objs)} were prepared: "
                f"prepare the same {kind} in the same order as the run that saved it."
            )


def _load(path: Path) -> Any:
    if path.suffix == ".safetensors":
        try:
            return load_safetensors(path)
        except ImportError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"{path} is corrupt or truncated and cannot be loaded: {err}"
            ) from err
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():
            raise CheckpointError(f"{path} is corrupt and cannot be loaded: {err}") from err
        raise CheckpointError(
            f"{path} holds an object that loading with weights_only=True refuses (no code runs "
            "from a checkpoint): keep state_dict() to tensors, numbers, strings, lists and "
            f"dicts. torch said: {str(err).splitlines()[0]}"
        ) from err
    except Exception as err:
        raise CheckpointError(
            f"{path} is corrupt or truncated and cannot be loaded: {err}"
        ) from err


def _check_model(path: Path, state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    problems = [f"missing {k}" for k in expected if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    problems += [
        f"{k}: saved {tuple(state[k].shape)}, model has {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and hasattr(state[k], "shape") and state[k].shape != v.shape
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
        raise CheckpointError(f"{path} does not fit the prepared model: {shown}")
