"""The step meter: the few events of a training step, as the Accelerator's parts tell them.

One ``StepMeter`` a rank, owned by its recorder (``recorder.meter``). The prepared DataLoader,
the accumulation window, the optimizer wrapper, the collectives of ``PartialState``, the
handlers and the strategies call it; it turns what they say into the recorder's counts and the
time split's seconds (``nbaccel.observe.breakdown``), so none of them writes either:

==========================  =================================================================
``batch_ready``             a batch is on the device: its samples, the wait for it (data)
``call``, ``backward``,     a compute span around one call: the forward (``watch``), the
``optimizer_step``          backward, the optimizer's step
``bucket_ready``            DDP's gradient bucket is ready (the communication hook's note)
``communicating(label)``    a blocking collective, named for the hang reporter
``stepped``                 the optimizer stepped: one more step, if the weights moved
``epoch_done``              a pass of the prepared DataLoader is complete
==========================  =================================================================

On CUDA the batches ready bound the steps whose time the events sample (``cuda_events.py``).

With the time split off (``NBACCEL_BREAKDOWN=0``) the meter still counts samples and steps,
and times and wraps nothing: its compute spans are plain calls (``untimed``), ``watch`` leaves
the model as it is and ``timing`` is False, so nothing hooks DDP either.

Every step passes here, where a Python call costs about 1 us of a small CPU step
(``benchmarks/results/overhead-parts-cpu.md``): the spans' callers are the time split's own
bound methods, looked up once, not calls through this object, and a batch or a step is one
call each.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import breakdown as split
from .breakdown import TimedForward, timed_allreduce, untimed
from .cuda_events import BACKWARD, STEP

__all__ = ["StepMeter", "TimedForward", "communicating", "timed_allreduce", "untimed"]

if TYPE_CHECKING:
    import torch

    from .breakdown import Breakdown


class StepMeter:
    """This rank's step events, counted for ``recorder`` and timed by ``times`` (None: untimed).

    >>> meter = StepMeter(split.Breakdown())
    >>> meter.call(sum, [1, 2])  # a compute span
    3
    >>> meter.timing, StepMeter().timing
    (True, False)
    """

    def __init__(self, times: Breakdown | None = None) -> None:
        self.recorder: Any = None  # the Recorder that owns it (``Recorder(meter=...)``)
        # the models whose forward it times, held weakly: DDP's communication hook keeps the
        # meter from C++, where the garbage collector cannot see a cycle back to the model
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()
        self.time_with(times)

    @classmethod
    def for_device(cls, device: torch.device) -> StepMeter:
        """The meter of a loop on ``device``: timed by host clocks, by CUDA events on CUDA,
        untimed with ``NBACCEL_BREAKDOWN=0``."""
        return cls(split.for_device(device))

    def time_with(self, times: Breakdown | None) -> None:
        """Time the step by ``times`` from now on (None: time nothing): before the loop's parts
        look the span callers up (``call``, ``backward``, ``optimizer_step``; the watches of
        ``hf/``, which time through ``times`` itself, set it when they start)."""
        self.times = times
        self.timing = times is not None
        self.clock: Callable[[], float] | None = None if times is None else times.clock
        self._events = None if times is None else times._events
        if times is None:
            self.call = self.backward = self.optimizer_step = untimed
        else:
            self.call = times.call
            self.backward = times.caller(BACKWARD)
            self.optimizer_step = times.caller(STEP)

    # -- data ----------------------------------------------------------------------------------
    def now(self) -> float | None:
        """When the loop asked for a batch, on the meter's clock (None: untimed)."""
        return None if self.times is None else self.times.now()

    def batch_ready(self, samples: int, asked: float | None) -> None:
        """A batch of ``samples`` is ready, asked for at ``asked`` (``now()``, or ``clock()``
        after the first): the wait is data, the samples count, and on CUDA a step begins."""
        times = self.times
        if times is not None:
            times.data += times.clock() - asked
            if self._events is not None:
                self._events.batches = True
                self._events.step()
        recorder = self.recorder
        if recorder is not None:
            recorder.samples += samples
            if recorder.clock() >= recorder.next_tick:  # tick()'s test first
                recorder.tick()

    def epoch_done(self) -> None:
        """A pass of the prepared DataLoader is complete: its last step ends here."""
        if self._events is not None:
            self._events.step()
        if self.recorder is not None:
            self.recorder.epoch_done()

    # -- the optimizer -------------------------------------------------------------------------
    def stepped(self, changed: bool) -> None:
        """The optimizer stepped at the window's end; ``changed``: the weights moved (fp16 skips
        a step for inf/NaN gradients), and only then is it counted."""
        recorder = self.recorder
        if recorder is not None:
            recorder.optimizer_steps += changed
            if recorder.clock() >= recorder.next_tick:
                recorder.tick()

    # -- compute -------------------------------------------------------------------------------
    def watch(self, model: torch.nn.Module, hooks: bool = False) -> torch.nn.Module:
        """``model``, its forward timed as compute once, however often it is prepared
        (``Breakdown.watch``; ``hooks`` for a model whose own hooks gather its weights); as it
        is when untimed."""
        if self.times is not None and model not in self._watched:
            self._watched.add(self.times.watch(model, hooks))
        return model

    def __getstate__(self) -> dict:
        """A pickled copy (a pickled Accelerator's) keeps its times and counts; the models it
        watched are the original's, and a weak set does not pickle."""
        return {**self.__dict__, "_watched": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._watched = weakref.WeakSet()

    # -- communication -------------------------------------------------------------------------
    def bucket_ready(self) -> None:
        """A DDP gradient bucket is ready and its all-reduce starts."""
        if self.times is not None:
            self.times.bucket_ready()

    def communicating(self, label: str) -> contextlib.AbstractContextManager:
        """Around a blocking collective: its time is communication, and a rank that hangs in it
        is said to wait in ``label`` (``stacks.waiting_in``)."""
        return split.communicating(self.times, label)

    def hook_state(self, group: Any) -> tuple[StepMeter, Any]:
        """The state of ``timed_allreduce`` as DDP's communication hook on ``group``: the hook
        tells this meter of each bucket ready."""
        return self, group


def communicating(meter: StepMeter | None, label: str) -> contextlib.AbstractContextManager:
    """``meter.communicating(label)``, or the label alone where there is no meter (a bare
    ``PartialState``)."""
    return split.communicating(None if meter is None else meter.times, label)
