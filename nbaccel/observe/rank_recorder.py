"""The recorder on each rank: loss and throughput from any training loop to the live view, the
Accelerator's (``accelerator.recorder``) or your own.

In a worker started by ``notebook_launcher`` the numbers go to the notebook that launched it.
Anywhere else (a loop in the notebook itself, torchrun) they are kept in ``recorder.run`` and
the main process draws them: a panel in a notebook, a progress line in a terminal.

    recorder = Recorder(total_steps=epochs * len(loader))
    for inputs, labels in loader:
        ...
        recorder.log({"loss": loss}, samples=len(inputs))  # samples feed the throughput curve
    recorder.close()

``Tracker`` is its old name, kept as an alias: a *tracker* is now only what Accelerate calls one
(TensorBoard, MLflow, wandb: ``nbaccel.observe.trackers``).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..env import CHANNEL_VAR, METRICS_DIR_VAR, PANEL_VAR, DistEnv, device_label
from .channel import (
    ACCUMULATION,
    MEMORY,
    RSS,
    SAMPLES,
    STEPS,
    TOTAL_STEPS,
    Channel,
    flush_all,
    local_run,
)
from .meter import StepMeter
from .records import Run

if TYPE_CHECKING:
    from .breakdown import Breakdown
    from .live.view import LiveView  # a type here: the view is imported only to draw (below)


class Recorder:
    """Records this rank's numbers for the live view. Never blocks training and never raises on a
    full buffer (drops are counted).

    Args:
        total_steps: the number of ``log`` calls to expect; the progress line shows an ETA.
        live: draw the view on the main process when nobody else does (``False``: only record),
            or a ``LiveView`` to draw into.
        memory: a callable returning this rank's peak GPU memory in MiB, sampled with the
            counters (``channel.MEMORY``).
        device: the device the loop trains on (the Accelerator's): it names the run's device
            unless a launcher's run did, and on CUDA gives ``memory`` (the peak allocated).
        clock: seconds for the quarter-second pace of the counters (tests pass their own).
        rss: a callable returning this process's CPU memory (resident set size) in MiB, read
            at every counters' interval, never per step (``channel.RSS``); tests pass their
            own.
        meter: the step meter that counts for it and times the loop (``StepMeter``, the
            Accelerator's; an untimed one by default): the time split's ``TIME_*`` counters
            are recorded with the others. It is ``recorder.meter``.
    """

    def __init__(
        self,
        total_steps: int | None = None,
        live: bool | LiveView = True,
        memory: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        device: Any = None,
        meter: StepMeter | None = None,
        rss: Callable[[], float | None] | None = None,
    ) -> None:
        env = DistEnv.from_environ()
        self.rank = env.rank
        self.run: Run | None = None  # kept here only when no launcher listens
        if os.environ.get(CHANNEL_VAR) is None and not os.environ.get(METRICS_DIR_VAR):
            self.run = local_run.get() or Run(world_size=1)
            if env.is_distributed:
                self.run.label = f"rank {env.rank} of {env.world_size}"
        self.channel = Channel.from_environ(env.rank, self.run)
        if self.channel.connected or local_run.get() is not None:
            _unclosed.add(self)  # a launch's: closed once its function is done (close_all)
        self._live = bool(live) and self.run is not None and env.rank == 0
        self._view: LiveView | None = None if isinstance(live, bool | int) else live
        self._memory = memory
        self._rss = rss or _rss_mib
        self.meter = StepMeter() if meter is None else meter
        self.meter.recorder = self
        self.clock = clock
        self.samples = 0  # cumulative on this rank
        self.optimizer_steps = 0
        self._calls = 0
        self.next_tick = 0.0  # tick()'s next deadline on ``clock`` (see ``count``)
        self._last_counters: tuple[int, int] | None = None
        self._total_steps: int | None = None
        self._accumulation = 1
        if total_steps is not None:
            self.total_steps = total_steps
        self.on_device(device)

    def on_device(self, device: Any) -> None:
        """The loop's device, also when told after the recorder was made (a tracker's first
        ``log`` before ``LiveTracker.watch``): it names the run's device and, on CUDA, gives the
        peak memory, where nothing did yet."""
        if device is None:
            return
        if self.run is not None and self.run.device is None:
            self.run.device = device_label(device.type)
        if device.type == "cuda" and self._memory is None:
            self._memory = functools.partial(_peak_memory_mb, device)

    @property
    def total_steps(self) -> int | None:
        return self._total_steps

    @total_steps.setter
    def total_steps(self, value: int) -> None:
        self._total_steps = value
        self.channel.add(0, {TOTAL_STEPS: float(value)})

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (the Accelerator's ``gradient_accumulation_steps``):
        recorded when above 1, so the line counts the total as it counts the steps."""
        return self._accumulation

    @accumulation.setter
    def accumulation(self, value: int) -> None:
        self._accumulation = value
        if value > 1:
            self.channel.add(0, {ACCUMULATION: float(value)})

    def log(
        self, values: Mapping[str, Any], step: int | None = None, samples: int | None = None
    ) -> dict[str, float]:
        """Record numbers (floats, ints, 0-d tensors) and return them as floats. ``step``
        defaults to the number of earlier ``log`` calls on this rank, which lines the ranks up;
        ``samples`` adds to the count that throughput is computed from (the Accelerator counts
        them by itself)."""
        record: dict[str, float] = {}
        for key, value in values.items():
            if hasattr(value, "numel") and hasattr(value, "item"):  # a tensor, without torch
                if value.numel() != 1:
                    raise TypeError(
                        f"log() got {key}= a tensor of shape {tuple(value.shape)}; log single "
                        f"numbers, e.g. {key}=tensor.mean()"
                    )
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"log() got {key}={value!r}; it records numbers only")
            record[key] = float(value)
        self.channel.add(self._calls if step is None else step, record)
        self._calls += 1
        if samples:
            self.samples += samples
        self.tick()
        return record

    @property
    def breakdown(self) -> Breakdown | None:
        """Where this rank's time went: the meter's time split (None: untimed)."""
        return self.meter.times

    def count(self, samples: int = 0, optimizer_steps: int = 0) -> None:
        """Add samples and optimizer steps to the counters. The Accelerator's loop counts
        through its step meter instead (``meter.batch_ready``, ``meter.stepped``), which adds
        to ``samples`` or ``optimizer_steps`` and calls ``tick()`` when ``clock()`` reaches
        ``next_tick``, as this does."""
        self.samples += samples
        self.optimizer_steps += optimizer_steps
        if self.clock() >= self.next_tick:  # tick()'s test first: twice a training step
            self.tick()

    def tick(self) -> None:
        """Every quarter second: record the counters, send, redraw. Cheap between times."""
        now = self.clock()
        if now < self.next_tick:
            return
        self.next_tick = now + 0.25
        self._record_counters()
        self.channel.tick()
        if self._live:
            self._view = self._view or _new_view()
            self._view.update(self.run)

    def epoch_done(self) -> None:
        """Bring the counters and the progress line up to date (the panel keeps its pace)."""
        self.next_tick = 0.0
        if self._view is not None:
            self._view.refresh_text()
        self.tick()

    def _record_counters(self, last: bool = False) -> None:
        # CPU memory is a gauge, not a count: recorded at every interval, counted or not, so
        # a rank whose memory grows in a loop that counts nothing still shows it (and the
        # report of a rank killed by SIGKILL has its last value: ``launch.memory``)
        gauges = {} if (rss := self._rss()) is None else {RSS: rss}
        if not (self.samples or self.optimizer_steps):
            # counted nothing (another recorder on this rank counts): a 0 is no rate
            if gauges:
                self.channel.add(self.optimizer_steps, gauges)
            return
        if (self.samples, self.optimizer_steps) == self._last_counters:
            # nothing new: a repeat would read as a rate of zero; the times' last word counts
            split = self.meter.times
            if last and split is not None and (times := split.counters()):
                gauges.update(times)
            if gauges:
                self.channel.add(self.optimizer_steps, gauges)
            return
        self._last_counters = (self.samples, self.optimizer_steps)
        counters = {SAMPLES: float(self.samples), **gauges}
        if self.optimizer_steps:  # a loop that counts no steps shows its log calls as steps
            counters[STEPS] = float(self.optimizer_steps)
        if self._memory is not None:
            counters[MEMORY] = self._memory()
        if self.meter.times is not None:
            counters.update(self.meter.times.counters())
        self.channel.add(self.optimizer_steps, counters)

    def close(self) -> None:
        """Send the last numbers and draw the final view (safe to call twice)."""
        _unclosed.discard(self)
        self._record_counters(last=True)
        self.channel.flush()
        if self.run is not None and self.run.finished is None and self._live:
            self.run.finished = time.time()  # this rank draws its own run: it ended here
        if self._view is not None:
            self._view.close(self.run)

    def __getstate__(self) -> dict:
        """A pickled copy draws nothing (the view is the original's) and sends nothing
        (``Channel.__getstate__``)."""
        return {**self.__dict__, "_view": None, "_live": False}

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Tracker = Recorder  # the old name (before the glossary gave "tracker" to Accelerate's sense)

