"""Where each rank's training time goes: waiting for data, computing, communicating, the rest.

Every rank keeps one ``Breakdown``: cumulative seconds since its loop's first timed moment (in
a training loop, the first batch asked of a prepared DataLoader). The recorder records them
with its other counters every quarter second (``channel.TIME_*``); ``Run.breakdown()`` reads
them in the notebook, and ``Run.straggler()`` names the rank the others wait for.

* **data**: inside the prepared DataLoader, from asking for a batch to getting it on the device.
* **compute**: the prepared model's forward, ``Accelerator.backward`` and the prepared
  optimizer's ``step``, minus the communication measured inside them.
* **communication**: time blocked in collectives, beyond what overlapped with compute.

  - DDP: a communication hook (torch's own ``allreduce_hook``, unchanged, or the user's) notes
    when each gradient bucket is ready. The all-reduces of the earlier buckets run while backward
    computes the later ones; what backward spends after its *last* bucket was ready is the
    waiting: for the slowest rank, and for the reduction itself.
  - FSDP2 on CPU: the time inside its all-gathers and reduce-scatters (gloo blocks in them),
    through FSDP2's ``set_custom_all_gather``/``set_custom_reduce_scatter`` with its own
    default collectives inside (``strategies/fsdp.py``).
  - nbaccel's own collectives: ``gather``, ``reduce``, ``pad_across_processes``,
    ``wait_for_everyone``, ``check_trigger``, ``gather_for_metrics``.
* **other** (``Run.breakdown``): the rest of the loop's wall time: its own Python, logging,
  evaluation, checkpoints.

What is not measured, and lands in compute instead:

* DeepSpeed's collectives: they go through ``deepspeed.comm`` inside the engine, and the only
  way in that DeepSpeed offers (its comms logger) synchronises the device after every
  collective and keeps every latency it measured. Its forward, backward and step are compute.
* FSDP2 on CUDA, and FSDP2's explicit prefetching (``async_op``): the collectives run on their
  own streams or return a handle that FSDP waits on later, so the time around the call is not
  the time blocked.
* Nothing is lost to a communication hook of your own. DDP takes one hook, so the prepared
  model's ``register_comm_hook`` (and ``DistributedDataParallelKwargs(comm_hook=...)``, which
  goes through it) wraps yours: it notes the bucket's readiness, then runs your hook unchanged
  (``accelerator/strategies/ddp.py``). Only a hook put on the model behind nbaccel's back
  (``DistributedDataParallel.register_comm_hook(model, ...)``) leaves backward all compute.
  Register yours before the first ``backward``: one registered later meets torch's "can only
  be called once".

CUDA: host clocks time only the launching of asynchronous kernels. On a CUDA device the
compute spans are timed by CUDA events, at most two a step (``cuda_events.StepEvents``), on
the stream that was current at the first one, read once they have completed
(``Event.query()``): never a synchronisation, and no new event after the first steps. Data and
nbaccel's collectives keep host clocks (they block the host anyway). The GPU tier
(``tests/gpu``) runs this path; a CPU test counts its calls with stand-in events
(``tests/observe/test_meter.py``).

Each step times one interval, in turn: the forward span, the backward span, the optimizer's
step span, or DDP's wait (its last bucket ready to backward's end), the step's kind drawn at
random. The host counts every interval (the CPU path's definitions); a
timed one stands for those of its kind since the one timed before it, so the totals estimate
the same quantities the CPU path measures; they say so (``ESTIMATED``, ``Run.estimated()``,
the panel's bars). Every span timed cost lesson 5's 1.3 ms H200 step about 7% (0.911 of plain
PyTorch with it, 0.983 without: ``results/gpu-step.md``). On the CPU every span is timed: host
clocks cost little there.

Off: ``NBACCEL_BREAKDOWN=0`` times nothing and wraps or hooks nothing (``for_device`` returns
None). The step's events reach a ``Breakdown`` through the rank's step meter
(``nbaccel.observe.meter``): the Accelerator's modules call the meter, never this module.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..env import BREAKDOWN_VAR
from . import stacks
from .channel import ESTIMATED, TIME_COMMUNICATION, TIME_COMPUTE, TIME_DATA, TIME_LOOP
from .cuda_events import FORWARD, ROTATION, StepEvents, cuda_timing

if TYPE_CHECKING:
    import torch


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """On unless ``NBACCEL_BREAKDOWN=0``."""
    environ = os.environ if environ is None else environ
    return environ.get(BREAKDOWN_VAR, "1").strip() != "0"


def for_device(device: torch.device) -> Breakdown | None:
    """This rank's breakdown, on CUDA timed by events; None when switched off."""
    if not enabled():
        return None
    if device.type != "cuda":
        return Breakdown()
    make, stream = cuda_timing(device)
    return Breakdown(events=StepEvents(make, stream))


