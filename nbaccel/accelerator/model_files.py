"""Model files as Hugging Face writes them: safetensors or pickle, whole or in shards.

``save_model`` writes a state dict into a folder by Accelerate's (and transformers') names, so
``accelerate.load_checkpoint_in_model`` and ``from_pretrained`` read it::

    model.safetensors                       whole, safetensors (pytorch_model.bin with pickle)
    model-00001-of-00003.safetensors ...    over max_shard_size: shards, filled in key order,
    model.safetensors.index.json            and the index naming each key's shard

safetensors refuses two names for one tensor, which tied weights are (an output layer sharing
its embedding's matrix): ``without_aliases`` keeps the first name of each and
``with_aliases`` gives the others back on loading, from the model the state loads into. Every
file is written beside its place and renamed into it (``atomic_write``), so a reader sees the
old file or the new one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SAFE_WEIGHTS = "model{suffix}.safetensors"
PICKLED_WEIGHTS = "pytorch_model{suffix}.bin"
_UNITS = {  # decimal and binary, as Hugging Face's
    **{"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3},
    **{"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10},
}


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(temporary_path)``, flushed to disk, then renamed over ``path``: an interruption
    leaves the previous file intact and no temporary file behind."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save to {path}: the folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- safetensors: one file --------------------------------------------------------------------
def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "safe_serialization=True writes safetensors files and needs the safetensors package "
            "(pip install safetensors; Accelerate and transformers install it), or pass "
            "safe_serialization=False to write torch.save's pickle format."
        ) from None
    return safetensors.torch


def _view(tensor: torch.Tensor) -> tuple | None:
    """What makes two state-dict entries one tensor: the same memory, viewed the same way."""
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP): its shard on this rank
        tensor = tensor.to_local()
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    where = (tensor.device, storage.data_ptr(), tensor.storage_offset())
    return (*where, tuple(tensor.shape), tensor.stride(), tensor.dtype)


def without_aliases(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``state`` with each shared tensor under its first name only (tied weights), the others
    dropped, as Accelerate saves them with safetensors."""
    kept: dict[str, Any] = {}
    seen: dict[tuple, str] = {}
    dropped = []
    for name, tensor in state.items():
        key = _view(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is not None and key in seen:
            dropped.append(f"{name} (= {seen[key]})")
            continue
        if key is not None:
            seen[key] = name
        kept[name] = tensor
    if dropped:
        logger.info("tied weights saved once: %s", ", ".join(dropped))
    return kept


def with_aliases(state: dict[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` read from a safetensors file, with the names ``without_aliases`` dropped given
    back: where several of ``expected``'s names (the model's own state dict) are one tensor and
    the file holds one of them, the others take its value."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in expected.items():
        key = _view(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is not None:
            groups.setdefault(key, []).append(name)
    for names in groups.values():
        present = [n for n in names if n in state]
        if len(names) > 1 and present:
            for name in names:
                state.setdefault(name, state[present[0]])
    return state


def save_safetensors(state: Mapping[str, Any], path: str | os.PathLike) -> None:
    """A dict of tensors as one safetensors file (atomically), tied weights once; what
    ``safetensors.torch.load_file`` and ``accelerate.load_checkpoint_in_model`` read."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"safe_serialization=True saves a dict of tensors (a state dict), not a "
            f"{type(state).__name__}: pass safe_serialization=False to pickle other objects."
        )
    tensors = without_aliases(state)
    wrong = [f"{k} ({type(v).__name__})" for k, v in tensors.items() if not _is_tensor(v)]
    if wrong:
        raise TypeError(
            "safetensors holds tensors only, and this state dict also holds "
            f"{', '.join(wrong[:5])}: pass safe_serialization=False to pickle it instead."
        )
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    storages: set[tuple] = set()
    for name, tensor in tensors.items():  # overlapping views of one storage: each its own copy
        where = (tensor.device, tensor.untyped_storage().data_ptr())
        if where in storages:
            tensors[name] = tensor.clone()
        storages.add(where)
    save_file = _safetensors().save_file
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return _safetensors().load_file(str(path), device="cpu")


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not hasattr(value, "to_local")


# -- save_model: whole or sharded ---------------------------------------------------------------
def shard_size(max_shard_size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or digits with a unit, ``"10GB"``, ``"200KB"``."""
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int | str):
        raise TypeError(f"max_shard_size={max_shard_size!r} must be bytes (an int) or '10GB'")
    if isinstance(max_shard_size, int):
        size = max_shard_size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)\s*", max_shard_size.upper())
        if match is None:
            raise ValueError(
                f"max_shard_size={max_shard_size!r}: give a number and a unit, KB, MB, GB or "
                "TB (decimal: '5GB' is 5 * 10**9 bytes), KiB, MiB, GiB or TiB (binary), or a "
                "number of bytes"
            )
        size = int(float(match.group(1)) * _UNITS[match.group(2)])
        if max_shard_size.strip()[-1] == "b" and "I" not in match.group(2):
            size //= 8  # '5Gb': gigabits, as Hugging Face reads it
    if size < 1:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be at least one byte")
    return size


def _bytes(tensor: torch.Tensor) -> int:
    """A tensor's size as Hugging Face's sharding counts it: its whole storage."""
    if hasattr(tensor, "to_local"):
        return tensor.nbytes
    return tensor.untyped_storage().nbytes()


def split(state: Mapping[str, torch.Tensor], max_bytes: int, pattern: str) -> dict[str, list]:
    """Shard file name -> its keys: filled in ``state``'s order, a new shard when the next
    tensor would overflow this one (a tensor over ``max_bytes`` alone in its own); names of one
    shared tensor stay in one shard. One shard is the whole file, ``pattern`` without suffix."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    first_of: dict[tuple, str] = {}
    followers: dict[str, list[str]] = {}
    for name, tensor in state.items():
        key = _view(tensor)
        if key is not None and key in first_of:
            followers[first_of[key]].append(name)
            continue
        if key is not None:
            first_of[key] = name
        followers[name] = []
        nbytes = _bytes(tensor)
        if nbytes > max_bytes:
            shards.append([name])
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    shards = [[k for name in shard for k in [name, *followers[name]]] for shard in shards]
    if len(shards) == 1:
        return {pattern.format(suffix=""): shards[0]}
    n = len(shards)
    return {pattern.format(suffix=f"-{i + 1:05d}-of-{n:05d}"): s for i, s in enumerate(shards)}


def save_model(
    state: dict[str, Any],
    folder: str | os.PathLike,
    max_shard_size: int | str,
    safe_serialization: bool,
    is_main_process: bool,
) -> None:
    """Write ``state`` (the whole model's state dict) into ``folder`` on the main process: one
    file, or shards and their index over ``max_shard_size``; files of an earlier save here that
    this one does not replace are removed first (stale shards, the whole file a sharded save
    supersedes, an index an unsharded one does)."""
    max_bytes = shard_size(max_shard_size)
    if not is_main_process:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        state = without_aliases(state)
    pattern = SAFE_WEIGHTS if safe_serialization else PICKLED_WEIGHTS
    files = split(state, max_bytes, pattern)
    whole = pattern.format(suffix="")
    index = folder / f"{whole}.index.json"
    stem, ext = pattern.split("{suffix}")
    shard_name = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}" + re.escape(ext))
    sharded = len(files) > 1
    for path in folder.iterdir():
        stale_shard = shard_name.fullmatch(path.name) and path.name not in files
        superseded = path.name == (index.name if not sharded else whole)
        if path.is_file() and (stale_shard or superseded):
            path.unlink()
    for name, keys in files.items():
        shard = {k: state[k] for k in keys}
        if safe_serialization:
            save_safetensors(shard, folder / name)
        else:
            atomic_write(folder / name, lambda tmp, shard=shard: torch.save(shard, tmp))
    if sharded:
        total = sum(_bytes(state[keys[0]]) for keys in _firsts(state).values())
        weight_map = {k: name for name, keys in files.items() for k in keys}
        content = {"metadata": {"total_size": total}, "weight_map": weight_map}
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        atomic_write(index, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        logger.info(
            "saved %d shards of at most %s, listed in %s", len(files), max_shard_size, index
        )


def _firsts(state: Mapping[str, torch.Tensor]) -> dict[tuple | str, list[str]]:
    groups: dict[tuple | str, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(_view(tensor) or name, []).append(name)
    return groups


def offloaded_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The state dict of a model whose weights Accelerate's big-model inference offloaded
    (``load_checkpoint_and_dispatch`` with a ``device_map``), read back by Accelerate itself,
    which such a model carries; None for a model with nothing offloaded."""
    offloaded = any(
        getattr(getattr(module, "_hf_hook", None), "offload", False) for module in model.modules()
    )
    if not offloaded:
        return None
    from accelerate.utils.modeling import get_state_dict_offloaded_model

    return get_state_dict_offloaded_model(model)
