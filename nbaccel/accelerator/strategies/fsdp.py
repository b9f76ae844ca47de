"""FSDP2: each rank keeps ``1/N`` of every parameter, gradient and optimizer state.

PyTorch's ``fully_shard`` does the work (``sharding``, beside this module); this strategy fits it to
the Accelerator: sharding replaces the model's parameters, so the optimizers are pointed at the new
ones; gradients are reduce-scattered, so ``no_sync`` switches that off instead of DDP's all-reduce;
tensors are DTensors, gathered whole for a file or a gradient norm.

The breakdown (``nbaccel.observe.breakdown``) times FSDP2's all-gathers and reduce-scatters on CPU,
by handing each sharded module FSDP2's own default collectives wrapped in a clock
(``set_custom_all_gather``/``set_custom_reduce_scatter``); gloo blocks inside them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...observe import breakdown
from ..accumulation import AccumulationWindow
from ..optim import AcceleratedOptimizer
from ..state import DistributedType
from .base import Strategy, trainable
from .sharding import (
    full_states,
    full_tensors,
    is_sharded,
    load_full_states,
    shard_model,
    swap_parameters,
)


class FSDP(Strategy):
    """Shard trainable models over the ranks (with one process: train as one process does)."""

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
        if self.breakdown is not None and self.device.type == "cpu":
            time_collectives(model, self.breakdown)
        return self.timed(model)  # FSDP's mixed-precision policy casts: no autocast on forward

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


def time_collectives(model: torch.nn.Module, timing: breakdown.Breakdown) -> None:
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
            with breakdown.communicating(timing, "FSDP's all_gather"):
                return super().__call__(*args, **kwargs)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with breakdown.communicating(timing, "FSDP's reduce_scatter"):
                return super().__call__(*args, **kwargs)

    for module in model.modules():
        if isinstance(module, FSDPModule) and hasattr(module, "set_custom_reduce_scatter"):
            with contextlib.suppress(ValueError):  # several parameter groups: left alone
                module.set_custom_all_gather(TimedAllGather())
                module.set_custom_reduce_scatter(TimedReduceScatter())