#: This process's recorders made by a launched function (a worker's, or a one-process launch's in
#: the notebook), until they are closed. A function that returns without ``end_training()`` drops
#: its Accelerator, and with it the numbers of its last quarter second (all of them, in a shorter
#: run) and the view's last drawing: ``close_all`` sends and draws them.
_unclosed: set[Recorder] = set()


def close_all() -> None:
    """Close the recorders nobody closed: the worker (or a one-process launch in the notebook)
    calls it when the function has returned or raised, before it reports. A failure here is
    printed, and the function's outcome stands."""
    for recorder in list(_unclosed):
        try:
            recorder.close()
        except Exception as err:  # the numbers are lost; the value or error still goes back
            _unclosed.discard(recorder)
            print(f"nbaccel: the last numbers of this rank were not sent: {err!r}", file=sys.stderr)
    flush_all()  # and what any other channel still holds


def _new_view() -> LiveView:
    """The main process's view of a loop that no launcher draws: only now is the view
    imported, so a worker that sends its numbers to the notebook never imports it."""
    from .live.view import LiveView

    return LiveView(save_png=os.environ.get(PANEL_VAR))


def _rss_mib() -> float | None:
    """This process's resident set size in MiB, read a few times a second; None where the
    platform will not say. The process alone, not its children: see ``channel.RSS``. On Linux,
    ``/proc/self/statm`` through a descriptor kept open (psutil opens the file at every reading:
    6 times the time, and the readings land in the training's steps); opened anew in a forked
    child, whose PID differs (the inherited one is left alone: the child may have reused its
    number). Elsewhere psutil's ``Process``, kept likewise."""
    global _statm, _this_process
    pid = os.getpid()
    if _statm is not False:
        try:
            if _statm is None or _statm[0] != pid:
                _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
            return int(os.pread(_statm[1], 64, 0).split()[1]) * _PAGE / 2**20
        except (OSError, ValueError, IndexError):
            _statm = False  # no procfs: psutil, from now on
    import psutil  # not at import time: a worker that never records need not load it

    try:
        if _this_process is None or _this_process.pid != pid:
            _this_process = psutil.Process()
        return _this_process.memory_info().rss / 2**20
    except (psutil.Error, OSError):
        return None


_statm: Any = None  # (pid, descriptor of its /proc/self/statm); False where there is none
_this_process: Any = None  # psutil.Process of this PID, once read
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _peak_memory_mb(device: Any) -> float:
    import torch  # only a CUDA run samples it

    return torch.cuda.max_memory_allocated(device) / 2**20
