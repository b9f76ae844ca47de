"""One honest rate on screen: the live window, the run's throughput at the end, steps counted as
the loss axis counts them, and an empty panel that says why. Records are built by hand, so no
verdict depends on the machine's speed."""

from __future__ import annotations

import pytest

from nbaccel.observe.channel import (
    MIN_RATE_SPAN_S,
    MIN_WINDOW_S,
    RATE_WINDOW_S,
    SAMPLES,
    STEPS,
    Record,
)
from nbaccel.observe.live.line import progress, steps, timing_line
from nbaccel.observe.live.panel import Panel
from nbaccel.observe.live.view import LiveView
from nbaccel.observe.records import Run, Timing


def paced(rate: float = 1000.0, seconds: float = 6.0, ranks: int = 2, every: float = 0.25) -> Run:
    """Counter records every ``every`` seconds from t=1, each rank at ``rate`` samples/s; the
    last record of each rank comes 1 ms after the one before (what ``close`` does), with the
    batch handed out in between counted: one interval's rate there is 32 / 0.001."""
    run = Run(world_size=ranks, started=0.0)
    for rank in range(ranks):
        n = int(seconds / every)
        times = [1.0 + i * every for i in range(n + 1)]
        records = [Record(rank, i, t, SAMPLES, rate * (t - 1.0) + 32) for i, t in enumerate(times)]
        last = records[-1]
        records.append(Record(rank, n + 1, last.time + 0.001, SAMPLES, last.value + 32))
        run.add(records)
    return run


def test_the_live_rate_is_the_window_not_the_last_interval():
    run = paced()
    last_interval = 32 / 0.001  # what the line used to show: 32,000 samples/s on each rank
    assert run.live_samples_per_s() == pytest.approx(2 * 1000.0, rel=0.02)
    assert run.samples_per_s == run.live_samples_per_s  # the old name, the same method
    assert max(run.live_rate().values()) < last_interval / 10


def test_the_final_line_shows_the_training_window_the_table_uses():
    run = paced()
    run.finished = 8.0
    timing = run.timing()
    assert timing.samples_per_s == timing.throughput == run.throughput()  # old name kept
    line = progress(run)
    assert f"{run.throughput():,.0f} samples/s (training window {timing.training:.1f} s)" in line
    assert "last 3 s" not in line  # no live window once the run ended
    below = timing_line(run)
    assert below.startswith(f"training window {timing.training:.2f} s: ")
    assert f"{run.throughput():,.0f} samples/s" in below


def test_a_trained_run_never_shows_zero_samples_per_s():
    """The optimizer counted two more steps after the last batch (a check of a checkpoint):
    the samples counter was recorded again unchanged. One interval's rate read 0 there."""
    run = paced(ranks=1)
    last = run.records[-1]
    run.add([Record(0, last.step + 1, last.time + 0.3, SAMPLES, last.value)])
    assert run.live_samples_per_s() > 0
    assert " 0 samples/s" not in progress(run)
    run.finished = last.time + 1
    assert " 0 samples/s" not in progress(run)


def test_no_rate_from_a_span_too_short():
    run = Run(world_size=2, started=0.0)
    run.add([Record(0, 0, 1.0, SAMPLES, 32.0), Record(0, 1, 1.5, SAMPLES, 64.0)])
    run.add([Record(1, 0, 1.0, SAMPLES, 32.0), Record(1, 1, 1.0 + MIN_RATE_SPAN_S, SAMPLES, 96.0)])
    assert run.live_rate() == {1: pytest.approx(64 / MIN_RATE_SPAN_S)}  # rank 0: 0.5 s only
    assert run.live_samples_per_s() is None  # not every rank has a rate: no partial sum
    assert "samples/s" not in progress(run)
    # a run whose whole training window is shorter than a run's minimum
    short = Run(world_size=1, started=0.0, finished=2.0)
    short.add([Record(0, 0, 1.0, SAMPLES, 32.0), Record(0, 1, 1.2, SAMPLES, 96.0)])
    assert short.throughput() is None and MIN_WINDOW_S > 0.2
    assert "96 samples in 0.20 s (too short for a rate)" in progress(short)
    # long enough for a run's throughput, too short for a live rate: the line shows the run's
    done = Run(world_size=1, started=0.0, finished=2.0)
    done.add([Record(0, 0, 1.0, SAMPLES, 32.0), Record(0, 1, 1.4, SAMPLES, 432.0)])
    assert done.live_samples_per_s() is None and done.throughput() == pytest.approx(1080.0)
    assert "1,080 samples/s (training window 0.4 s)" in progress(done)


def test_the_rates_curve_ends_at_the_live_rate():
    run = paced()
    for rank, (times, values) in run.rates().items():
        assert values[-1] == pytest.approx(run.live_rate()[rank])
        assert times[0] >= 1.0 + MIN_RATE_SPAN_S  # nothing from a shorter span
    assert all(v > 0 for _, vs in run.rates(window=RATE_WINDOW_S).values() for v in vs)


