"""The optimizer and LR-scheduler wrappers that ``Accelerator.prepare`` returns.

They carry the accumulation rules: inside ``accumulate``, ``step()`` does nothing until the
window's last micro-batch, ``zero_grad()`` keeps gradients that no step has used yet, and the
scheduler advances only when its optimizer really stepped (``num_processes`` times: see
``AcceleratedScheduler``). They read the Accelerator's ``sync_gradients``, ``precision``,
``num_processes``, ``split_batches`` and ``step_scheduler_with_optimizer``; nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .accelerator import Accelerator


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so ``step``/``zero_grad`` follow the accumulation window.

    Subclasses ``Optimizer`` so LR schedulers accept it; its state lives in the wrapped one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: Accelerator) -> None:
        # Optimizer.__init__ is not called: param_groups and state belong to ``optimizer``.
        self.optimizer = optimizer
        self._accelerator = accelerator
        self.step_was_skipped = False  # fp16 found inf/NaN gradients on the last real step
        self.stepped = False  # the last step() call changed the weights

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self):  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self.optimizer.defaults = value

    def step(self, closure=None):  # type: ignore[override]
        if not self._accelerator.sync_gradients:
            self.stepped = False  # mid-window: keep accumulating
            return None
        self.stepped = self._accelerator.precision.step(self.optimizer, closure)
        self.step_was_skipped = not self.stepped
        self._accelerator.tracker.count(optimizer_steps=int(self.stepped))
        self._accelerator._grads_pending = False
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._accelerator._grads_pending:
            return  # these gradients belong to a window whose step has not happened yet
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)


class AcceleratedScheduler:
    """Steps an LR scheduler when its optimizer really stepped, once per process.

    The rule (Accelerate's): a scheduler is built before ``prepare``, from the unsharded
    DataLoader, so its length counts the batches of one process. On N processes each optimizer
    step consumes N such batches, so the scheduler advances N times; the schedule then lasts
    the same epochs on any number of processes. With ``split_batches`` each step consumes one
    global batch, and it advances once. Mid-window micro-batches and fp16 steps skipped for
    inf/NaN gradients leave the learning rate where it is.

    ``Accelerator(step_scheduler_with_optimizer=False)`` turns all of this off: each ``step()``
    steps the scheduler once, unconditionally (for schedules the loop steps per epoch).

    Two guards keep numbers right where following the rule literally would not: a schedule
    with a ``total_steps`` (``OneCycleLR``) is never stepped past its end (the last global batch
    may be topped up), and ``ReduceLROnPlateau``, whose clock is its metric's evaluations,
    steps once per call: N steps with one metric would spend its patience N times as fast.
    (Accelerate steps it N times; this is where nbaccel differs.)
    """

    def __init__(self, scheduler: Any, accelerator: Accelerator) -> None:
        self.scheduler = scheduler
        self._accelerator = accelerator

    def step(self, *args: Any, **kwargs: Any) -> None:
        accelerator = self._accelerator
        if not accelerator.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        raw = self.scheduler.optimizer
        mine = [o for o in accelerator._optimizers if o.optimizer is raw]
        if not accelerator.sync_gradients or not all(o.stepped for o in mine):
            return
        plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        times = 1 if plateau or accelerator.split_batches else accelerator.num_processes
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(times):
            if total is not None and self.scheduler.last_epoch >= total:
                break  # OneCycleLR raises past its last step
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, last_epoch, ...
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


@dataclass(frozen=True)
class GradientAccumulationPlugin:
    """Accelerate's accumulation options: ``Accelerator(gradient_accumulation_plugin=...)``.

    Args:
        num_steps: micro-batches per optimizer step (``gradient_accumulation_steps``).
        adjust_scheduler: accepted for Accelerate's scripts; either way nbaccel's scheduler
            counts real optimizer steps (in Accelerate, too, it only moves a counter of torch's
            that warns about step order, never the learning rate).
        sync_with_dataloader: end the window on a prepared DataLoader's last batch (default);
            False lets a window run on into the next epoch.
        sync_each_batch: all-reduce the gradients on every micro-batch instead of holding them
            unsynced until the window's end: less memory, more traffic. Same numbers.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        steps = self.num_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"GradientAccumulationPlugin(num_steps={steps!r}): give the micro-batches per "
                "optimizer step as a positive int, e.g. num_steps=4"
            )
        for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GradientAccumulationPlugin({name}=...) must be True or False")
