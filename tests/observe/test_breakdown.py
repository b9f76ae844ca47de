"""Where each rank's time goes (nbaccel.observe.breakdown): the rule on made-up records, then two
CPU ranks with a deliberate straggler, slowed by its data or by its compute.

Times are checked only from below, by sleeps: a sleep of S seconds takes at least S.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nbaccel import notebook_launcher
from nbaccel.env import BREAKDOWN_VAR
from nbaccel.observe.breakdown import Breakdown
from nbaccel.observe.channel import (
    BREAKDOWN,
    ESTIMATED,
    TIME_COMMUNICATION,
    TIME_COMPUTE,
    TIME_DATA,
    TIME_LOOP,
    Record,
)
from nbaccel.observe.records import Run
from nbaccel.observe.straggler import Straggler, find_straggler

HANG = 120  # seconds: a launch that takes this long is hung, not slow
NAMES = {"data": TIME_DATA, "compute": TIME_COMPUTE, "communication": TIME_COMMUNICATION}


def recorded(*rows: tuple[int, float, float, float, float, float]) -> Run:
    """A Run from rows of (rank, time, data, compute, communication, loop)."""
    run = Run(world_size=2, started=0.0)
    for rank, t, data, compute, comm, loop in rows:
        values = {TIME_DATA: data, TIME_COMPUTE: compute, TIME_COMMUNICATION: comm, TIME_LOOP: loop}
        run.add([Record(rank, 0, t, name, value) for name, value in values.items()])
    return run


# -- the rule, on made-up records ---------------------------------------------------------------
def test_breakdown_adds_up_to_the_loop_and_is_empty_without_counters():
    run = recorded((0, 1.0, 1.0, 2.0, 3.0, 10.0), (1, 1.0, 0.5, 2.0, 0.0, 2.0))
    assert run.breakdown() == {
        0: {"data": 1.0, "compute": 2.0, "communication": 3.0, "other": 4.0},
        1: {"data": 0.5, "compute": 2.0, "communication": 0.0, "other": 0.0},
    }
    assert Run().breakdown() == {} and Run().straggler() is None


def test_a_rank_slow_in_data_is_named_with_the_others_wait():
    # rank 1 loads slowly: its data is high, rank 0 waits in communication, all along
    run = recorded(
        (0, 1.0, 0.1, 0.4, 0.5, 1.0),
        (1, 1.0, 0.6, 0.4, 0.0, 1.0),
        (0, 5.0, 0.5, 2.0, 2.5, 5.0),
        (1, 5.0, 2.5, 2.0, 0.2, 5.0),
    )
    assert run.straggler() == Straggler(rank=1, cause="data", waited=pytest.approx(2.3))


def test_a_rank_slow_in_compute_is_named():
    shares = {0: (0.1, 3.0, 0.1, 3.3), 1: (0.1, 1.0, 2.0, 3.3), 2: (0.1, 1.1, 1.8, 3.3)}
    found = find_straggler({r: dict(zip(BREAKDOWN, p, strict=True)) for r, p in shares.items()})
    assert found == Straggler(rank=0, cause="compute", waited=pytest.approx(1.8))


def test_no_straggler_when_nobody_waits_much_or_the_slow_part_is_elsewhere():
    balanced = recorded((0, 4.0, 0.1, 3.5, 0.3, 4.0), (1, 4.0, 0.1, 3.6, 0.2, 4.0))
    assert balanced.straggler() is None  # 5-8% communication: nobody is waiting
    # rank 1 is slow in "other" (it evaluates alone): neither its data nor compute stands out
    evaluating = {
        0: {"data": 0.1, "compute": 1.0, "communication": 2.0, "other": 0.0},
        1: {"data": 0.1, "compute": 1.0, "communication": 0.0, "other": 2.0},
    }
    assert find_straggler(evaluating) is None


def test_a_straggler_must_still_be_one_in_the_last_seconds():
    # rank 1 was slow in data early on; in the last 4 s both ranks run alike
    run = recorded(
        (0, 2.0, 0.1, 0.4, 1.5, 2.0),
        (1, 2.0, 1.5, 0.4, 0.0, 2.0),
        (0, 6.0, 0.5, 3.8, 1.6, 6.0),
        (1, 6.0, 1.9, 3.8, 0.1, 6.0),
    )
    assert find_straggler(run.breakdown()) is not None  # the whole run still says rank 1
    assert run.straggler() is None


@pytest.mark.parametrize("way", ["with", "call"])
def test_compute_spans_nest_and_the_waiting_after_the_last_bucket_is_communication(way):
    now = [0.0]
    b = Breakdown(clock=lambda: now[0])

    def with_span(fn):
        with b:
            fn()

    span = {"with": with_span, "call": b.call}[way]

    def nested():  # a closure inside step: counted once
        now[0] = 3.0
        b.bucket_ready()

    def backward():  # buckets ready at 1 and 3, all-reduces done at 5
        now[0] = 1.0
        b.bucket_ready()
        span(nested)
        now[0] = 5.0

    assert b.counters() == {}  # nothing before the loop's first timed moment
    span(backward)
    b.communicated(1.0)  # a gather outside any compute span
    now[0] = 7.0
    assert b.counters() == {
        TIME_DATA: 0.0,
        TIME_COMPUTE: 3.0,
        TIME_COMMUNICATION: 3.0,
        TIME_LOOP: 7.0,
    }


def test_estimated_parts_are_said_under_the_bars():
    run = Run()
    parts = {TIME_DATA: 1.0, TIME_COMPUTE: 3.0, TIME_COMMUNICATION: 0.5, TIME_LOOP: 5.0}
    run.add([Record(r, 0, 1e9, n, v) for r in (0, 1) for n, v in parts.items()])
    assert run.estimated() == {}
    run.add([Record(1, 0, 1e9, ESTIMATED + p, 8.0) for p in ("compute", "communication")])
    assert run.estimated() == {"compute": 8.0, "communication": 8.0}
    from nbaccel.observe.live.panel import Panel

    panel = Panel()
    panel.png(run, None)
    said = "compute and communication estimated: GPU events time 1 span in 8"
    assert said in panel.breakdown.ax.get_xlabel()


@pytest.mark.parametrize("hooks", [False, True])
def test_a_watched_forward_is_a_compute_span_even_when_it_raises(hooks):
    now = [0.0]
    b = Breakdown(clock=lambda: now[0])

    class Clocked(nn.Module):  # its forward takes 2 "seconds"; a negative input raises
        def forward(self, x):
            now[0] += 2.0
            if x < 0:
                raise ValueError("negative")
            return x

    model = b.watch(Clocked(), hooks=hooks)
    assert model(torch.tensor(1.0)) == 1.0
    with pytest.raises(ValueError):
        model(torch.tensor(-1.0))
    now[0] += 1.0  # outside forward: not compute
    assert b.counters()[TIME_COMPUTE] == 4.0 and b.counters()[TIME_LOOP] == 5.0


def test_a_model_unwrapped_without_autocast_is_still_timed():
    """``unwrap_model(keep_fp32_wrapper=False)`` removes the autocast, not the timing."""
    from nbaccel import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    now, computed = [0.0], []
    accelerator._meter.times.clock = lambda: now[0]

    class Clocked(nn.Linear):
        def forward(self, x):
            now[0] += 2.0
            out = super().forward(x)
            computed.append(out.dtype)
            return out

    model = accelerator.prepare(Clocked(2, 2))
    model(torch.ones(1, 2))
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    plain(torch.ones(1, 2))
    assert computed == [torch.bfloat16, torch.float32]  # the autocast is gone ...
    assert accelerator._meter.times.counters()[TIME_COMPUTE] == 4.0  # ... and both were timed


# -- two CPU ranks ----------------------------------------------------------------------------
class Slow(Dataset):
    """64 items of 8 features; on ``slow_rank``, each item takes ``delay`` seconds to load."""

    def __init__(self, slow_rank: int | None, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        self.slow_rank, self.delay = slow_rank, delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if int(os.environ.get("RANK", 0)) == self.slow_rank:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


class Net(nn.Module):
    """A small MLP; on ``slow_rank`` each forward also sleeps ``delay`` seconds."""

    def __init__(self, slow_rank: int | None = None, delay: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.slow_rank, self.delay = slow_rank, delay

    def forward(self, x):
        if int(os.environ.get("RANK", 0)) == self.slow_rank:
            time.sleep(self.delay)
        return self.layers(x)


def train(data_rank=None, data_delay=0.0, compute_rank=None, compute_delay=0.0, count=False):
    from nbaccel import Accelerator, set_seed
    from nbaccel.lessons import AllReduceCounter

    set_seed(0)
    accelerator = Accelerator()
    model = Net(compute_rank, compute_delay)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Slow(data_rank, data_delay), batch_size=4)  # 8 steps of 2 x 4
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter = AllReduceCounter(model) if count else None  # a comm hook of the user's own
    for _ in range(2):
        for x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    accelerator.end_training()
    return (weights, counter.calls) if count else weights


def launched(fsdp: bool = False, **kwargs) -> tuple[Run, list]:
    run = Run()
    weights = notebook_launcher(
        train, kwargs=kwargs, num_processes=2, cpu=True, return_all=True, run=run, timeout=HANG,
        fsdp=fsdp,
    )  # fmt: skip
    return run, weights


def check_adds_up(run: Run) -> None:
    loops = run.latest(TIME_LOOP)
    for rank, parts in run.breakdown().items():
        measured = sum(parts[p] for p in NAMES)
        assert measured <= loops[rank] * 1.03, f"rank {rank}: parts {parts} over {loops[rank]}"
        assert sum(parts.values()) == pytest.approx(loops[rank], rel=0.03)


def check_panel(run: Run, cause: str) -> None:
    """The live panel drawn from the launch's records: each rank's bar has its parts' lengths,
    the straggler's label is bold, and the progress line names it."""
    from nbaccel.observe.live.line import progress
    from nbaccel.observe.live.panel import figure

    ax = figure(run).axes[3]
    parts = run.breakdown()
    widths = {c.get_label(): [bar.get_width() for bar in c.patches] for c in ax.containers}
    for part in ("data", "compute", "communication", "other"):
        assert widths[part] == pytest.approx([parts[0][part], parts[1][part]])
    rank0, rank1 = ax.get_yticklabels()
    assert (rank0.get_fontweight(), rank1.get_fontweight()) == ("normal", "bold")
    assert f"rank 1 is the straggler ({cause}:" in progress(run)


