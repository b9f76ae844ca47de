"""FSDP2: each rank keeps ``1/N`` of every parameter, gradient and optimizer state.

PyTorch's own FSDP2 (``fully_shard``) does the sharding; nbaccel adds none of its own. DDP keeps
every parameter, gradient and optimizer state whole on every rank; FSDP2 keeps ``1/N`` of each on
each rank and gathers a layer's parameters just before it runs. Through the Accelerator the loop
does not change:

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

This module is the back end: the ``FSDP`` strategy
that fits ``fully_shard`` to the Accelerator, and the helpers below it. ``prepare`` shards the
model, then points the optimizer at the sharded parameters (FSDP2 replaces them), so the
optimizer may be created before ``prepare`` as usual; gradients are reduce-scattered, so
``no_sync`` switches that off instead of DDP's all-reduce; tensors are DTensors, gathered whole
for a file, a checkpoint or a gradient norm.

The step meter (``nbaccel.observe.meter``) times FSDP2's all-gathers and reduce-scatters on
CPU, by handing each sharded module FSDP2's own default collectives wrapped in a clock
(``set_custom_all_gather``/``set_custom_reduce_scatter``); gloo blocks inside them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...observe.meter import StepMeter
from ..accumulation import AccumulationWindow
from ..optim import AcceleratedOptimizer
from ..state import DistributedType
from .base import Strategy, trainable
from .fully_sharded import FSDPPlugin, FullyShardedDataParallelPlugin

__all__ = ["FSDP", "FSDPPlugin", "FullyShardedDataParallelPlugin"]


class FSDP(Strategy):
    """Shard trainable models over the ranks (with one process: train as one process does)."""

    holds_sync = True

    def __init__(self, plugin: Any, state: Any, mixed_precision: str, *args: Any) -> None:
        if mixed_precision == "fp16":
            raise ValueError(
                "mixed_precision='fp16' with FSDP needs a sharded gradient scaler, which nbaccel "
                "does not provide yet; use mixed_precision='bf16' (no scaler needed) or DDP."
            )
        super().__init__(plugin, state, mixed_precision, *args)
        self._replaced: dict[int, torch.nn.Parameter] = {}  # id(old parameter) -> its shard
        self._optimizers: list[torch.optim.Optimizer] = []  # to point at later replacements
        self._unsynced: set[int] = set()  # ids of sharded models inside no_sync

    @property
    def distributed_type(self) -> DistributedType | None:  # type: ignore[override]
        return DistributedType.FSDP if self.env.is_distributed else None

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if is_sharded(model):
            return model
        if not (self.env.is_distributed and trainable(model)):
            return super().prepare_model(model)  # one process, or a frozen model: whole
        before = {name: id(p) for name, p in model.named_parameters()}
        model = shard_model(model.to(self.device), self.plugin, self.device, self.precision.dtype)
        after = dict(model.named_parameters())
        self._replaced.update({before[n]: after[n] for n in before if n in after})
        for optimizer in self._optimizers:  # prepared in an earlier call
            swap_parameters(optimizer, self._replaced)
        if self.meter is not None and self.meter.timing and self.device.type == "cpu":
            time_collectives(model, self.meter)
        # FSDP's mixed-precision policy casts: no autocast on forward; its gathering runs in
        # forward hooks, which the meter's hooks enclose
        return self.timed(model, hooks=True)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, window: AccumulationWindow
    ) -> AcceleratedOptimizer:
        swap_parameters(optimizer, self._replaced)
        self._optimizers.append(optimizer)
        return super().prepare_optimizer(optimizer, window)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        if not is_sharded(model):
            yield
            return
        model.set_requires_gradient_sync(False)
        self._unsynced.add(id(model))
        try:
            yield
        finally:
            self._unsynced.discard(id(model))
            model.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        if not is_sharded(model):
            yield
            return
        model.set_requires_gradient_sync(True)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(id(model) not in self._unsynced)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float) -> Any:
        return full_tensors(super().clip_grad_norm_(parameters, max_norm, norm_type))  # a DTensor

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return full_tensors(super().state_dict(model))

    def for_save(self, obj: Any) -> Any:
        return full_tensors(obj) if self.env.is_distributed else obj

    def save_state(
        self, folder: Any, models: list, optimizers: list, schedulers: list, **common: Any
    ) -> None:
        if any(is_sharded(m) for m in models):  # gathered whole: loadable without FSDP too
            models, optimizers = full_states(models, optimizers)
        super().save_state(folder, models, optimizers, schedulers, **common)

    def load_states(
        self, models: list, optimizers: list, model_states: list, optimizer_states: list
    ) -> None:
        if any(is_sharded(m) for m in models):  # shard the whole states back
            load_full_states(models, optimizers, model_states, optimizer_states)
        else:
            super().load_states(models, optimizers, model_states, optimizer_states)


def time_collectives(model: torch.nn.Module, meter: StepMeter) -> None:
    """Count the time inside each sharded module's all-gathers and reduce-scatters as
    communication. FSDP2's default collectives do the work, unchanged; where this version of
    torch lacks them, or a module refuses a custom one, its collectives stay in compute."""
    from torch.distributed.fsdp import FSDPModule

    try:  # FSDP2's own defaults live in a private module: if it moves, time nothing
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return

    class TimedAllGather(DefaultAllGather):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with meter.communicating("FSDP's all_gather"):
                return super().__call__(*args, **kwargs)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with meter.communicating("FSDP's reduce_scatter"):
                return super().__call__(*args, **kwargs)

    for module in model.modules():
        if isinstance(module, FSDPModule) and hasattr(module, "set_custom_reduce_scatter"):
            with contextlib.suppress(ValueError):  # several parameter groups: left alone
                module.set_custom_all_gather(TimedAllGather())
                module.set_custom_reduce_scatter(TimedReduceScatter())


# -- FSDP2 itself ------------------------------------------------------------------------------
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
    if plugin.cpu_offload:  # True, or torch's own policy
        offload = plugin.cpu_offload
        custom = isinstance(offload, CPUOffloadPolicy)
        options["offload_policy"] = offload if custom else CPUOffloadPolicy()
    for unit in plugin.units(model):
        fully_shard(unit, **options)
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
