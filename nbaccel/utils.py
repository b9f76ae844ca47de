"""Hugging Face Accelerate's ``accelerate.utils`` names, so that ported code changes one import.

``from accelerate.utils import gather`` becomes ``from nbaccel.utils import gather``. The
collectives live in ``collectives`` and the configuration classes in their own modules; this
module re-exports them, and holds what has no other home: ``send_to_device`` with
``skip_keys``, seeding, and synchronising random states across ranks.
"""

from __future__ import annotations

import contextlib
import importlib
import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import tensors
from .accelerator.accumulation import GradientAccumulationPlugin
from .accelerator.collectives import (
    CannotPadNestedTensorWarning,
    Reduction,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    world_size,
)
from .accelerator.data.prepare import prepare_data_loader
from .accelerator.data.samplers import SeedableRandomSampler
from .accelerator.data.sharding import DataLoaderConfiguration
from .accelerator.environment import check_os_kernel, clear_environment, patch_environment
from .accelerator.handlers import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from .accelerator.logging_utils import get_logger
from .accelerator.memory_utils import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)
from .accelerator.operations import (
    concatenate,
    convert_to_fp32,
    find_batch_size,
    find_device,
    honor_type,
    is_namedtuple,
    is_torch_tensor,
    listify,
    recursively_apply,
)
from .accelerator.project import ProjectConfiguration
from .accelerator.state import DistributedType, PartialState
from .accelerator.wrappers import extract_model_from_parallel, is_compiled_module
from .env import DistEnv
from .errors import DistributedOperationException, not_ported
from .observe.trackers.general import LoggerType

__all__ = [
    "AutocastKwargs",
    "CannotPadNestedTensorWarning",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",  # noqa: F822  (imported when asked for: __getattr__ below)
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "FullyShardedDataParallelPlugin",  # noqa: F822
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "PartialState",
    "ProjectConfiguration",
    "Reduction",
    "SeedableRandomSampler",
    "broadcast",
    "broadcast_object_list",
    "check_os_kernel",
    "clear_device_cache",
    "clear_environment",
    "concatenate",
    "convert_to_fp32",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_device",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_logger",
    "honor_type",
    "is_compiled_module",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "patch_environment",
    "prepare_data_loader",
    "recursively_apply",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "synchronize_rng_states",
]


# The back ends' plugins, where HF Accelerate users import them from; imported when first
# asked for, so that ``nbaccel.utils`` stays light (no strategy or DeepSpeed module with it)
_PLUGINS = {
    "DeepSpeedPlugin": ".accelerator.strategies.ds_config",
    "FullyShardedDataParallelPlugin": ".accelerator.strategies.fully_sharded",
}


def __getattr__(name: str) -> Any:
    if name in _PLUGINS:
        return getattr(importlib.import_module(_PLUGINS[name], __package__), name)
    error = not_ported("nbaccel.utils", name)
    if error is not None:  # from nbaccel.utils import FP8RecipeKwargs: says why not
        raise error
    raise AttributeError(f"module 'nbaccel.utils' has no attribute {name!r}")


def send_to_device(
    tensor: Any,
    device: torch.device | str,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> Any:
    """Move every tensor inside tuples, lists, dicts and named tuples to ``device``; the
    values of a dict's ``skip_keys`` stay where they are."""
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
    if skip and isinstance(tensor, dict):
        return type(tensor)(
            {
                k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
                for k, v in tensor.items()
            }
        )
    if skip and isinstance(tensor, list | tuple) and not hasattr(tensor, "_fields"):
        return type(tensor)(send_to_device(v, device, non_blocking, skip_keys) for v in tensor)
    return tensors.send_to_device(tensor, device, non_blocking)


# -- randomness ------------------------------------------------------------------------------
_RNG_TYPES = ("torch", "cuda", "generator")


def synchronize_rng_states(
    rng_types: Sequence[str], generator: torch.Generator | None = None
) -> None:
    """Give every rank rank 0's random state: ``"torch"`` (the CPU RNG), ``"cuda"`` (this
    process's GPU) and ``"generator"`` (the ``generator`` passed in)."""
    rng_types = list(rng_types)
    for name in rng_types:
        if name not in _RNG_TYPES:
            raise ValueError(
                f"rng type {name!r} is not one nbaccel keeps ({', '.join(_RNG_TYPES)}); "
                "XLA, NPU, MLU and other devices are Accelerate's alone."
            )
    if "generator" in rng_types and generator is None:
        raise ValueError('rng_types includes "generator": pass generator=your_generator')
    if world_size() == 1:
        return
    nccl = dist.get_backend() == "nccl"  # NCCL moves only GPU tensors
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    for name in rng_types:
        if name == "cuda" and not torch.cuda.is_available():
            continue  # no GPU here: nothing to synchronise (as in Accelerate)
        state = {
            "torch": torch.get_rng_state,
            "cuda": torch.cuda.get_rng_state,
            "generator": lambda: generator.get_state(),
        }[name]()
        state = broadcast(state.to(device)).cpu()
        if name == "torch":
            torch.set_rng_state(state)
        elif name == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            generator.set_state(state)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy (if installed) and torch on every device.

    ``device_specific=True`` adds the process index, so ranks draw different numbers (e.g. for
    augmentation) while staying reproducible. ``deterministic=True`` also asks torch for
    deterministic algorithms (``torch.use_deterministic_algorithms``), which may be slower.
    """
    if device_specific:
        seed += DistEnv.from_environ().rank
    random.seed(seed)
    torch.manual_seed(seed)  # every device's generator
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)
    if deterministic:  # CUDA also needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set before it starts
        torch.use_deterministic_algorithms(True)
