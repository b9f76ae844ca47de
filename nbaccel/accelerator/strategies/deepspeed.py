"""DeepSpeed ZeRO: a DeepSpeed engine trains the model; ``zero`` (beside this module) builds its
config.

The engine owns more than DDP or FSDP do, and the Accelerator leaves it all to the engine:

* it is made from the model and the optimizer together (``deepspeed.initialize``), so both
  are prepared in one ``prepare`` call;
* it divides the loss for accumulation, scales fp16 losses, clips and zeroes the gradients,
  and decides when they are reduced (told which micro-batch ends a window);
* it steps inside ``accelerator.backward``, as in Accelerate: the backward that ends a window
  also runs the engine's step (clip, optimizer step, zero the gradients), so the prepared
  optimizer's ``step()`` and ``zero_grad()`` do nothing. Code that reads the gradients between
  ``backward`` and ``step`` finds them already used and zeroed, as it would under Accelerate;
* it saves its own sharded checkpoint, which ``save_state`` puts inside nbaccel's folder;
* it needs a process group even for one process: a private one (no port), left in ``end``.

The engine's model comes back whole (``full_state_dict``, ``consolidate``) for a file that loads
into the plain model; ``zero`` builds the engine's config and starts DeepSpeed quietly.

The step meter (``nbaccel.observe.meter``) times the engine's forward, backward and step as
compute: its collectives, inside ``deepspeed.comm``, are not measured apart.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...env import backend_for
from ...observe.meter import StepMeter
from .. import checkpoint
from ..accumulation import AccumulationWindow, GradientAccumulationPlugin
from ..data.loader import PreparedDataLoader
from ..optim import AcceleratedOptimizer
from ..state import DistributedType, PartialState
from . import ds_config
from .base import Strategy, trainable


class DeepSpeed(Strategy):
    """Train through a DeepSpeed engine with ZeRO sharding (any number of processes)."""

    distributed_type = DistributedType.DEEPSPEED
    scales_losses = False  # the engine scales fp16 losses itself

    def __init__(
        self,
        plugin: ds_config.DeepSpeedPlugin,
        state: PartialState,
        mixed_precision: str,
        precision_given: bool,
        accumulation: GradientAccumulationPlugin,
    ) -> None:
        if accumulation.sync_each_batch:
            raise ValueError(
                "GradientAccumulationPlugin(sync_each_batch=True) under DeepSpeed: the engine "
                "decides when gradients are reduced; leave sync_each_batch False."
            )
        ds_config.import_deepspeed(state.device)  # an install hint now, not at prepare()
        self.config, mixed_precision, steps = ds_config.build_config(
            plugin,
            mixed_precision=mixed_precision,
            precision_given=precision_given,
            accumulation=accumulation.num_steps or 1,
            device=state.device,
        )
        super().__init__(plugin, state, mixed_precision, precision_given, accumulation)
        self.accumulation_steps = steps  # the config may have given it
        self.engine: Any = None  # once prepared
        self.optimizer: DeepSpeedOptimizer | None = None  # told when the engine steps
        # Last, so that nothing above can fail with the group made: DeepSpeed needs a
        # process group even for one process, and reads LOCAL_RANK; end() undoes both.
        self._private_group = not dist.is_initialized()
        if self._private_group:
            dist.init_process_group(
                backend_for(self.device), store=dist.HashStore(), rank=0, world_size=1
            )
        self._set_local_rank = "LOCAL_RANK" not in os.environ
        if self._set_local_rank:
            os.environ["LOCAL_RANK"] = str(self.env.local_rank)

    def prepare(self, objects: tuple[Any, ...], prepare_one: Callable[[Any], Any]) -> list[Any]:
        """One ``deepspeed.initialize`` for the model and optimizer of this call."""
        models = [i for i, obj in enumerate(objects) if _trainable_model(obj)]
        optimizers = [
            i
            for i, obj in enumerate(objects)
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer)
        ]
        if (models or optimizers) and (
            len(models) != 1 or len(optimizers) != 1 or self.engine is not None
        ):
            raise ValueError(
                "under DeepSpeed one model trains with one optimizer, prepared in the same call: "
                "accelerator.prepare(model, optimizer, loader, ...). This call has "
                f"{len(models)} trainable model(s) and {len(optimizers)} optimizer(s)"
                + (", and an engine was already prepared." if self.engine is not None else ".")
            )
        prepared = [
            obj if i in models or i in optimizers else prepare_one(obj)
            for i, obj in enumerate(objects)
        ]
        if models:
            loaders = [obj for obj in prepared if isinstance(obj, PreparedDataLoader)]
            model, optimizer = objects[models[0]], objects[optimizers[0]]
            self._initialize(model, optimizer, loaders[0].batch_size if loaders else None)
            prepared[models[0]] = prepare_one(self.engine)  # kept as the Accelerator's model
            prepared[optimizers[0]] = prepare_one(optimizer)  # stepped by backward
        return prepared

    def _initialize(self, model: torch.nn.Module, optimizer: Any, batch_size: int | None) -> None:
        ds_config.set_micro_batch(self.config, batch_size)
        ds_config.cap_buckets(self.config, model)
        deepspeed = ds_config.import_deepspeed(self.device)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            ds_config.warn_stale_build_lock()
        with ds_config.quiet_start():
            engine, *_ = deepspeed.initialize(
                model=model.to(self.device), optimizer=optimizer, config=self.config
            )
        if self.precision.dtype is not None:  # 16-bit weights; float32 inputs and outputs
            # Inside the engine: DeepSpeed (0.19) turns off an autocast entered outside it
            # around its module unless its own torch_autocast section is set, so an autocast
            # on engine.forward met float32 inputs with 16-bit weights on CUDA.
            self.precision.autocast_forward(engine.module)
        self.engine = engine

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.timed(model) if is_engine(model) else super().prepare_model(model)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, window: AccumulationWindow
    ) -> AcceleratedOptimizer:
        self.optimizer = DeepSpeedOptimizer(
            optimizer, window, self.precision, self.engine, self.meter
        )
        return self.optimizer

    # -- the training step: the engine's -------------------------------------------------------
    def backward(self, loss: torch.Tensor, sync: bool, **kwargs: Any) -> None:
        """The engine's backward and, on the micro-batch that ends the window, its step.

        Accelerate's order, so that its loops give the same numbers here: by the time
        ``backward`` returns at a window's end the weights have moved and the gradients are
        zeroed; ``optimizer.step()`` that follows does nothing.
        """
        # the engine divides by the accumulation steps and scales fp16 losses itself
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, **kwargs)
        if sync:
            self.engine.step()  # clips, steps, zeroes the gradients; skips on fp16 overflow
            if self.optimizer is not None:
                self.optimizer.engine_stepped()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float) -> Any:
        """The norm the engine measured (before clipping) in the step that ``backward`` just
        ran, as a float, as Accelerate returns it; None if the engine measured none.

        The engine clips at ``DeepSpeedPlugin(gradient_clipping=...)``; asking for another
        norm is an error (Accelerate ignores ``max_norm`` here).
        """
        clip = self.config["gradient_clipping"]
        if float(max_norm) != clip or norm_type != 2.0:
            now = f"at {clip}" if clip else "not at all (gradient_clipping unset)"
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) under "
                f"DeepSpeed: the engine clips the 2-norm inside its step, here {now}. Give "
                f"the norm once: DeepSpeedPlugin(gradient_clipping={max_norm})."
            )
        norm = self.engine.get_global_grad_norm()
        return norm.item() if isinstance(norm, torch.Tensor) else norm

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        raise ValueError(
            "clip_grad_value_ is not available under DeepSpeed (the engine owns the "
            "gradients); clip the norm instead: DeepSpeedPlugin(gradient_clipping=...)."
        )

    # -- models and checkpoints ------------------------------------------------------------------
    def inner(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return model.module if is_engine(model) else super().inner(model)

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(model) if is_engine(model) else super().state_dict(model)

    def for_save(self, obj: Any) -> Any:
        # ZeRO 3 placeholders, bf16 copies: the whole float32 weights
        return obj if self.engine is None else consolidate(obj, self.engine)

    def save_state(
        self, folder: Any, models: list, optimizers: list, schedulers: list, **common: Any
    ) -> None:
        if self.engine is None:
            return super().save_state(folder, models, optimizers, schedulers, **common)
        engine = self.engine  # its own sharded checkpoint, inside ours
        checkpoint.save_state(
            folder,
            models=[],
            optimizers=[],
            schedulers=schedulers,
            engine=lambda staging: engine.save_checkpoint(str(staging), tag=ds_config.TAG),
            **common,
        )

    def load_state(
        self, folder: Any, models: list, optimizers: list, schedulers: list, **common: Any
    ) -> dict:
        if self.engine is None:
            return super().load_state(folder, models, optimizers, schedulers, **common)
        state = checkpoint.read_state(
            folder,
            models=[],
            optimizers=[],
            schedulers=schedulers,
            engine=(ds_config.TAG, self.env.world_size),
            **common,
        )
        self.engine.load_checkpoint(str(folder), tag=ds_config.TAG, load_lr_scheduler_states=False)
        return state

    def end(self, models: list[torch.nn.Module], leave_group: bool) -> None:
        try:
            if (leave_group or self._private_group) and dist.is_initialized():
                if self.engine is not None:  # DeepSpeed's way also drops its cached groups
                    ds_config.import_deepspeed(self.device).comm.destroy_process_group()
                else:
                    dist.destroy_process_group()
        finally:
            self._private_group = False
            if self._set_local_rank:
                os.environ.pop("LOCAL_RANK", None)
                self._set_local_rank = False


class DeepSpeedOptimizer(AcceleratedOptimizer):
    """The user's optimizer inside the engine, which ``accelerator.backward`` steps.

    As in Accelerate, ``step()`` and ``zero_grad()`` do nothing: the backward that ends a window
    has already stepped the engine, which zeroes the gradients after its step. A loop written
    with them runs unchanged. ``step_was_skipped`` says whether that step left the weights as
    they were (fp16 found inf/NaN gradients); the scheduler asks the same.
    """

    def __init__(
        self,
        optimizer: Any,
        window: AccumulationWindow,
        precision: Any,
        engine: Any,
        meter: StepMeter | None = None,
    ) -> None:
        super().__init__(optimizer, window, precision, meter)
        self.engine = engine

    def step(self, closure=None):  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) under DeepSpeed: accelerator.backward(loss) steps the "
                "engine, so a closure would never run; call the loss and backward yourself."
            )
        return None

    def engine_stepped(self) -> None:
        """The engine stepped at the window's end (inside ``backward``): record whether the
        weights moved, for ``step_was_skipped`` and the scheduler."""
        self.stepped = bool(self.engine.was_step_applied())
        self.step_was_skipped = not self.stepped
        self.window.stepped(self.optimizer, self.stepped)

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({self.optimizer!r})"


def _trainable_model(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and not is_engine(obj) and trainable(obj)


# -- the engine's model, whole ----------------------------------------------------------------
def is_engine(model: Any) -> bool:
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's model state dict, whole and float32 where training keeps float32 masters,
    on the CPU of every rank. Collective: every rank must call it."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    params = dict(module.named_parameters(remove_duplicate=False))
    # stage 0 with 16 bits: float32 masters beside the 16-bit weights, group by group
    masters = {
        id(low): high
        for lows, highs in zip(
            getattr(engine.optimizer, "fp16_groups", []),
            getattr(engine.optimizer, "fp32_groups", []),
            strict=False,
        )
        if isinstance(lows, list) and isinstance(highs, list)
        for low, high in zip(lows, highs, strict=False)
    }
    zero3 = engine.zero_optimization_stage() == 3
    state: dict[str, torch.Tensor] = {}
    with _gathered(engine) if zero3 else contextlib.nullcontext():
        for name, tensor in module.state_dict().items():
            param = params.get(name)
            full = safe_get_full_fp32_param(param) if param is not None else None
            if full is None and param is not None:
                full = masters.get(id(param))
            state[name] = (tensor if full is None else full).detach().cpu().clone()
    return state


@contextlib.contextmanager
def _gathered(engine: Any):
    """ZeRO 3: gather the parameters (buffers are whole) while the state dict is read."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        yield


def consolidate(obj: Any, engine: Any) -> Any:
    """Replace, anywhere in ``obj``, a state dict of the engine's model by the whole one.

    A state dict is recognised by its keys: ``unwrap_model(model).state_dict()`` under ZeRO 3
    holds empty placeholders, and under bf16 16-bit copies of the float32 weights. Ranks save
    the same structure, so they agree on whether to gather (a collective).
    """
    keys = frozenset(engine.module.state_dict())

    def match(x: Any) -> bool:
        return isinstance(x, Mapping) and len(x) == len(keys) and set(x) == keys

    def children(x: Any) -> list[Any]:
        if isinstance(x, Mapping):
            return list(x.values())
        return list(x) if isinstance(x, list | tuple) else []

    def found(x: Any) -> bool:
        return match(x) or any(found(c) for c in children(x))

    if not found(obj):
        return obj
    full = full_state_dict(engine)

    def walk(x: Any) -> Any:
        if match(x):
            return type(x)(full) if isinstance(x, dict) else full
        if isinstance(x, Mapping):
            return type(x)({k: walk(v) for k, v in x.items()})
        if isinstance(x, list | tuple):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)
