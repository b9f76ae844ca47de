"""Sharded data parallelism through PyTorch's own FSDP2 (``fully_shard``); nbaccel adds no
sharding of its own.

DDP keeps every parameter, gradient and optimizer state whole on every rank. FSDP2 keeps
``1/N`` of each on each rank and gathers a layer's parameters just before it runs. Through the
Accelerator the loop does not change:

    accelerator = Accelerator(fsdp_plugin=FSDPPlugin())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

``prepare`` shards the model, then points the optimizer at the sharded parameters (FSDP2
replaces them), so the optimizer may be created before ``prepare`` as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class FSDPPlugin:
    """How ``Accelerator(fsdp_plugin=...)`` shards models with FSDP2.

    Args:
        reshard_after_forward: free each unit's gathered parameters after its forward (less
            memory, one more all-gather in backward), as ZeRO stage 3 does. ``False`` keeps
            them until backward, like ZeRO stage 2.
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory
            (the optimizer steps on the CPU). Useful on GPUs only.
        shard: which submodules become their own shard unit (gathered and freed together);
            default: every direct child that holds parameters. The whole model is always one
            more unit, for what is left.
    """

    reshard_after_forward: bool = True
    cpu_offload: bool = False
    shard: Callable[[nn.Module], bool] | None = None


def shard_model(
    model: nn.Module, plugin: FSDPPlugin, device: torch.device, param_dtype: torch.dtype | None
) -> nn.Module:
    """``fully_shard`` the chosen submodules, then the model, on a 1-D mesh over all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": plugin.reshard_after_forward,
    }
    if param_dtype is not None:  # compute in 16 bits, reduce gradients and return in float32
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    if plugin.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    chosen = plugin.shard or (lambda m: any(True for _ in m.parameters()))
    for child in list(model.children()):
        if chosen(child):
            fully_shard(child, **options)
    fully_shard(model, **options)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def swap_parameters(optimizer: torch.optim.Optimizer, new: dict[int, nn.Parameter]) -> None:
    """Point ``optimizer`` at the parameters that replaced the ones it was built with."""
    for group in optimizer.param_groups:
        if any(id(p) in new for p in group["params"]) and optimizer.state:
            raise ValueError(
                "prepare() shards the model with FSDP, which replaces its parameters, but the "
                "optimizer already has state for the old ones. Call prepare() before training."
            )
        group["params"] = [new.get(id(p), p) for p in group["params"]]


def full_tensors(obj: Any) -> Any:
    """``obj`` with every sharded tensor (DTensor) gathered whole, on the CPU; a collective:
    every rank must call it, with the same structure."""
    from torch.distributed.tensor import DTensor

    from ...tensors import map_tensors

    return map_tensors(obj, lambda t: t.full_tensor().cpu() if isinstance(t, DTensor) else t)


class Snapshot:
    """A state dict taken already (gathered whole), in the place of the object it came from."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def full_states(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
    """Every model's and optimizer's state dict, unsharded, as ``Snapshot``s (a collective).

    Optimizer states come keyed by parameter name (torch.distributed.checkpoint's layout).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sharded = _the_sharded_model(models)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (
        [Snapshot(full_tensors(m.state_dict())) for m in models],
        [Snapshot(get_optimizer_state_dict(sharded, o, options=options)) for o in optimizers],
    )


def load_full_states(models, optimizers, model_states, optimizer_states) -> None:
    """Shard full state dicts (read on every rank) back into the prepared objects."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sharded = _the_sharded_model(models)
    options = StateDictOptions(full_state_dict=True)
    for model, state in zip(models, model_states, strict=True):
        set_model_state_dict(model, state, options=options)
    for optimizer, state in zip(optimizers, optimizer_states, strict=True):
        set_optimizer_state_dict(sharded, optimizer, optim_state_dict=state, options=options)


def _the_sharded_model(models: list[nn.Module]) -> nn.Module:
    sharded = [m for m in models if is_sharded(m)]
    if len(sharded) != 1 or len(models) != 1:
        raise NotImplementedError(
            f"save_state/load_state under FSDP handle one prepared model (got {len(models)}, "
            f"{len(sharded)} sharded). Save each with accelerator.get_state_dict(model)."
        )
    return sharded[0]