class Breakdown:
    """Cumulative seconds of one rank's loop: data, compute, communication, and the loop.

    Compute spans (forward, backward, step) may nest (an optimizer's closure runs forward and
    backward inside ``step``): the outermost one counts.

    >>> b = Breakdown()
    >>> with b:  # a compute span
    ...     pass
    >>> sorted(b.counters())
    ['nbaccel/time/communication', 'nbaccel/time/compute', 'nbaccel/time/data', 'nbaccel/time/loop']
    """

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, events: StepEvents | None = None
    ) -> None:
        self.clock = clock
        self.data = 0.0
        self.compute = 0.0  # the compute spans' whole length, communication inside included
        self.communication = 0.0
        self.start: float | None = None  # the loop's first timed moment
        self._inside = 0.0  # communication measured inside compute spans
        self._depth = 0  # compute spans open now
        self._span = 0.0  # when the outermost one began
        self._ready: float | None = None  # when this span's last gradient bucket was ready
        self._kind = FORWARD  # the next outermost span's kind (the events' rotation)
        self._events = events
        if events is not None:
            events.owner = self

    def now(self) -> float:
        """The clock, which starts the loop on its first reading."""
        now = self.clock()
        if self.start is None:
            self.start = now
        return now

    # -- data ----------------------------------------------------------------------------------
    def waited_for_data(self, since: float) -> None:
        self.data += self.clock() - since

    # -- compute: ``with breakdown:``, ``TimedForward`` or the forward hooks ---------------------
    def __enter__(self) -> Breakdown:
        self._depth += 1
        if self._depth == 1:
            self._span = now = self.clock()  # now(), inline: three spans a step
            if self.start is None:
                self.start = now
            self._ready = None
            if self._events is not None:
                self._events.begin(self._kind)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._events is not None:
            if self._ready is not None:
                self._ready = None
                stacks.waiting_in(None)  # backward has returned: the all-reduces are done
            kind, self._kind = self._kind, FORWARD
            self._events.end(kind)
            return
        end = self.clock()
        self.compute += end - self._span
        if self._ready is not None:
            self._waited(end)

    def _waited(self, end: float) -> None:
        """The span's waiting after its last gradient bucket was ready (DDP's), on the host."""
        ready, self._ready = self._ready, None
        stacks.waiting_in(None)  # backward has returned: the all-reduces are done
        self.communication += end - ready
        self._inside += end - ready

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as a compute span: what ``with self:`` does, in one Python
        call where the ``with`` makes two. The prepared model's forward, ``backward`` and the
        optimizer's ``step`` take this way every step on the host (``caller``); a nested span,
        and CUDA's events, take the ``with``."""
        if self._depth or self._events is not None:
            with self:
                return fn(*args, **kwargs)
        self._depth = 1
        self._ready = None
        self._span = began = self.clock()
        if self.start is None:
            self.start = began
        try:
            return fn(*args, **kwargs)
        finally:  # __exit__, inline
            self._depth = 0
            end = self.clock()
            self.compute += end - began
            if self._ready is not None:
                self._waited(end)

    def caller(self, kind: int) -> Callable[..., Any]:
        """What runs a call as a compute span of ``kind`` (``FORWARD``, ``BACKWARD``, ``STEP``):
        ``call`` itself on the host, where the kind changes nothing; with events, a call that
        names its kind to them."""
        if self._events is None:
            return self.call
        return functools.partial(self._call_as, kind)

    def _call_as(self, kind: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if not self._depth:
            self._kind = kind
        with self:
            return fn(*args, **kwargs)

    def before_forward(self, module: Any, args: Any) -> None:
        self.__enter__()

    def after_forward(self, module: Any, args: Any, output: Any) -> None:
        self.__exit__()

    def watch(self, model: torch.nn.Module, hooks: bool = False) -> torch.nn.Module:
        """Time ``model``'s forward as compute: its ``forward`` wrapped (``TimedForward``),
        or with ``hooks`` as the first of its pre-hooks and the last of its hooks, so that a
        sharded model's own gathering before and after counts inside. The wrapper costs the
        step less: a module with hooks takes ``nn.Module``'s slower call path (the breakdown's
        cost, on over off, in ``benchmarks/results/overhead-cpu.md``: about 0.5% of a small
        step with the wrapper, 1% with the hooks)."""
        if hooks:
            model.register_forward_pre_hook(self.before_forward, prepend=True)
            model.register_forward_hook(self.after_forward, always_call=True)
        else:
            model.forward = TimedForward(model.forward, self.caller(FORWARD))
        return model

    # -- communication -------------------------------------------------------------------------
    def bucket_ready(self) -> None:
        """A DDP gradient bucket is ready and its all-reduce starts (the comm hook's note)."""
        if not self._depth:
            return  # a backward outside Accelerator.backward: nothing to split
        stacks.waiting_in("DDP's gradient all_reduce")
        self._ready = self.clock()
        if self._events is not None:
            self._events.ready()

    def communicated(self, seconds: float) -> None:
        """``seconds`` blocked in a collective (inside a compute span: taken out of it)."""
        self.communication += seconds
        if self._depth:
            self._inside += seconds

    def add_span(self, seconds: float, communication: float = 0.0) -> None:
        """A compute span timed from outside (``hf/tracker.py``, ``hf/callback.py``: hooks on a
        loop that is not nbaccel's), with ``communication`` the part of it blocked in
        collectives."""
        self.compute += seconds
        self.communication += communication
        self._inside += communication

    def counters(self) -> dict[str, float]:
        """The ``TIME_*`` counters now; nothing before the loop's first timed moment."""
        if self.start is None:
            return {}
        times, compute, waited = {}, 0.0, 0.0
        if self._events is not None:
            self._events.resolve()
            compute, waited = self._events.tail()  # the steps since each kind's last sample
            new = self._events.estimated - self._events.said  # each said once, with the times
            self._events.said |= new
            times = {ESTIMATED + part: float(ROTATION) for part in sorted(new)}
        return {
            TIME_DATA: self.data,
            TIME_COMPUTE: max(self.compute + compute - self._inside - waited, 0.0),
            TIME_COMMUNICATION: self.communication + waited,
            TIME_LOOP: self.clock() - self.start,
            **times,
        }


class TimedForward(functools.partial):
    """A model's ``forward`` run inside a compute span (``Breakdown.watch``): ``call``, the
    breakdown's forward caller (``Breakdown.caller``), with ``forward`` bound, a partial that
    C calls, so that timing costs the forward one Python call (the span's). ``forward`` may
    itself be a wrapper (``AutocastForward``): the span holds it whole."""

    def __new__(cls, forward: Callable[..., Any], call: Callable[..., Any]) -> TimedForward:
        return super().__new__(cls, call, forward)

    @property
    def forward(self) -> Callable[..., Any]:
        return self.args[0]

    def around(self, forward: Callable[..., Any]) -> TimedForward:
        """``forward`` timed as this one is (the same span's caller)."""
        return TimedForward(forward, self.func)

    def __reduce__(self) -> tuple:
        return TimedForward, (self.forward, self.func)


def untimed(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: a compute span's caller when the breakdown is off."""
    return fn(*args, **kwargs)


@contextlib.contextmanager
def communicating(breakdown: Breakdown | None, label: str) -> Iterator[None]:
    """Around a blocking collective: the time counts as communication, and the stack reporter
    (``stacks.waiting``) can name ``label`` if the rank hangs in it."""
    stacks.waiting_in(label)
    began = None if breakdown is None else breakdown.now()
    try:
        yield
    finally:
        stacks.waiting_in(None)
        if breakdown is not None:
            breakdown.communicated(breakdown.clock() - began)


def timed_allreduce(state, bucket):  # unannotated: DDP refuses any but its own types
    """DDP's communication hook: torch's own all-reduce of the bucket (``allreduce_hook``:
    divide by the world size, then sum), after noting that the bucket is ready. ``state`` is
    ``(meter, process_group)``: the step meter's ``hook_state``, or a ``Breakdown`` itself.

    With a power-of-two world size it gives DDP's own gradients bit for bit (DDP without a
    hook multiplies by ``1/N`` where the hook divides by ``N``: the same for ``N = 2, 4, 8``,
    possibly not in the last bit otherwise)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    noted, group = state
    noted.bucket_ready()
    return allreduce_hook(group, bucket)