def logged(run: Run, rank: int, calls: int, per_step: int, t0: float = 1.0) -> None:
    """``calls`` log calls of "loss" on ``rank``, an optimizer step every ``per_step`` of them."""
    for i in range(calls):
        t = t0 + 0.05 * i
        run.add([Record(rank, i, t, "loss", 1.0)])
        if (i + 1) % per_step == 0:
            run.add([Record(rank, (i + 1) // per_step, t, STEPS, float((i + 1) // per_step))])


def test_steps_under_accumulation_count_what_the_loss_axis_counts():
    run = Run(world_size=1, started=0.0)
    logged(run, 0, calls=80, per_step=4)
    assert steps(run) == (80, "micro-batches", 20)
    line = progress(run, total_steps=80, now=6.0)
    assert line.startswith("step 80/80 (micro-batches; 20 optimizer steps) | ")
    panel = Panel()
    panel.update(run, 80, now=6.0)
    assert panel.loss_ax.get_xlabel() == "step (micro-batches)"
    assert max(panel.loss_ax.lines[-1].get_xdata()) == 79  # 80 points, 0..79, as the line says


def test_steps_without_accumulation_are_optimizer_steps():
    run = Run(world_size=1, started=0.0)
    logged(run, 0, calls=40, per_step=1)
    assert steps(run) == (40, "optimizer steps", 40)
    run2 = Run(world_size=1, started=0.0)
    run2.add([Record(0, i, 1.0 + i, "loss", 1.0) for i in range(5)])  # a loop of our own
    assert steps(run2) == (5, "log calls", None)


def test_a_failed_run_says_its_step_is_the_last_that_arrived():
    run = Run(world_size=2, started=0.0)
    logged(run, 0, calls=30, per_step=1)
    run.failures.append("rank 0 was killed")
    assert progress(run, now=3.0).startswith("step 30 (the last that arrived) | ")


def test_an_empty_panel_says_why():
    run = Run(world_size=1, started=0.0)
    run.add([Record(0, i, 1.0 + 0.01 * i, "loss", 1.0) for i in range(5)])
    panel = Panel()
    panel.update(run, now=2.0)
    texts = [t.get_text() for t in panel.speed_ax.texts]
    assert any("no samples counted" in t for t in texts)
    run.add([Record(0, 0, 1.0, SAMPLES, 32.0), Record(0, 1, 1.1, SAMPLES, 64.0)])
    panel.update(run, now=2.0)
    assert any("a live rate needs 1 s of records" in t.get_text() for t in panel.speed_ax.texts)
    run.finished = 2.0  # ended: too short for a curve, long enough for the run's throughput
    run.add([Record(0, 2, 1.3, SAMPLES, 96.0)])
    panel.update(run)
    assert any("the line is the run's throughput" in t.get_text() for t in panel.speed_ax.texts)
    (window,) = [line for line in panel.speed_ax.lines if line.get_label() == "training window"]
    assert list(window.get_ydata()) == [pytest.approx(96 / 0.3)] * 2
    run.finished = None
    assert all(t.get_text() == "" for t in panel.loss_ax.texts)  # the loss has its curve
    run.add([Record(0, 3, 2.5, SAMPLES, 1000.0)])
    panel.update(run, now=2.5)
    assert all(t.get_text() == "" for t in panel.speed_ax.texts)  # now it has a curve
    empty = Panel()
    empty.update(paced(), now=8.0)  # samples but no logged metric
    assert any("nothing logged" in t.get_text() for t in empty.loss_ax.texts)


class Texts:
    draws = False

    def __init__(self):
        self.texts = []

    def text(self, line):
        self.texts.append(line)

    def close(self):
        pass


def test_the_final_view_prints_the_timing_under_the_line():
    run = paced()
    run.finished = 8.0
    front = Texts()
    LiveView(front).close(run)
    line, below = front.texts[-1].split("\n")
    assert "(training window" in line and below == timing_line(run)


def test_a_recorder_that_counted_nothing_records_no_counters(monkeypatch):
    from nbaccel.observe.rank_recorder import Recorder

    monkeypatch.delenv("NBACCEL_METRICS_FD", raising=False)
    idle = Recorder(live=False)
    idle.log({"loss": 1.0})
    idle.close()
    assert SAMPLES not in {r.name for r in idle.run.records}
    busy = Recorder(live=False)
    busy.log({"loss": 1.0}, samples=32)
    busy.close()
    assert [r.value for r in busy.run.records if r.name == SAMPLES] == [32.0]


def test_timing_names():
    t = Timing(1.0, 2.0, 0.5, 3.5, {0: 100.0, 1: 100.0})
    assert t.throughput == t.samples_per_s == 100.0


def test_the_curves_computed_as_records_arrive_equal_those_computed_at_once():
    whole = paced(seconds=8.0)
    growing = Run(world_size=whole.world_size, started=whole.started)
    for i in range(0, len(whole.records), 7):  # as the channel delivers them: in batches
        growing.add(whole.records[i : i + 7])
        growing.rates()  # each call computes only the points new since the last
    assert growing.rates() == whole.rates()
    fresh = Run(world_size=whole.world_size, started=whole.started, records=whole.records)
    assert fresh.rates(window=1.5) == growing.rates(window=1.5)  # each window its own points
