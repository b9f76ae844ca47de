"""Gradient accumulation: the window of micro-batches whose gradients make one optimizer step.

One ``AccumulationWindow`` per Accelerator holds the whole state of accumulation, and the
prepared optimizers and schedulers consult it (``nbaccel.accelerator.optim``):

* ``accumulate``'s block (``MicroBatch``) opens the next micro-batch and decides whether it
  ends the window: then ``sync_gradients`` is True, DDP all-reduces and the optimizer really
  steps;
* ``backward`` notes gradients that no step has used yet (``holds_gradients``), which
  ``zero_grad`` must then keep;
* ``stepped`` is the window's end: the optimizer reports whether it changed the weights (fp16
  skips a step for inf/NaN gradients), which is what its scheduler asks before it steps.

These run on every step, where a Python call costs about 1 us of a small CPU step
(``benchmarks/results/overhead-parts-cpu.md``), so none makes one it can do without: the
block's ``__enter__`` does the window's arithmetic itself, ``Accelerator.backward`` sets
``holds_gradients`` itself, and ``stepped`` tells the step meter in one call
(``StepMeter.stepped``: the live view counts the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..observe.rank_recorder import Recorder


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


def accumulation_plugin(
    steps: int, plugin: GradientAccumulationPlugin | None
) -> GradientAccumulationPlugin:
    """The one plugin that ``gradient_accumulation_steps`` or ``gradient_accumulation_plugin``
    (Accelerate takes either, never both) describes."""
    if plugin is not None:
        if not isinstance(plugin, GradientAccumulationPlugin):
            raise TypeError(
                f"gradient_accumulation_plugin={plugin!r} must be a "
                "nbaccel.utils.GradientAccumulationPlugin"
            )
        if steps != 1:
            raise ValueError(
                "give gradient_accumulation_steps or gradient_accumulation_plugin, not both "
                "(the plugin's num_steps is the number of steps)"
            )
        return plugin
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(
            f"gradient_accumulation_steps={steps!r} must be an int "
            f"(got {type(steps).__name__}), e.g. 4."
        )
    if steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps={steps} must be a positive int; use 1 to step the "
            "optimizer on every batch."
        )
    return GradientAccumulationPlugin(num_steps=steps)


class AccumulationWindow:
    """Where the loop stands inside one optimizer step's micro-batches.

    Args:
        steps: micro-batches per window (a back end may have settled it: DeepSpeed's config).
        plugin: when windows end early (the data's end) and whether every micro-batch syncs.
        recorder: its step meter counts the optimizer steps that changed the weights, for the
            live view.
    """

    def __init__(
        self,
        steps: int,
        plugin: GradientAccumulationPlugin,
        recorder: Recorder | None = None,
    ) -> None:
        self.steps = steps
        self.plugin = plugin
        self.step = 0  # micro-batches opened, counted from the window's start
        self.sync_gradients = True  # False on the micro-batches that only accumulate
        self.holds_gradients = False  # gradients that no optimizer step has used yet
        self._meter = None if recorder is None else recorder.meter
        self._stepped: dict[int, bool] = {}  # id(optimizer) -> its last real step changed it

    @property
    def skips_sync(self) -> bool:
        """This micro-batch's gradients stay local (DDP's ``no_sync``)."""
        return not self.sync_gradients and not self.plugin.sync_each_batch

    def track(self, optimizer: Any, stepped: bool = True) -> None:
        """A prepared optimizer (``stepped``: whether its scheduler may step, as in Accelerate:
        until a step is skipped it may, before the first step too)."""
        self._stepped[id(optimizer)] = stepped

    def stepped(self, optimizer: Any, changed: bool) -> None:
        """The window's end: ``optimizer`` stepped, and ``changed`` says if the weights moved."""
        self._stepped[id(optimizer)] = changed
        self.holds_gradients = False
        if self._meter is not None:
            self._meter.stepped(changed)

    def has_stepped(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s last real step changed the weights (True for one that was not
        prepared: its scheduler steps with each window)."""
        return self._stepped.get(id(optimizer), True)


class MicroBatch:
    """``Accelerator.accumulate``'s block: entering it opens the window's next micro-batch, and
    on a micro-batch that only accumulates, enters ``no_sync`` for each model (DDP skips its
    all-reduce). A plain class, not a generator: it runs on every step (a generator-based
    context manager and its ``ExitStack`` cost several microseconds there).

    Args:
        window: the Accelerator's accumulation window.
        loop: the Accelerator's ``LoopState``: whether this is a prepared DataLoader's last
            batch (``end_of_dataloader``), read on entering.
        no_sync: the strategy's ``no_sync(model)``.
        models: the models ``accumulate`` was given.
    """

    __slots__ = ("_loop", "_models", "_no_sync", "_stack", "_window")

    def __init__(self, window: AccumulationWindow, loop: Any, no_sync: Callable, models: tuple):
        self._window, self._loop, self._no_sync, self._models = window, loop, no_sync, models
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        window, active = self._window, self._loop.active
        if active and active[-1].end and window.plugin.sync_with_dataloader:
            window.step = 0  # a prepared DataLoader's last batch ends the window; the next
            window.sync_gradients = True  # epoch starts a fresh one
        else:
            window.step += 1
            window.sync_gradients = window.step % window.steps == 0
        if self._models and window.skips_sync:
            with contextlib.ExitStack() as stack:
                for model in self._models:
                    stack.enter_context(self._no_sync(model))
                self._stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> bool | None:
        stack, self._stack = self._stack, None
        return None if stack is None else stack.__exit__(*exc)
