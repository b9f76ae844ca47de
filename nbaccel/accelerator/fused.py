"""The two calls of every step that do the most on nbaccel's side, each in one Python frame:
``Accelerator.backward`` and the prepared optimizer's ``step``.

A step of an Accelerate loop calls nbaccel about eight times (the loader's ``next``,
``accumulate`` and its block, the forward, ``backward``, ``step``, ``zero_grad``). Between a
step's operators, which leave the CPU's caches cold, each Python call costs about a microsecond:
a share of a small CPU step that the time breakdown's spans and the calls between nbaccel's own
parts add to (``benchmarks/results/overhead-*``). So these two do in their own frame what would
otherwise take three calls each:

* ``backward``: ``Strategy.backward`` (the loss divided for accumulation, ``loss.backward()``)
  inside ``Breakdown.call``'s compute span;
* ``step``: the optimizer's ``step`` inside the span, then ``AccumulationWindow.stepped``.

They take this way only where it does exactly what the calls do (``backward_by_calls`` and
``step_by_calls``; ``tests/accelerator/test_fused.py`` compares the two ways, clock reading by
clock reading): the strategy's ``backward``
is ``Strategy``'s own and has nothing to scale (``Strategy.plain_backward``), there is no
closure, and the breakdown is off or times by host clocks with no span open. Everywhere else
(fp16's scaler, DDP, DeepSpeed, a closure, CUDA's events, a span already open) they make the
calls. Both are assigned to their names in their classes (``accelerator.py``, ``optim.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .accelerator import Accelerator
    from .optim import AcceleratedOptimizer


def backward(self: Accelerator, loss: torch.Tensor, **kwargs: Any) -> None:
    """``loss.backward()``, divided by ``gradient_accumulation_steps`` and scaled for fp16:
    pass the loss of one micro-batch as it is, without dividing it yourself."""
    window, strategy, span = self._window, self.strategy, self._breakdown
    if not strategy.plain_backward or (
        span is not None and (span.depth or span.events is not None)
    ):
        backward_by_calls(self, loss, **kwargs)
        return
    if not window.sync_gradients:
        window.holds_gradients = True  # zero_grad keeps them until the window's step
    if strategy.accumulation_steps > 1:  # Strategy.backward, inline
        loss = loss / strategy.accumulation_steps
    if span is None:
        loss.backward(**kwargs)
        return
    span.depth, span.ready = 1, None  # Breakdown.call, inline (the same reads and writes)
    began = span.clock()
    if span.start is None:
        span.start = began
    try:
        loss.backward(**kwargs)
    finally:
        span.depth = 0
        end = span.clock()
        span.compute += end - began
        if span.ready is not None:
            span.waited(end)


def step(self: AcceleratedOptimizer, closure: Any = None) -> None:
    """Step the optimizer at the end of an accumulation window; mid-window, do nothing."""
    window, span = self.window, self.breakdown
    if not window.sync_gradients:
        self.stepped = False  # mid-window: keep accumulating
        return
    if (
        closure is not None
        or self.precision.scaler is not None
        or (span is not None and (span.depth or span.events is not None))
    ):
        step_by_calls(self, closure)
        return
    if span is None:
        self.optimizer.step()
    else:
        span.depth, span.ready = 1, None  # Breakdown.call, inline
        began = span.clock()
        if span.start is None:
            span.start = began
        try:
            self.optimizer.step()
        finally:
            span.depth = 0
            end = span.clock()
            span.compute += end - began
            if span.ready is not None:
                span.waited(end)
    self.stepped, self.step_was_skipped = True, False
    window.last_step[id(self.optimizer)] = True  # AccumulationWindow.stepped, inline
    window.holds_gradients = False
    recorder = window.recorder
    if recorder is not None:  # Recorder.count(optimizer_steps=1), inline
        recorder.optimizer_steps += 1
        if recorder.clock() >= recorder.next_tick:
            recorder.tick()


def backward_by_calls(self: Accelerator, loss: torch.Tensor, **kwargs: Any) -> None:
    """What ``backward`` does, through the calls that it makes inline where it can."""
    window = self._window
    if not window.sync_gradients:
        window.holds_gradients = True
    self._timed(self.strategy.backward, loss, window.sync_gradients, **kwargs)


def step_by_calls(self: AcceleratedOptimizer, closure: Any = None) -> None:
    """What ``step`` does, through the calls that it makes inline where it can."""
    if not self.window.sync_gradients:
        self.stepped = False
        return
    if closure is None and self.precision.scaler is None:  # precision.step, a call less
        self._timed(self.optimizer.step)
        self.stepped = True
    else:
        self.stepped = self._timed(self.precision.step, self.optimizer, closure)
    self.step_was_skipped = not self.stepped
    self.window.stepped(self.optimizer, self.stepped)