@pytest.mark.multiprocess
def test_a_rank_slow_in_its_data_shows_as_data_there_and_communication_on_the_other():
    delay = 0.02  # per item: 4 items a batch, 16 batches, so at least 1.28 s of data on rank 1
    run, _ = launched(data_rank=1, data_delay=delay)
    parts = run.breakdown()
    assert parts[1]["data"] >= 16 * 4 * delay
    assert parts[0]["communication"] >= 0.5 * 16 * 4 * delay  # most of it waited in backward
    assert parts[0]["communication"] > parts[1]["communication"]
    check_adds_up(run)
    straggler = run.straggler()
    assert straggler is not None and (straggler.rank, straggler.cause) == (1, "data")
    assert straggler.waited >= 0.5 * 16 * 4 * delay
    check_panel(run, "data")


@pytest.mark.multiprocess
def test_a_rank_slow_in_compute_shows_as_compute_there_and_communication_on_the_other():
    delay = 0.08  # per forward: 16 of them, at least 1.28 s of compute on rank 1
    run, _ = launched(compute_rank=1, compute_delay=delay)
    parts = run.breakdown()
    assert parts[1]["compute"] >= 16 * delay
    assert parts[0]["communication"] >= 0.5 * 16 * delay
    assert parts[0]["communication"] > parts[1]["communication"]
    check_adds_up(run)
    straggler = run.straggler()
    assert straggler is not None and (straggler.rank, straggler.cause) == (1, "compute")
    check_panel(run, "compute")


