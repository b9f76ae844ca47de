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

CUDA: host clocks time only the launching of asynchronous kernels. On a CUDA device the compute
spans are CUDA events recorded on the current stream at their boundaries (and at each gradient
bucket's readiness), read when they have completed (``Event.query()``) at the next record:
never a synchronisation per step, and no new event after the first steps. Data and nbaccel's
collectives keep host clocks (they block the host anyway). The GPU tier (``tests/gpu``) runs this
path.

The events time a sample: every span timed cost lesson 5's 1.3 ms H200 step 7% (``results/
gpu-step.md``). The first ``TIMED_FIRST`` spans are all timed; then, of every ``RUN * EVERY``,
``RUN`` in a row from a random place, each counting ``EVERY`` times: whole steps (forward,
backward, step), and what a loop does every N steps neither always in nor always out. What
they add to is an estimate, and says so (``ESTIMATED``, ``Run.estimated()``, the panel's bars).
On the CPU every span is timed: host clocks cost little there.

Off: ``NBACCEL_BREAKDOWN=0`` times nothing and wraps or hooks nothing (``for_device`` returns
None).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..env import BREAKDOWN_VAR
from . import stacks
from .channel import ESTIMATED, TIME_COMMUNICATION, TIME_COMPUTE, TIME_DATA, TIME_LOOP

if TYPE_CHECKING:
    import torch

#: CUDA's sample (``_Events``); 12 spans hold 4 steps of forward, backward and step.
TIMED_FIRST, RUN, EVERY = 64, 12, 8


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
    return Breakdown(events=_Events(functools.partial(timing_event, device)))


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
        self, clock: Callable[[], float] = time.perf_counter, events: _Events | None = None
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
        self._events = events

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
                self._events.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._events is not None:
            if self._ready is not None:
                self._ready = None
                stacks.waiting_in(None)  # backward has returned: the all-reduces are done
            self._events.end(self)
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
        optimizer's ``step`` take this way every step; a nested span, and CUDA's events, take
        the ``with``."""
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
            model.forward = TimedForward(model.forward, self)
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
        times = {}
        if self._events is not None:
            self._events.resolve(self)
            new = self._events.estimated - self._events.said  # each said once, with the times
            self._events.said |= new
            times = {ESTIMATED + part: float(EVERY) for part in sorted(new)}
        return {
            TIME_DATA: self.data,
            TIME_COMPUTE: max(self.compute - self._inside, 0.0),
            TIME_COMMUNICATION: self.communication,
            TIME_LOOP: self.clock() - self.start,
            **times,
        }


class TimedForward(functools.partial):
    """A model's ``forward`` run inside a compute span of ``breakdown`` (``Breakdown.watch``):
    ``breakdown.call`` with ``forward`` bound, a partial that C calls, so that timing costs the
    forward one Python call (the span's). ``forward`` may itself be a wrapper
    (``AutocastForward``): the span holds it whole."""

    def __new__(cls, forward: Callable[..., Any], breakdown: Breakdown) -> TimedForward:
        return super().__new__(cls, breakdown.call, forward)

    @property
    def forward(self) -> Callable[..., Any]:
        return self.args[0]

    @property
    def breakdown(self) -> Breakdown:
        return self.func.__self__

    def __reduce__(self) -> tuple:
        return TimedForward, (self.forward, self.breakdown)


def timed(breakdown: Breakdown | None) -> Callable[..., Any]:
    """What runs a call as a compute span of ``breakdown`` (``Breakdown.call``), or runs it
    untimed when the breakdown is off."""
    return _untimed if breakdown is None else breakdown.call


def _untimed(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
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
    ``(breakdown, process_group)``.

    With a power-of-two world size it gives DDP's own gradients bit for bit (DDP without a
    hook multiplies by ``1/N`` where the hook divides by ``N``: the same for ``N = 2, 4, 8``,
    possibly not in the last bit otherwise)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    breakdown, group = state
    breakdown.bucket_ready()
    return allreduce_hook(group, bucket)


class _Events:
    """Compute spans on a CUDA device, as events on the current stream, read once complete.

    A timed span records a start, its last bucket's readiness (if any) and an end; ``resolve``
    adds up the spans whose end has completed, in order, without waiting for the others, each
    ``EVERY`` times once the sample has begun (``sampling``). Events that have been read are
    recorded again: a step makes none after the first few.

    ``make`` makes a timing event (``timing_event``); a test gives its own, and ``seed``.
    """

    def __init__(self, make: Callable[[], Any], seed: int = 0) -> None:
        self._make = make
        self._pending: collections.deque[tuple[Any, Any, Any, int]] = collections.deque()
        self._spare: list[Any] = []  # read, free to record again
        self._start: Any = None
        self._ready: Any = None
        self._spans = 0  # spans begun
        self._first = 0  # the place of this block's timed run
        self._draw = random.Random(seed).randrange  # its own; the same places on every rank
        self.timing = False  # this span has events
        self.sampling = False  # the spans timed from now on count EVERY times
        self.estimated: set[str] = set()  # the parts a weighted span has added to
        self.said: set[str] = set()  # those ``Breakdown.counters`` has said

    def _record(self) -> Any:
        event = self._spare.pop() if self._spare else self._make()
        event.record()
        return event

    def begin(self) -> None:
        n, self._spans = self._spans - TIMED_FIRST, self._spans + 1
        if n >= 0:  # the sample: RUN spans in a row of every RUN * EVERY, at a random place
            at = n % (RUN * EVERY)
            if at == 0:
                self._first = self._draw(RUN * EVERY - RUN + 1)
                self.sampling = True
            self.timing = self._first <= at < self._first + RUN
            if not self.timing:
                return
        else:
            self.timing = True
        self._start, self._ready = self._record(), None

    def ready(self) -> None:
        if not self.timing:
            return
        if self._ready is not None:
            self._spare.append(self._ready)  # an earlier bucket's, not read: only the last counts
        self._ready = self._record()

    def end(self, breakdown: Breakdown) -> None:
        if not self.timing:
            return
        weight = EVERY if self.sampling else 1
        self._pending.append((self._start, self._ready, self._record(), weight))
        self._start = self._ready = None
        if len(self._pending) > 64:  # between records: drop the events already read
            self.resolve(breakdown)

    def resolve(self, breakdown: Breakdown) -> None:
        while self._pending and self._pending[0][2].query():
            start, ready, end, weight = self._pending.popleft()
            breakdown.compute += start.elapsed_time(end) * weight / 1000  # milliseconds
            if ready is not None:
                waited = ready.elapsed_time(end) * weight / 1000
                breakdown.communication += waited
                breakdown._inside += waited
                self._spare.append(ready)
            if weight > 1:  # a sampled span: what it added to is an estimate
                self.estimated.add("compute")
                if ready is not None:
                    self.estimated.add("communication")
            self._spare += (start, end)


def timing_event(device: torch.device) -> Any:
    """A CUDA event that times, recorded on ``device``'s current stream by ``record()``.

    ``torch.Event`` finds the current stream in C++; ``torch.cuda.Event.record()`` asks Python's
    ``torch.cuda.current_stream()``, which cost more than the event itself: on an H200, lesson
    5's step was 0.84 of plain PyTorch with those, 0.95 and 0.91 with these, every span timed
    (``benchmarks/README.md``)."""
    import torch

    if hasattr(torch, "Event"):
        return torch.Event(device=device, enable_timing=True)
    return torch.cuda.Event(enable_timing=True)  # older torch: through the current stream
