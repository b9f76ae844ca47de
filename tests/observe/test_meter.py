"""The step meter (nbaccel.observe.meter) and CUDA's events (nbaccel.observe.cuda_events), on
the CPU: a real Accelerator's loop driven through a meter whose events are stand-ins on a fake
GPU clock, counting the calls a CUDA step would make, and its estimates held against the host
path's measure of the same loop on the same clock (the oracle).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.observe.breakdown import Breakdown
from nbaccel.observe.channel import ESTIMATED, TIME_COMMUNICATION, TIME_COMPUTE
from nbaccel.observe.cuda_events import BACKWARD as BACKWARD_SPAN
from nbaccel.observe.cuda_events import LONGEST, ROTATION, StepEvents
from nbaccel.observe.cuda_events import WAIT as WAITING
from nbaccel.observe.meter import StepMeter
from nbaccel.observe.rank_recorder import Recorder

FORWARD, BACKWARD, STEP, WAIT = 1.0, 1.0, 0.5, 0.25  # the fake GPU's seconds; WAIT: DDP's


class Gpu:
    """The fake GPU: ``clock`` is the time of the work queued so far, ``done`` how far it has
    got. It counts what a CUDA step would call: events made and recorded, stream lookups."""

    def __init__(self) -> None:
        self.clock = self.done = 0.0
        self.made = self.records = self.lookups = 0
        self.stream = Stream()

    def look_up(self) -> Stream:
        self.lookups += 1
        return self.stream

    def event(self) -> Event:
        self.made += 1
        return Event(self)


class Stream:
    def synchronize(self) -> None:
        raise AssertionError("the stream was synchronised")


class Event:
    """A CUDA event's stand-in: ``record(stream)`` notes the GPU time it completes at."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu, self.at = gpu, None

    def record(self, stream: Stream) -> None:
        assert stream is self.gpu.stream, "recorded without the stream looked up once"
        self.gpu.records += 1
        self.at = self.gpu.clock

    def query(self) -> bool:
        return self.at is not None and self.at <= self.gpu.done

    def elapsed_time(self, end: Event) -> float:
        assert self.query() and end.query(), "read before it completed"
        return (end.at - self.at) * 1000  # milliseconds, as CUDA's

    def synchronize(self) -> None:
        raise AssertionError("an event was waited for")


def gpu_meter(gpu: Gpu, seed: int = 0) -> StepMeter:
    return StepMeter(
        Breakdown(clock=lambda: gpu.clock, events=StepEvents(gpu.event, gpu.look_up, seed))
    )


def host_meter(gpu: Gpu) -> StepMeter:
    """The oracle: the host path, every span timed, on the fake GPU's clock."""
    return StepMeter(Breakdown(clock=lambda: gpu.clock))


class Clocked(nn.Module):
    """Its forward takes FORWARD; its backward, four gradients of WAIT each, notes a DDP-like
    bucket ready before each (on micro-batches that sync), so the last one's wait is WAIT."""

    def __init__(self, gpu: Gpu) -> None:
        super().__init__()
        self.gpu = gpu
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.accelerator: Accelerator | None = None
        for p in self.parameters():
            p.register_post_accumulate_grad_hook(self._gradient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gpu.clock += FORWARD
        return self.b(self.a(x))

    def _gradient(self, p: torch.Tensor) -> None:
        if self.accelerator.sync_gradients:
            self.accelerator._meter.bucket_ready()  # DDP's communication hook's note
        self.gpu.clock += BACKWARD / 4


def train(monkeypatch, meter: StepMeter, gpu: Gpu, accumulation=1, closure=False, steps=400):
    """``steps`` micro-batches of a real Accelerator's loop, its meter ``meter``: through a
    prepared DataLoader, or (``closure``) a list of batches and ``optimizer.step(closure)``.
    Returns the events recorded in each step and the time split's counters once the GPU is
    done. The GPU runs a step behind: what is read was never waited for."""
    monkeypatch.setattr(StepMeter, "for_device", classmethod(lambda cls, device: meter))
    monkeypatch.setattr(torch.cuda, "synchronize", Stream.synchronize)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    assert accelerator._meter is meter and accelerator.recorder.meter is meter
    model = Clocked(gpu)

    class ClockedSGD(torch.optim.SGD):
        def step(self, closure=None):
            loss = super().step(closure)
            gpu.clock += STEP
            return loss

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(2 * steps, 4, generator=g), torch.randn(2 * steps, 1, generator=g)
    )
    model, optimizer = accelerator.prepare(model, ClockedSGD(model.parameters(), lr=0.01))
    model.accelerator = accelerator
    if closure:
        batches = list(DataLoader(data, batch_size=2))
    else:
        batches = accelerator.prepare(DataLoader(data, batch_size=2))
    recorded, before, estimated = [], 0, {}
    for x, y in batches:
        if closure:

            def loss_of(x=x, y=y):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                return loss

            optimizer.step(loss_of)
            optimizer.zero_grad()
        else:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                model(x)  # a second forward in the step (an evaluation's): one is timed
        recorded.append(gpu.records - before)
        before = gpu.records
        gpu.done = gpu.clock - 1.0  # a step behind
        said = meter.times.counters()  # reads what has completed, waits for nothing
        estimated.update({k: v for k, v in said.items() if k.startswith(ESTIMATED)})
    gpu.done = math.inf
    counters = {**estimated, **meter.times.counters()}  # the estimates are said once
    accelerator.end_training()
    return recorded, counters