@pytest.mark.multiprocess
def test_the_hook_leaves_the_gradients_as_ddp_makes_them_and_off_records_nothing(monkeypatch):
    run_on, on = launched()
    monkeypatch.setenv(BREAKDOWN_VAR, "0")
    run_off, off = launched()
    for rank in (0, 1):
        assert list(on[rank]) == list(off[rank])
        for name in on[rank]:
            assert torch.equal(on[rank][name], off[rank][name]), f"rank {rank}: {name} differs"
    assert run_on.breakdown().keys() == {0, 1}
    assert run_off.breakdown() == {}
    assert not [r for r in run_off.records if r.name.startswith("nbaccel/time/")]


@pytest.mark.multiprocess
def test_a_comm_hook_of_the_users_own_is_timed_too():
    """Lesson 5 counts the all-reduces with its own hook (``AllReduceCounter``): DDP takes one
    hook, so the user's replaces the breakdown's, and the prepared model times it the same way."""
    delay = 0.02
    run, results = launched(data_rank=1, data_delay=delay, count=True)
    assert [calls for _, calls in results] == [16, 16]  # the user's hook ran, once a step
    parts = run.breakdown()
    assert parts[0]["communication"] >= 0.5 * 16 * 4 * delay
    assert run.straggler() is not None and run.straggler().rank == 1


@pytest.mark.multiprocess
def test_fsdp2s_collectives_on_cpu_count_as_communication():
    """FSDP2 all-gathers the parameters in forward and reduce-scatters the gradients in
    backward: waiting there for a rank slow in its data is communication, as DDP's is."""
    delay = 0.02
    run, _ = launched(fsdp=True, data_rank=1, data_delay=delay)
    parts = run.breakdown()
    assert parts[1]["data"] >= 16 * 4 * delay
    assert parts[0]["communication"] >= 0.5 * 16 * 4 * delay
    check_adds_up(run)
