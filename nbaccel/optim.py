"""The optimizer and LR-scheduler wrappers that ``Accelerator.prepare`` returns.

They carry the accumulation rules: inside ``accumulate``, ``step()`` does nothing until the
window's last micro-batch, ``zero_grad()`` keeps gradients that no step has used yet, and the
scheduler advances only when its optimizer really stepped. They read the Accelerator's
``sync_gradients`` and ``precision``; nothing else.
"""

from __future__ import annotations

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
    """Steps an LR scheduler only when its optimizer really stepped.

    Mid-window micro-batches and fp16 steps skipped for inf/NaN gradients leave the learning
    rate where it is, so the schedule counts optimizer updates, as in single-process PyTorch.
    """

    def __init__(self, scheduler: Any, accelerator: Accelerator) -> None:
        self.scheduler = scheduler
        self._accelerator = accelerator

    def step(self, *args: Any, **kwargs: Any) -> None:
        raw = self.scheduler.optimizer
        mine = [o for o in self._accelerator._optimizers if o.optimizer is raw]
        if not self._accelerator.sync_gradients or not all(o.stepped for o in mine):
            return
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, last_epoch, ...
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