@pytest.mark.parametrize(
    "accumulation, closure", [(1, False), (4, False), (1, True)], ids=["plain", "accum4", "closure"]
)
def test_a_cuda_step_records_at_most_two_events_on_one_stream_and_estimates_the_host_split(
    monkeypatch, accumulation, closure
):
    gpu, oracle = Gpu(), Gpu()
    recorded, counters = train(monkeypatch, gpu_meter(gpu), gpu, accumulation, closure)
    _, truth = train(monkeypatch, host_meter(oracle), oracle, accumulation, closure)
    assert gpu.clock == oracle.clock  # the same loop
    assert max(recorded) == 2 and sum(recorded) > len(recorded) / 2  # two a step, or none
    assert gpu.lookups == 1  # the stream, looked up once
    assert gpu.made <= 2 * 18  # the pool: what waits to be read, then recorded again
    # the host path's split on the same clock: the estimate is exact for equal intervals
    assert truth[TIME_COMPUTE] > 0 and truth[TIME_COMMUNICATION] > 0
    assert counters[TIME_COMPUTE] == pytest.approx(truth[TIME_COMPUTE], rel=1e-9)
    assert counters[TIME_COMMUNICATION] == pytest.approx(truth[TIME_COMMUNICATION], rel=1e-9)
    assert counters[ESTIMATED + "compute"] == ROTATION
    assert counters[ESTIMATED + "communication"] == ROTATION


def steps(meter: StepMeter, gpu: Gpu, n: int, slow_every=0, slow=9.0, buckets=True) -> float:
    """``n`` steps of forward, backward (with DDP's buckets) and step on the meter alone, a
    batch ready before each; every ``slow_every``-th forward takes ``slow``. Returns the GPU
    seconds of the spans."""
    total = 0.0
    for i in range(n):
        meter.batch_ready(1, meter.now())
        forward = slow if slow_every and i % slow_every == 0 else FORWARD
        for kind, length in ((0, forward), (1, BACKWARD), (2, STEP)):
            call = (meter.call, meter.backward, meter.optimizer_step)[kind]

            def span(length=length, kind=kind):
                gpu.clock += length - WAIT * (kind == 1)
                if kind == 1 and buckets:
                    meter.bucket_ready()
                    meter.bucket_ready()
                gpu.clock += WAIT * (kind == 1)

            call(span)
            total += length
        gpu.done = gpu.clock
    meter.epoch_done()
    gpu.done = math.inf
    return total


def test_without_buckets_only_compute_is_said_estimated():
    gpu = Gpu()
    meter = gpu_meter(gpu)
    total = steps(meter, gpu, 40, buckets=False)
    counters = meter.times.counters()
    assert counters[TIME_COMPUTE] == pytest.approx(total, rel=1e-9)
    assert ESTIMATED + "communication" not in counters and counters[TIME_COMMUNICATION] == 0.0


def test_the_sample_follows_no_period_of_the_loop():
    """A slow forward every 32 steps: a sample at a fixed place in a rotation would always, or
    never, hold it, or always after the same gap; drawn at random it holds it 1 time in
    ROTATION, after a gap that says nothing of it."""
    gpu = Gpu()
    meter = gpu_meter(gpu, seed=1)
    total = steps(meter, gpu, 32 * 300, slow_every=32, slow=40.0)
    # the slow forwards hold more than half the time; over 300 of them, each sampled with a
    # chance of 1 in 4, the estimate's standard error is about 5% (the same at every run: a
    # seeded generator)
    assert meter.times.counters()[TIME_COMPUTE] == pytest.approx(total, rel=0.15)


def test_untimed_the_meter_counts_and_wraps_nothing(monkeypatch):
    monkeypatch.setenv("NBACCEL_BREAKDOWN", "0")
    meter = StepMeter.for_device(torch.device("cpu"))
    recorder = Recorder(live=False, meter=meter, clock=lambda: 0.0, rss=lambda: None)
    model = nn.Linear(2, 2)
    assert meter.watch(model) is model and "forward" not in model.__dict__
    assert meter.call(sum, [1, 2]) == 3 and meter.now() is None and not meter.timing
    meter.batch_ready(8, None)
    meter.stepped(True)
    meter.stepped(False)  # a skipped fp16 step: not counted
    assert (recorder.samples, recorder.optimizer_steps) == (8, 1)
    assert recorder.breakdown is None
    recorder.close()


def test_a_wait_is_timed_from_the_last_bucket_or_not_at_all():
    """The last bucket is the count of the span before that had buckets: a span with another
    count (DDP rebuilds its buckets after its first step) is not timed, and the next timed one
    stands for it."""
    gpu = Gpu()
    b = Breakdown(clock=lambda: gpu.clock, events=StepEvents(gpu.event, gpu.look_up))
    events, backward = b._events, b.caller(BACKWARD_SPAN)

    def buckets(n: int) -> None:
        for _ in range(n):
            b.bucket_ready()
            gpu.clock += WAIT  # the last one's wait: WAIT

    for n in (2, 2, 4, 4):
        events._kind = WAITING  # this step times DDP's wait
        before = gpu.records
        backward(buckets, n)
        events.step()
        assert gpu.records - before <= 2
    gpu.done = math.inf
    # the first has no count to go by, the third's started at its second bucket: both dropped
    assert b.counters()[TIME_COMMUNICATION] == 4 * WAIT


def test_a_loop_of_forwards_alone_is_cut_into_steps():
    """No batch ready and no optimizer step (an evaluation through a prepared model alone):
    a step ends every LONGEST spans, so the forwards are still sampled and estimated."""
    gpu = Gpu()
    meter = gpu_meter(gpu)

    def forward():
        gpu.clock += FORWARD

    for _ in range(LONGEST * 20):
        before = gpu.records
        meter.call(forward)
        assert gpu.records - before <= 2
    gpu.done = math.inf
    assert meter.times.counters()[TIME_COMPUTE] == pytest.approx(LONGEST * 20 * FORWARD)
