"""CUDA's side of the time breakdown: a step's time from at most two events (``StepEvents``).

Host clocks time only the launching of CUDA's asynchronous kernels, so on a CUDA device the
breakdown's compute spans are timed by events recorded on the stream. Every span timed cost
lesson 5's 1.3 ms H200 step about 7% (0.911 of plain PyTorch with it, 0.983 without:
``benchmarks/results/gpu-step.md``): six events a step,
each record asking Python for the current stream. Here a step records two, on a stream looked
up once, and reads them without a synchronisation; the totals are estimates, and say so.
"""

from __future__ import annotations

import collections
import functools
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The intervals a CUDA step may time: an outermost compute span's kind, and DDP's wait.
FORWARD, BACKWARD, STEP, WAIT = range(4)
ROTATION = 4  # the kinds; each is timed in one step in ROTATION, on average
LONGEST = 64  # outermost spans in a step with no end in sight (a forward-only loop): it ends


class StepEvents:
    """A CUDA step's time from at most two events a step, read once complete.

    A *step* runs from one batch ready (the step meter's ``batch_ready``, the prepared
    DataLoader's) to the next, or to the epoch's end; in a loop that never has a batch ready
    (no prepared DataLoader), from the end of one optimizer step span to the next; in a loop
    with neither (forwards alone), every ``LONGEST`` spans. A step in which no span began is no
    step (between an epoch's end and the next one's first batch).

    Each step times one interval with a start and an end event: the first outermost span of
    the step's kind (``FORWARD``, ``BACKWARD``, ``STEP``: the optimizer's), or for ``WAIT``
    DDP's last bucket ready to the end of its span, the host path's definitions. Which bucket
    is the last is known from the span before that had buckets (their count, noted on the
    host): the event is recorded at that bucket, and the sample is dropped when the span had
    another count (DDP rebuilding its buckets after the first step). Each step's kind is drawn
    at random, each of the ``ROTATION`` kinds with a chance of one in ``ROTATION`` (the same
    on every rank: a seeded generator of its own), independently of the steps before: a
    loop's own period (accumulation's step every fourth micro-batch, an evaluation every N
    steps) is neither always in nor always out, nor always after a long or a short gap.

    The host counts every interval of each kind. A timed interval stands for the intervals of
    its kind since the one timed before it (``ROTATION`` on average: its weight; the draws
    being independent, the gap before an interval says nothing of its length), and those
    since the last one timed count at the last one's length (``tail``): the totals estimate
    what the host path measures, exactly when a kind's intervals are equal, whatever the
    loop's period. What they add to is said to be estimated.

    Events are recorded on one stream, ``stream()``'s answer at the first record, looked up
    once: after a switch to another stream (``torch.cuda.stream(s)``) they still time the first
    one, whose work then no longer holds the step's. ``resolve`` adds up the intervals whose end
    has completed, in order, without waiting; their events are then recorded again.

    ``owner`` is the ``Breakdown`` whose totals they add to. ``make`` makes a timing event and
    ``stream`` looks the stream up (``cuda_timing``); a test gives its own, and ``seed``.
    """

    def __init__(self, make: Callable[[], Any], stream: Callable[[], Any], seed: int = 0) -> None:
        self._make, self._look_up = make, stream
        self._stream: Any = None
        self._pending: collections.deque[tuple[Any, Any, int, int]] = collections.deque()
        self._spare: list[Any] = []  # read, free to record again
        self._draw = random.Random(seed).randrange
        self._kind = self._draw(ROTATION)  # the interval this step times
        self._counts = [0] * 4  # this step's intervals of each kind
        self._since = [0] * 4  # each kind's intervals since its last one timed
        self._last: list[float | None] = [None] * 4  # each kind's last length read, seconds
        self._spans = 0  # outermost spans begun in this step
        self._start: Any = None  # the timed interval's start, while it is open
        self._timed: tuple[Any, Any] | None = None  # this step's interval: start, end
        self._buckets = 0  # buckets ready in the open span
        self._expected = 0  # buckets in the last span that had any
        self.batches = False  # the steps are bounded by batches ready
        self.owner: Any = None  # the Breakdown the intervals add to
        self.estimated: set[str] = set()  # the parts a timed interval has added to
        self.said: set[str] = set()  # those ``Breakdown.counters`` has said

    def _record(self) -> Any:
        if self._stream is None:
            self._stream = self._look_up()
        event = self._spare.pop() if self._spare else self._make()
        event.record(self._stream)
        return event

    def begin(self, kind: int) -> None:
        self._counts[kind] += 1
        self._spans += 1
        self._buckets = 0
        if kind == self._kind and self._timed is None and self._start is None:
            self._start = self._record()

    def ready(self) -> None:
        self._buckets += 1
        if self._kind == WAIT and self._timed is None and self._buckets == self._expected:
            self._start = self._record()

    def end(self, kind: int) -> None:
        buckets, self._buckets = self._buckets, 0
        if buckets:
            self._counts[WAIT] += 1
        if self._start is not None:
            start, self._start = self._start, None
            end = self._record()
            if self._kind == WAIT and buckets != self._expected:
                self._spare += (start, end)  # not the last bucket's: dropped, never read
            else:
                self._timed = (start, end)
        if buckets:
            self._expected = buckets
        if (kind == STEP and not self.batches) or self._spans >= LONGEST:
            self.step()  # no batches: the optimizer's step ends the step

    def step(self) -> None:
        """A step's end: its intervals are counted, its timed one weighted, the next step's
        kind drawn."""
        if not self._spans:
            return
        if self._start is not None:  # a span open across the boundary: not timed
            self._spare.append(self._start)
            self._start = None
        since = self._since
        for kind, count in enumerate(self._counts):
            since[kind] += count
        if self._timed is not None:
            start, end = self._timed
            self._pending.append((start, end, self._kind, since[self._kind]))
            since[self._kind] = 0
            self._timed = None
            if len(self._pending) > 16:
                self.resolve()
        self._counts = [0] * 4
        self._spans = 0
        self._kind = self._draw(ROTATION)

    def resolve(self) -> None:
        """Add the timed intervals that have completed to the owner's totals."""
        breakdown = self.owner
        while self._pending and self._pending[0][1].query():
            start, end, kind, weight = self._pending.popleft()
            self._last[kind] = seconds = start.elapsed_time(end) / 1000  # milliseconds
            if kind == WAIT:
                breakdown.communication += seconds * weight
                breakdown._inside += seconds * weight
            else:
                breakdown.compute += seconds * weight
            self.estimated.add("communication" if kind == WAIT else "compute")
            self._spare += (start, end)

    def tail(self) -> tuple[float, float]:
        """The compute and the waiting since each kind's last timed interval, at its length."""
        lengths = [
            (since * last if last is not None else 0.0)
            for since, last in zip(self._since, self._last, strict=True)
        ]
        return sum(lengths[:WAIT]), lengths[WAIT]


def cuda_timing(device: torch.device) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """How to make a CUDA event that times on ``device``, and how to look up the stream to record
    it on (``event.record(stream)``).

    ``torch.cuda.Event.record()`` without a stream asks Python's ``torch.cuda.current_stream()``
    at every record, which cost more than the event itself: on an H200, lesson 5's step was 0.84
    of plain PyTorch with those, 0.95 and 0.91 with ``torch.Event`` (``benchmarks/README.md``),
    every span timed. The stream is looked up once (``StepEvents``)."""
    import torch

    if hasattr(torch, "Event") and hasattr(torch, "accelerator"):
        return (
            functools.partial(torch.Event, device=device, enable_timing=True),
            functools.partial(torch.accelerator.current_stream, device),
        )
    return (  # older torch: CUDA's own classes
        functools.partial(torch.cuda.Event, enable_timing=True),
        functools.partial(torch.cuda.current_stream, device),
    )
