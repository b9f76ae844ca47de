"""The optimizer and LR-scheduler wrappers that ``Accelerator.prepare`` returns.

They carry the accumulation rules, asking the Accelerator's ``AccumulationWindow``
(``nbaccel.accelerator.accumulation``): inside ``accumulate``, ``step()`` does nothing until the
window's last micro-batch, ``zero_grad()`` keeps gradients that no step has used yet, and the
scheduler advances only when its optimizer really stepped (``num_processes`` times: see
``AcceleratedScheduler``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..observe.meter import untimed
from .accumulation import AccumulationWindow

if TYPE_CHECKING:
    from ..observe.meter import StepMeter
    from .precision import Precision


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so ``step``/``zero_grad`` follow the accumulation window.

    Subclasses ``Optimizer`` so LR schedulers accept it; its state lives in the wrapped one.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        window: AccumulationWindow,
        precision: Precision,
        meter: StepMeter | None = None,
    ) -> None:
        # Optimizer.__init__ is not called: param_groups and state belong to ``optimizer``.
        self.optimizer = optimizer
        self.window = window
        self.precision = precision
        self.meter = meter  # times step() as compute
        # runs step() as a compute span (or untimed), looked up once
        self._timed = untimed if meter is None else meter.optimizer_step
        window.track(optimizer)
        self.step_was_skipped = False  # fp16 found inf/NaN gradients on the last real step
        self.stepped = False  # the last step() call changed the weights

    @property
    def _is_overflow(self) -> bool:
        """Accelerate's name for ``step_was_skipped``; setting it (as Accelerate's tests do)
        tells the scheduler whether the last step counts."""
        return self.step_was_skipped

    @_is_overflow.setter
    def _is_overflow(self, value: bool) -> None:
        self.step_was_skipped = bool(value)
        self.window.track(self.optimizer, stepped=not value)

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
        if not self.window.sync_gradients:
            self.stepped = False  # mid-window: keep accumulating
            return None
        if closure is None and self.precision.scaler is None:  # precision.step, a call less
            self._timed(self.optimizer.step)
            self.stepped = True
        else:
            self.stepped = self._timed(self.precision.step, self.optimizer, closure)
        self.step_was_skipped = not self.stepped
        self.window.stepped(self.optimizer, self.stepped)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.window.holds_gradients:
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

    Args:
        scheduler: the user's scheduler, built over the user's optimizer.
        window: the Accelerator's accumulation window.
        batches_per_step: the loader's batches one optimizer step consumes (``num_processes``;
            1 with ``split_batches``); ``None`` steps once per call, unconditionally.
    """

    def __init__(
        self, scheduler: Any, window: AccumulationWindow, batches_per_step: int | None
    ) -> None:
        self.scheduler = scheduler
        self.window = window
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.batches_per_step = 1 if plateau and batches_per_step else batches_per_step

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.batches_per_step is None:  # step_scheduler_with_optimizer=False
            self.scheduler.step(*args, **kwargs)
            return
        if not self.window.sync_gradients or not self.window.has_stepped(self.scheduler.optimizer):
            return
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.batches_per_step):
            if total is not None and self.scheduler.last_epoch >= total:
                break  # OneCycleLR raises past its last step
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, last_epoch, ...
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
