"""One process: the strategy every back end starts from, and the interface they all share.

A strategy is how the model, its gradients and its checkpoints are spread over the ranks. The
Accelerator asks its strategy, never the back end itself, for each of these:

==========================  ======================================================================
``prepare``                 the objects of one ``prepare`` call, models first
``prepare_model``           move (and wrap, or shard) a model; autocast its forward
``prepare_optimizer``       wrap an optimizer so it follows the accumulation window
``no_sync``                 skip the gradient reduction of a micro-batch
``sync_in_backward``        force it again (``trigger_sync_in_backward``)
``backward``                divide the loss for accumulation, scale it for fp16
``clip_grad_norm_``         clip the whole gradient; ``clip_grad_value_`` each element
``unwrap``                  the user's module inside the wrappers
``state_dict`` / ``for_save``  whole tensors for a file
``save_state`` / ``load_state``  a checkpoint folder
``end``                     leave the process group
==========================  ======================================================================

This one trains alone: nothing to wrap, nothing to reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import checkpoint
from ..accumulation import AccumulationWindow, GradientAccumulationPlugin
from ..optim import AcceleratedOptimizer
from ..precision import Precision, without_autocast
from ..state import DistributedType, PartialState


class Strategy:
    """Train in this process alone.

    Args:
        plugin: the back end's options (``FSDPPlugin``, ``DeepSpeedPlugin``); None here.
        state: this process's rank, device and process group.
        mixed_precision: the Accelerator's mode; ``precision_given`` says whether the user
            chose it (a back end's own config may otherwise choose).
        accumulation: the Accelerator's accumulation options.
    """

    #: what ``accelerator.distributed_type`` reports; None: the process facts decide
    distributed_type: DistributedType | None = None
    #: False where the back end scales fp16 losses itself
    scales_losses = True
    #: whether ``no_sync`` holds anything back (DDP, FSDP): ``accumulate`` enters it only then
    holds_sync = False

    def __init__(
        self,
        plugin: Any,
        state: PartialState,
        mixed_precision: str,
        precision_given: bool,
        accumulation: GradientAccumulationPlugin,
    ) -> None:
        self.plugin = plugin
        self.device = state.device
        self.env = state.env
        self.mixed_precision = mixed_precision
        self.accumulation_steps = accumulation.num_steps or 1
        self.handlers = handlers = getattr(state, "handlers", None)  # its kwargs_handlers
        self.precision = Precision(
            mixed_precision,
            self.device,
            scale=self.scales_losses,
            scaler_kwargs=handlers.asked("scaler") if handlers else None,
            autocast_kwargs=handlers.asked("autocast") if handlers else None,
        )
        # the step's events: counts, and where the time goes (untimed when the time split is off)
        self.meter = state._meter

    # -- prepare -------------------------------------------------------------------------------
    def prepare(self, objects: tuple[Any, ...], prepare_one: Callable[[Any], Any]) -> list[Any]:
        """Prepare each object with ``prepare_one``, models first: a back end that replaces
        parameters (FSDP) must do so before the optimizers are pointed at them."""
        prepared = list(objects)
        for i in sorted(range(len(objects)), key=lambda i: not _is_model(objects[i])):
            prepared[i] = prepare_one(objects[i])
        return prepared

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = self.precision.autocast_forward(model.to(self.device))
        return self.timed(model)

    def timed(self, model: torch.nn.Module, hooks: bool = False) -> torch.nn.Module:
        """``model``, its forward timed as compute by the step meter (once, however often it
        is prepared): ``StepMeter.watch``."""
        return model if self.meter is None else self.meter.watch(model, hooks)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, window: AccumulationWindow
    ) -> AcceleratedOptimizer:
        return AcceleratedOptimizer(optimizer, window, self.precision, self.meter)

    # -- the training step -----------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, sync: bool, **kwargs: Any) -> None:
        """``loss.backward()`` for one micro-batch, a share of the window's step."""
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        if self.precision.scaler is None:  # nothing to scale: precision.backward, a call less
            loss.backward(**kwargs)
        else:
            self.precision.backward(loss, **kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float) -> Any:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- models and checkpoints ------------------------------------------------------------------
    def unwrap(self, model: torch.nn.Module, keep_autocast: bool = True) -> torch.nn.Module:
        """Remove the wrappers (DDP, ``torch.compile``, a back end's own) around the module,
        and with ``keep_autocast=False`` the autocast that ``prepare_model`` put on forward."""
        while (inner := self.inner(model)) is not None:
            model = inner
        return model if keep_autocast else without_autocast(model)

    def inner(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The module one wrapper holds; None when ``model`` is no wrapper."""
        if isinstance(model, DistributedDataParallel | torch.nn.DataParallel):
            return model.module
        inner = getattr(model, "_orig_mod", None)  # torch.compile's
        return inner if isinstance(inner, torch.nn.Module) else None

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole state dict on every rank (a collective where it is sharded)."""
        return self.unwrap(model).state_dict()

    def for_save(self, obj: Any) -> Any:
        """``obj`` as a file should hold it: sharded tensors gathered whole."""
        return obj

    def save_state(
        self, folder: Any, models: list, optimizers: list, schedulers: list, **common: Any
    ) -> None:
        """Write the checkpoint folder (``common``: scaler, step, rank, world size, barrier)."""
        checkpoint.save_state(
            folder, models=models, optimizers=optimizers, schedulers=schedulers, **common
        )

    def load_state(
        self, folder: Any, models: list, optimizers: list, schedulers: list, **common: Any
    ) -> dict[str, Any]:
        """Read the checkpoint (every file checked before anything changes), load the models
        and optimizers, and return what was read for the rest (schedulers, scaler, RNG, step)."""
        state = checkpoint.read_state(
            folder, models=models, optimizers=optimizers, schedulers=schedulers, **common
        )
        self.load_states(
            models,
            optimizers,
            [state[f"model_{i}.pt"] for i in range(len(models))],
            [state[f"optimizer_{i}.pt"] for i in range(len(optimizers))],
        )
        return state

    def load_states(
        self, models: list, optimizers: list, model_states: list, optimizer_states: list
    ) -> None:
        for model, model_state in zip(models, model_states, strict=True):
            model.load_state_dict(model_state)
        for optimizer, optimizer_state in zip(optimizers, optimizer_states, strict=True):
            optimizer.load_state_dict(optimizer_state)

    def end(self, models: list[torch.nn.Module], leave_group: bool) -> None:
        """Leave the process group when this Accelerator joined it."""
        if leave_group and dist.is_initialized():
            dist.destroy_process_group()


def trainable(model: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def _is_model(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module)
