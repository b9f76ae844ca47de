"""Live plots for transformers' ``Trainer``: ``LiveCallback``.

    from nbaccel import LiveCallback, notebook_launcher

    def train():
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[LiveCallback()])
        trainer.train()

    notebook_launcher(train, num_processes=2, cpu=True)

Trainer calls its callbacks on every process, so every rank sends: what Trainer logs (loss,
learning rate, grad norm: every ``logging_steps``), its samples (the first dimension of each
training batch the model is given, read by a forward pre-hook) and its optimizer steps, with
the total Trainer plans (``max_steps``) for the progress line's ETA. Trainer's end-of-training
summary (``train_runtime``, ``train_samples_per_second``) is left out: those are Trainer's own
clock, and the panel's rates are the run's records.

Where time goes, from the callback's events (CPU; on CUDA nothing is timed, as host clocks time
only kernel launches there):

* **compute**: from ``on_step_begin`` to ``on_step_end``: the step's forward and backward passes
  (all its micro-batches), gradient clipping, the optimizer and the scheduler.
* **data**: from the end of Trainer's bookkeeping after the last step (its last ``on_log``,
  ``on_save`` or ``on_evaluate``, else ``on_step_end``) to ``on_step_begin``: the batches of the
  step are fetched there.
* **communication** is not measured apart: a callback is given the model before DDP wraps it,
  and DDP's gradient all-reduce runs inside backward, so it is in compute; the panel says so.
* **other**: the rest (Trainer's logging, evaluation, checkpoints).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError(
        "LiveCallback is a callback for transformers' Trainer, which is not installed here: "
        f'{sys.executable} -m pip install "nbaccel[transformers]" (or transformers itself)'
    ) from e

from ...tensors import samples_in
from ..breakdown import for_device
from . import common

#: Trainer's end-of-training summary: its own clock's figures, not the run's records.
SUMMARY = "train_runtime"


class LiveCallback(TrainerCallback):
    """``Trainer(..., callbacks=[LiveCallback()])`` draws Trainer's loss, learning rate,
    samples/s and step progress from every rank in the launching notebook's live view, kept as
    ``Run`` records (see the module's docstring for the time breakdown)."""

    def __init__(self) -> None:
        self.recorder: Any = None
        self.breakdown: Any = None
        self.began: float | None = None  # this step's on_step_begin
        self.after: float | None = None  # the end of Trainer's bookkeeping since the last step
        self._hook: Any = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.recorder = common.recorder(device=args.device)
        self.recorder.total_steps = state.max_steps
        if args.gradient_accumulation_steps > 1:
            self.recorder.accumulation = args.gradient_accumulation_steps
        device = args.device
        self.breakdown = for_device(device) if getattr(device, "type", "cpu") == "cpu" else None
        self.recorder.meter.time_with(self.breakdown)
        if self.breakdown is not None and args.world_size > 1:
            common.unmeasured(self.recorder, "communication")
        if model is not None:
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: Any, kwargs: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.recorder.count(samples=samples_in(kwargs or args))

    def _mark(self) -> None:
        """Trainer's bookkeeping ended here (for now): the wait for data starts."""
        if self.breakdown is not None:
            self.after = self.breakdown.now()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._mark()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.breakdown is not None:
            self.began = self.breakdown.now()
            if self.after is not None:
                self.breakdown.waited_for_data(self.after)

    def on_step_end(self, args, state, control, **kwargs):
        if self.breakdown is not None and self.began is not None:
            self.breakdown.add_span(self.breakdown.clock() - self.began)
            self.began = None
        self.recorder.count(optimizer_steps=1)
        self._mark()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and SUMMARY not in logs and self.recorder is not None:
            # Steps count from 0 in the records, as nbaccel's own do (the progress line counts
            # the last step + 1): Trainer's global step N (N optimizer steps taken) is step N - 1.
            self.recorder.log(common.numbers(logs), step=state.global_step - 1)
        self._mark()

    def on_save(self, args, state, control, **kwargs):
        self._mark()

    def on_evaluate(self, args, state, control, **kwargs):
        self._mark()

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.epoch_done()

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        common.close()
        self.recorder = self.breakdown = None
