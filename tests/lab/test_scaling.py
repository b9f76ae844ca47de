"""Scaling: the same function at 1 and 2 processes, from Python and from the CLI."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time

import pytest

from nbaccel.env import usable_cores
from nbaccel.lab.scaling import THRESHOLDS, Load, Scaling, measure_scaling
from nbaccel.lab.scaling.contention import Reading, ours_used, read
from nbaccel.lab.scaling.flags import IMPOSSIBLE_CPU, IMPOSSIBLE_GPU
from nbaccel.lab.scaling.measure import omp_threads
from nbaccel.observe.channel import (
    BREAKDOWN,
    ESTIMATED,
    SAMPLES,
    TIME_COMMUNICATION,
    TIME_COMPUTE,
    TIME_DATA,
    TIME_LOOP,
    Record,
)
from nbaccel.observe.records import Run

pytestmark = pytest.mark.multiprocess

TRAIN = """
import torch
from torch.utils.data import DataLoader, TensorDataset


def train(steps=60):
    from nbaccel import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    loader = DataLoader(data, batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss})
        if step == steps:
            break
    accelerator.end_training()
    return torch.get_num_threads()
"""


def test_one_and_two_processes(tmp_path, monkeypatch):
    """The one real measurement: its structure and invariants, never its timings."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    namespace: dict = {}
    exec(compile(TRAIN, str(tmp_path / "train.py"), "exec"), namespace)  # like a notebook cell
    before = threading.active_count()
    result = measure_scaling(namespace["train"], counts=(1, 2), cpu=True, repeats=2, live=False)
    assert "OMP_NUM_THREADS" not in os.environ  # as before the measurement
    assert threading.active_count() == before  # every load meter stopped
    rows = result.rows()
    assert [r["processes"] for r in rows] == [1, 2]
    assert [r["repeats"] for r in rows] == [2, 2]
    # equal threads per worker at every count: the cores over the largest count
    assert result.threads == max(usable_cores() // 2, 1) == rows[0]["threads"]
    for n in (1, 2):
        for run in result.repeats[n]:  # every repeat, every rank ran with those threads
            assert sorted(run.results) == list(range(n))
            assert set(run.results.values()) == {result.threads}
        throughputs = rows[n - 1]["throughputs"]
        assert throughputs == [run.timing().samples_per_s for run in result.repeats[n]]
        assert (
            rows[n - 1]["samples_per_s"] == statistics.median(throughputs) == result.throughput(n)
        )
        # the run shown is the lower of the two: one that happened
        assert result.runs[n].timing().samples_per_s == min(throughputs)
        assert len(result.other_cores[n]) == 2 and all(c >= 0 for c in result.other_cores[n])
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["efficiency"] == pytest.approx(
        rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"])
    )
    for r in rows:  # the median run: the clock splits into parts
        assert r["startup_s"] > 0 and r["training_s"] > 0 and r["finish_s"] >= 0
        assert r["startup_s"] + r["training_s"] + r["finish_s"] == pytest.approx(r["seconds"])
        # the invariant: no efficiency above the threshold goes unflagged
        assert r["efficiency"] <= THRESHOLDS["efficiency"] or r["flags"]
        assert isinstance(r["flags"], list) and r["spread"] >= 0
    # every sample of the 61 steps of 32 is counted, on each rank: 32 x 61 per process
    assert [r["samples"] for r in rows] == [32 * 61, 2 * 32 * 61]
    assert result.runs[2].world_size == 2 and len(result.runs[2].series("loss")) == 2
    for r in rows:  # the ranks timed their loops: the shares of each count's loop add up
        assert sum(r[f"{p}_share"] for p in BREAKDOWN) == pytest.approx(1.0)
    assert rows[1]["communication_share"] > 0  # two ranks wait for each other's gradients
    assert len(result.breakdown(2)) == 2
    assert result.trusted == (result.flags() == [])
    assert len(result.figure().axes) == 4  # throughput, efficiency, the shares, loss
    assert result.table().splitlines()[2].startswith("| 1 | ")
    assert f"{result.threads} torch thread(s) per worker" in result.table()
    assert result._repr_png_()[:4] == b"\x89PNG"


def test_counts_must_be_positive_ints():
    with pytest.raises(ValueError, match=r"counts=\[0, 2\] must be positive ints"):
        measure_scaling(print, counts=[0, 2])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"repeats": 0}, r"repeats=0 must be a positive int, e\.g\. repeats=3"),
        ({"repeats": True}, r"repeats=True must be a positive int"),
        ({"threads": 0}, r"threads=0 must be a positive int or None"),
        ({"threads": 1.5}, r"threads=1\.5 must be a positive int or None"),
    ],
)
def test_repeats_and_threads_must_be_positive_ints(option, message):
    with pytest.raises(ValueError, match=message):
        measure_scaling(print, counts=(1, 2), **option)


def test_the_cli_prints_the_table_and_saves_the_figure(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {**os.environ, "NBACCEL_CONFIG": str(tmp_path / "config.json")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbaccel.cli",
            "scale",
            f"{script}:train",
            "--counts",
            "1,2",
            "--cpu",
            "--repeats",
            "1",
            "--save",
            str(tmp_path / "scaling.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| processes | samples | start-up s | training s | finish s | wall s |" in out.stdout
    assert "| median samples/s | spread % | repeats | efficiency |" in out.stdout
    assert "| data % | compute % | comm % | other % |" in out.stdout
    assert "The % columns: shares of each rank's training loop" in out.stdout
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_the_cli_names_a_bad_target(tmp_path):
    env = {**os.environ, "NBACCEL_CONFIG": str(tmp_path / "config.json")}
    out = subprocess.run(
        [sys.executable, "-m", "nbaccel.cli", "scale", "train"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 1 and "does not name a function" in out.stderr


@pytest.mark.parametrize(("gpus", "expected"), [(0, [1, 2]), (1, [1]), (3, [1, 2, 3])])
def test_default_counts_fit_the_gpus(monkeypatch, gpus, expected):
    import nbaccel.env
    import nbaccel.launch.launcher

    launched = []
    monkeypatch.setattr(nbaccel.env, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(
        nbaccel.launch.launcher,
        "notebook_launcher",
        lambda *a, num_processes, **k: launched.append(num_processes),
    )
    assert list(measure_scaling(print).runs) == expected
    assert launched == expected * 3  # three repeats, in turn


def test_a_notebook_shows_the_table_and_the_figure(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    run = Run(world_size=1)
    run.add([Record(0, s, 100.0 + s, SAMPLES, 10.0 * s) for s in range(3)])
    Scaling(runs={1: run})._ipython_display_()
    assert [type(x).__name__ for x in shown] == ["Markdown", "Image"]
    assert shown[0].data.startswith("| processes |") and shown[1].data[:4] == b"\x89PNG"


def counters(rank: int, times_values: list[tuple[float, float]]) -> list[Record]:
    return [Record(rank, i, t, SAMPLES, v) for i, (t, v) in enumerate(times_values)]


def test_the_clock_splits_at_the_first_and_last_counter_record():
    run = Run(world_size=2, started=100.0, finished=110.0)
    # rank 0 hands out its first batch (32 samples) at 103 s, rank 1 at 103.5 s; the last
    # records come at 108 and 109 s
    run.add(counters(0, [(103.0, 32.0), (105.0, 320.0), (108.0, 640.0)]))
    run.add(counters(1, [(103.5, 32.0), (109.0, 640.0)]))
    run.add([Record(0, 0, 104.0, "loss", 1.0)])  # other metrics do not move the clock
    t = Scaling(runs={2: run}).timing(2)
    assert (t.startup, t.training, t.finish, t.wall) == (3.0, 6.0, 1.0, 10.0)
    assert t.samples == {0: 640.0, 1: 640.0}  # the first batch's samples included
    assert t.samples_per_s == 1280.0 / 6.0
    row = Scaling(runs={2: run}).rows()[0]
    assert row["samples_per_s"] == t.samples_per_s and row["seconds"] == 10.0
    assert row["efficiency"] == pytest.approx(1.0)  # the smallest count is the baseline


def test_the_live_rate_is_the_last_window_not_the_run():
    run = Run(world_size=1, started=0.0, finished=7.0)
    speeds = [(1.0, 32.0), (2.0, 1032.0), (3.0, 2032.0), (4.0, 2532.0), (5.0, 3032.0)]
    run.add(counters(0, [*speeds, (6.0, 3532.0)]))
    scaling = Scaling(runs={1: run})
    assert scaling.live_rate(1) == pytest.approx(1500 / 3.0)  # the last 3 s
    assert scaling.throughput(1) == pytest.approx(3532.0 / 5.0)  # the whole training window


def test_a_run_without_counters_has_only_start_up():
    run = Run(world_size=1, started=5.0, finished=7.0)
    t = Scaling(runs={1: run}).timing(1)
    assert (t.startup, t.training, t.wall, t.samples_per_s) == (2.0, 0.0, 2.0, 0.0)


def test_the_live_rate_is_the_one_the_progress_line_shows():
    from nbaccel.observe.live.line import progress

    run = Run(world_size=2, started=0.0)
    run.add(counters(0, [(1.0, 32.0), (2.0, 132.0)]))
    run.add(counters(1, [(1.0, 32.0), (1.5, 82.0), (2.0, 132.0)]))
    scaling = Scaling(runs={2: run})
    assert run.samples_per_s() == scaling.live_rate(2) == pytest.approx(100.0 + 100.0)
    assert "200 samples/s (last 1 s)" in progress(run)  # one definition; 1 s of records
    run.finished = 3.0  # once ended, the line shows the table's number: the training window
    assert "264 samples/s (training window 1.0 s)" in progress(run)
    assert scaling.throughput(2) == run.throughput() == pytest.approx(264.0)
    assert scaling.timing(2) == run.timing()  # the window, defined with the records


def test_the_figure_draws_the_tables_numbers():
    from nbaccel.lab.scaling import figure

    run = Run(world_size=1, started=0.0, finished=3.0)
    run.add(counters(0, [(1.0, 32.0), (2.0, 132.0)]))
    run.add([Record(0, s, 1.0 + s / 2, "loss", 1.0 / (s + 1)) for s in range(3)])
    fig = figure(Scaling(runs={1: run}))
    speed, efficiency, loss = fig.axes
    assert [line.get_label() for line in speed.lines] == ["repeats", "measured (median)", "ideal"]
    assert [line.get_label() for line in loss.lines] == ["1 proc"]
    assert efficiency.lines[0].get_ydata()[0] == pytest.approx(1.0)
    assert len(Scaling(runs={1: run}).figure().axes) == 3


def timed(n: int, parts: list[dict[str, float]]) -> Run:
    """A run of ``n`` ranks whose loops took ``parts[rank]`` seconds (data, compute,
    communication; other is the rest of 8 s), with a samples counter for its clock."""
    run = Run(world_size=n, started=0.0, finished=10.0)
    names = {"data": TIME_DATA, "compute": TIME_COMPUTE, "communication": TIME_COMMUNICATION}
    for rank in range(n):
        run.add(counters(rank, [(1.0, 32.0), (9.0, 320.0)]))
        run.add([Record(rank, 1, 9.0, TIME_LOOP, 8.0)])
        run.add([Record(rank, 1, 9.0, names[p], s) for p, s in parts[rank].items()])
    return run


ONE = [{"data": 0.5, "compute": 7.0, "communication": 0.0}]  # other: 0.5 s of 8
TWO = [  # the communication grows with the count: the ranks wait for each other
    {"data": 0.5, "compute": 5.0, "communication": 2.0},
    {"data": 1.5, "compute": 5.0, "communication": 1.0},
]


def test_the_rows_and_the_table_carry_where_the_loop_goes():
    scaling = Scaling(runs={1: timed(1, ONE), 2: timed(2, TWO)})
    assert scaling.breakdown(2)[1] == {**TWO[1], "other": 0.5}
    one, two = scaling.rows()
    assert [one[f"{p}_share"] for p in BREAKDOWN] == [1 / 16, 14 / 16, 0.0, 1 / 16]
    assert [two[f"{p}_share"] for p in BREAKDOWN] == [2 / 16, 10 / 16, 3 / 16, 1 / 16]  # means
    header, _, first, second = scaling.table().splitlines()[:4]
    assert header.endswith("| efficiency | data % | compute % | comm % | other % |")
    assert first.endswith("| 6 | 88 | 0 | 6 |") and second.endswith("| 12 | 62 | 19 | 6 |")
    assert "estimated" not in scaling.table()  # every span timed: the CPU's clocks
    scaling.runs[2].add([Record(0, 1, 9.0, ESTIMATED + "compute", 8.0)])  # a GPU's sample
    said = "The shares' compute estimated: GPU events time 1 span in 8."
    assert said in scaling.table().splitlines()


def test_a_run_that_did_not_time_its_loop_has_no_shares():
    scaling = Scaling(runs={1: timed(1, ONE), 2: Run(world_size=2, started=0.0, finished=1.0)})
    assert scaling.shares(2) == {} and scaling.breakdown(2) == {}
    row = scaling.rows()[1]
    assert all(row[f"{p}_share"] != row[f"{p}_share"] for p in BREAKDOWN)  # NaN
    assert scaling.table().splitlines()[3].endswith("| - | - | - | - |")
    untimed = Scaling(runs={2: Run(world_size=2, started=0.0, finished=1.0)})
    assert untimed.table().splitlines()[0].endswith("| efficiency |")  # the table as before
    assert len(untimed.figure().axes) == 3  # and the figure


def test_the_figure_stacks_the_shares_per_process_count():
    fig = Scaling(runs={1: timed(1, ONE), 2: timed(2, TWO)}).figure()
    assert [ax.get_title() for ax in fig.axes] == [
        "throughput",
        "scaling efficiency",
        "where the time goes",
        "loss",
    ]
    shares = fig.axes[2]
    assert [c.get_label() for c in shares.containers] == list(BREAKDOWN)
    heights = {c.get_label(): [bar.get_height() for bar in c.patches] for c in shares.containers}
    assert heights["communication"] == [0.0, 100 * 3 / 16]
    for count in (0, 1):  # stacked: each part starts where the one before it ends, up to 100 %
        bottoms = [c.patches[count].get_y() for c in shares.containers]
        tops = [c.patches[count].get_y() + c.patches[count].get_height() for c in shares.containers]
        assert bottoms == [0.0, *tops[:-1]] and tops[-1] == pytest.approx(100.0)


# -- repeats, medians and flags, on runs made up for the test ------------------------------------
def steady(n: int, speed: float, comm: float | None = None, device: str = "CPU") -> Run:
    """A run of ``n`` ranks that trained ``speed`` samples/s in all over a training window of
    8 s; with ``comm``, each rank's 8 s loop timed: ``comm`` s communicating, the rest
    computing (so its work per sample is (8 - comm) / its samples)."""
    run = Run(world_size=n, started=0.0, finished=10.0, device=device)
    for rank in range(n):
        run.add(counters(rank, [(1.0, 32.0), (9.0, speed * 8.0 / n)]))
        if comm is not None:
            run.add([Record(rank, 1, 9.0, TIME_LOOP, 8.0)])
            run.add([Record(rank, 1, 9.0, TIME_COMPUTE, 8.0 - comm)])
            run.add([Record(rank, 1, 9.0, TIME_COMMUNICATION, comm)])
    return run


def measured(speeds: dict[int, list[float]], other=None, comm=None, **kw) -> Scaling:
    """A Scaling of steady runs: ``speeds[n]`` the repeats' samples/s at ``n`` processes,
    ``comm[n]`` their seconds communicating (None: not timed)."""
    comm = comm or {}
    repeats = {n: [steady(n, s, comm.get(n), **kw) for s in values] for n, values in speeds.items()}
    return Scaling(repeats=repeats, other_cores=other or {}, threads=1)


def test_the_median_and_the_spread():
    scaling = measured({1: [100.0, 300.0, 200.0], 2: [200.0, 400.0, 300.0, 100.0]})
    assert scaling.throughputs(1) == [100.0, 300.0, 200.0]  # in launch order
    assert scaling.throughput(1) == 200.0 and scaling.spread(1) == (300 - 100) / 200
    assert scaling.runs[1] is scaling.repeats[1][2]  # the median run: its throughput is 200
    # an even number: the median is the mean of the middle two, the run shown the lower one
    assert scaling.throughput(2) == 250.0 and scaling.spread(2) == (400 - 100) / 250
    assert scaling.runs[2] is scaling.repeats[2][0] and scaling.timing(2).samples_per_s == 200.0
    one, two = scaling.rows()
    assert (one["samples_per_s"], two["samples_per_s"]) == (200.0, 250.0)
    assert two["efficiency"] == 250.0 / (2 * 200.0) and two["repeats"] == 4
    assert two["throughputs"] == [200.0, 400.0, 300.0, 100.0] and two["threads"] == 1
    single = Scaling(runs={1: steady(1, 100.0)})  # built from runs: one repeat each
    assert single.repeats[1] == [single.runs[1]] and math.isnan(single.spread(1))
    assert single.rows()[0]["flags"] == [] and math.isnan(single.rows()[0]["other_cores"])


def test_a_clean_measurement_has_no_flags():
    scaling = measured(
        {1: [100.0, 104.0, 98.0], 2: [180.0, 185.0, 178.0]},
        other={1: [0.05, 0.0, 0.1], 2: [0.1, 0.02, 0.2]},
        comm={1: 0.0, 2: 1.0},
    )
    assert [r["flags"] for r in scaling.rows()] == [[], []]
    assert scaling.flags() == [] and scaling.trusted
    table = scaling.table()
    assert "(!" not in table and "\n1. " not in table  # no mark, no note
    assert table.splitlines()[-1].startswith("samples/s: the median of each count's repeats")
    assert "1 torch thread(s) per worker at every count" in table
    assert "efficiency above 1.05" in table  # the thresholds it was judged by


def test_an_efficiency_above_1_is_always_flagged():
    scaling = measured({1: [100.0], 2: [300.0]})  # 1.5: nothing else wrong
    assert scaling.rows()[1]["efficiency"] == 1.5
    assert scaling.flags(1) == []
    assert scaling.flags(2) == [f"above 1: efficiency 1.50 (threshold 1.05); {IMPOSSIBLE_CPU}"]
    assert scaling.flags() == [f"2 processes: {scaling.flags(2)[0]}"] and not scaling.trusted
    lines = scaling.table().splitlines()
    assert lines[3].endswith("| 1.50 (!1) |") and lines[2].endswith("| 1.00 |")
    assert lines[5] == f"1. 2 processes, not a result: {scaling.flags(2)[0]}"
    gpus = measured({1: [100.0], 2: [300.0]}, device="GPU")
    assert gpus.flags(2)[0].endswith(IMPOSSIBLE_GPU)
    # with a cause found, the flag names it instead
    busy = measured({1: [100.0], 2: [300.0]}, other={1: [0.0], 2: [0.9]})
    assert busy.flags(2)[1] == "above 1: efficiency 1.50 (threshold 1.05); explained by busy"


@pytest.mark.parametrize("second", [190.0, 205.0, 209.0, 211.0, 250.0, 400.0, 1000.0])
def test_no_row_shows_an_efficiency_above_the_threshold_unflagged(second):
    scaling = measured({1: [100.0], 2: [second]})
    for row in scaling.rows():
        assert row["efficiency"] <= THRESHOLDS["efficiency"] or row["flags"]
    assert bool(scaling.flags(2)) == (second / 200 > THRESHOLDS["efficiency"])


def test_a_wide_spread_is_flagged():
    wide = measured({1: [100.0, 130.0, 100.0], 2: [190.0, 190.0, 190.0]})
    assert wide.flags(1) == [
        "wide spread: the 3 repeats' samples/s differ by 30% of their median (threshold 20%)"
    ]
    assert wide.flags(2) == ["spoiled baseline: the 1-process row is flagged (wide spread)"]
    lines = wide.table().splitlines()
    assert lines[2].endswith("| 30 | 3 | 1.00 (!1) |") and lines[3].endswith("| 0.95 (!2) |")
    narrow = measured({1: [100.0, 110.0, 100.0], 2: [190.0, 190.0, 190.0]})
    assert narrow.flags() == []


def test_a_busy_machine_is_flagged():
    # most launches disturbed: the median of the other processes' cores
    scaling = measured({1: [100.0] * 3, 2: [180.0] * 3}, other={1: [0.1] * 3, 2: [0.3, 0.6, 0.7]})
    assert scaling.flags(2) == [
        "busy: other processes kept 0.60 cores busy (median of 3 launches; threshold 0.25)"
    ]
    # one launch disturbed, the one the row shows (the median run: 100 samples/s)
    shown = measured({1: [90.0, 100.0, 110.0], 2: [180.0] * 3}, other={1: [0.0, 0.9, 0.0]})
    assert shown.flags(1)[0] == (
        "busy: other processes kept 0.90 cores busy (in the run shown; threshold 0.25)"
    )
    # one launch disturbed, not the one shown: the median survives it
    other = measured({1: [90.0, 100.0, 110.0], 2: [180.0] * 3}, other={1: [0.9, 0.0, 0.0]})
    assert other.flags() == []


def test_a_slow_baseline_is_flagged():
    # at 1: 800 samples on 8 s of work, 0.01 s a sample; at 2: 600 a rank, (8 - comm) s of work
    slow = measured({1: [100.0], 2: [150.0]}, comm={1: 0.0, 2: 8.0 - 600 * 0.01 / 1.3})
    assert slow.flags(1) == []
    assert slow.flags(2) == [
        "slow baseline: the 1-process run took 1.30 x the time per sample of a worker at 2 "
        "processes for the same work (data, compute, other; threshold 1.15)"
    ]
    fine = measured({1: [100.0], 2: [150.0]}, comm={1: 0.0, 2: 8.0 - 600 * 0.01 / 1.1})
    assert fine.flags() == []
    untimed = measured({1: [100.0], 2: [150.0]})  # no breakdown: nothing to compare
    assert untimed.flags() == []


def test_the_result_keeps_the_thresholds_it_used():
    import dataclasses

    scaling = measured({1: [100.0, 125.0, 100.0], 2: [190.0] * 3})
    assert scaling.thresholds == dict(THRESHOLDS) and scaling.thresholds is not THRESHOLDS
    assert scaling.flags(1)  # 25 % > 20 %
    looser = dataclasses.replace(scaling, thresholds={**THRESHOLDS, "spread": 0.3})
    assert looser.flags() == [] and "spread above 30%" in looser.table()
    with pytest.raises(TypeError):
        THRESHOLDS["spread"] = 1.0  # type: ignore[index]


def test_a_scaling_refuses_parts_that_do_not_fit():
    a, b = steady(1, 100.0), steady(1, 200.0)
    with pytest.raises(ValueError, match=r"repeats\[1\] is empty: every process count needs"):
        Scaling(repeats={1: []})
    with pytest.raises(ValueError, match=r"runs\[1\] is not one of repeats\[1\]"):
        Scaling(runs={1: a}, repeats={1: [b]})
    with pytest.raises(ValueError, match=r"other_cores\[1\] has 1 values for 2 repeats"):
        Scaling(repeats={1: [a, b]}, other_cores={1: [0.0]})


def test_the_figure_never_draws_a_spoiled_point_as_measured():
    from nbaccel.lab.scaling import figure

    fig = figure(measured({1: [100.0, 100.0], 2: [290.0, 310.0]}))  # 1.5: flagged
    speed, efficiency, _ = fig.axes
    lines = {line.get_label(): line for line in speed.lines}
    assert list(lines) == ["repeats", "measured (median)", "spoiled", "ideal"]
    assert list(lines["repeats"].get_xdata()) == [1, 1, 2, 2]
    assert list(lines["repeats"].get_ydata()) == [100.0, 100.0, 290.0, 310.0]
    assert list(lines["measured (median)"].get_xdata()) == [1]  # only the trusted count
    assert list(lines["spoiled"].get_ydata()) == [300.0]
    assert lines["spoiled"].get_markerfacecolor() == "none"
    eff = {line.get_label(): line for line in efficiency.lines}
    assert max(eff["measured"].get_ydata()) <= THRESHOLDS["efficiency"]
    assert list(eff["spoiled"].get_ydata()) == [1.5]
    assert [t.get_text() for t in efficiency.texts] == ["spoiled: above 1"]


# -- how measure_scaling launches ----------------------------------------------------------------
def fake_launcher(launched: list, fail_at: int | None = None):
    """A notebook_launcher that records each call and OMP_NUM_THREADS, and fills the Run."""

    def launch(function, args, kwargs, *, num_processes, run, **options):
        launched.append((num_processes, os.environ.get("OMP_NUM_THREADS")))
        if len(launched) == fail_at:
            raise RuntimeError("the launch failed")
        run.world_size = num_processes
        run.add(counters(0, [(run.started + 1.0, 32.0), (run.started + 2.0, 132.0)]))

    return launch


def user_threads(monkeypatch, user: str | None) -> None:
    """The user's ``OMP_NUM_THREADS``: unset (None) or ``user``."""
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)


def load_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nbaccel-load"]


@pytest.mark.parametrize("user", [None, "3"])
def test_launches_go_in_turn_at_equal_threads_and_the_environment_comes_back(monkeypatch, user):
    import nbaccel.launch.launcher

    user_threads(monkeypatch, user)
    launched: list = []
    monkeypatch.setattr(nbaccel.launch.launcher, "notebook_launcher", fake_launcher(launched))
    result = measure_scaling(print, counts=(1, 2), repeats=3, cpu=True)
    threads = user or str(max(usable_cores() // 2, 1))  # the user's, else cores / 2
    assert launched == [(1, threads), (2, threads)] * 3
    assert result.threads == int(threads)
    assert os.environ.get("OMP_NUM_THREADS") == user  # exactly as before
    assert [len(result.repeats[n]) for n in (1, 2)] == [3, 3]
    assert [len(result.other_cores[n]) for n in (1, 2)] == [3, 3]
    assert not load_threads()
    launched.clear()
    measure_scaling(print, counts=(2, 1), repeats=2, threads=7)  # the given order and threads
    assert launched == [(2, "7"), (1, "7")] * 2


@pytest.mark.parametrize("user", [None, "3"])
def test_a_failed_launch_leaves_the_environment_and_no_thread(monkeypatch, user):
    import nbaccel.launch.launcher

    user_threads(monkeypatch, user)
    launched: list = []
    monkeypatch.setattr(
        nbaccel.launch.launcher, "notebook_launcher", fake_launcher(launched, fail_at=3)
    )
    with pytest.raises(RuntimeError, match="the launch failed"):
        measure_scaling(print, counts=(1, 2), threads=5)
    assert [n for n, _ in launched] == [1, 2, 1] and launched[-1][1] == "5"
    assert os.environ.get("OMP_NUM_THREADS") == user
    assert not load_threads()


def test_omp_threads_puts_back_a_value_or_its_absence(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with omp_threads(1):
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "4"
    monkeypatch.delenv("OMP_NUM_THREADS")
    with pytest.raises(KeyError), omp_threads(2):
        assert os.environ["OMP_NUM_THREADS"] == "2"
        raise KeyError("inside")
    assert "OMP_NUM_THREADS" not in os.environ


# -- the load meter ------------------------------------------------------------------------------
def test_ours_counts_each_process_once_across_exits():
    # this process (1) and a worker (2); 1 s later the worker has ended, reaped by 1, whose
    # children's seconds grew by the worker's whole total: 5 s seen + 1 s since
    before = Reading(0.0, 100.0, {1: (0, 10.0), 2: (1, 5.0)})
    after = Reading(1.0, 102.0, {1: (0, 10.5 + 6.0)})
    assert ours_used(before, after) == 0.5 + 1.0  # not 6.5: its 5 s counted once
    # a process born and reaped between two readings: only the parent's jump shows it
    assert ours_used(Reading(0, 0, {1: (0, 1.0)}), Reading(1, 0, {1: (0, 1.7)})) == 0.7
    # born since the last reading and still running: all of its seconds are new
    assert ours_used(Reading(0, 0, {1: (0, 1.0)}), Reading(1, 0, {1: (0, 1.0), 3: (1, 0.4)})) == 0.4
    # an orphan left the tree alive (adopted by init, pid 0 here) and then ended: its last
    # count is kept, since no process of ours reaped it
    adopted = Reading(1, 0, {1: (0, 1.0), 4: (0, 3.0)})
    assert ours_used(adopted, Reading(2, 0, {1: (0, 1.0)})) == 0.0


def test_the_load_meter_takes_the_others_from_injected_readings():
    readings = iter(
        [
            Reading(0.0, 100.0, {1: (0, 10.0)}),
            Reading(1.0, 101.5, {1: (0, 10.5), 2: (1, 0.5)}),  # 1.5 busy, 1.0 ours
            Reading(2.0, 103.5, {1: (0, 11.0 + 0.9)}),  # 2.0 busy, 0.5 + 0.4 ours
        ]
    )
    seen = []

    def fake(previous):
        seen.append(previous)
        return next(readings)

    load = Load(interval=3600, read=fake)  # the thread never reads; we step by hand
    load.start()
    assert load._thread is not None and load._thread.is_alive()
    load._step()
    assert load.stop() == pytest.approx(((1.5 - 1.0) + (2.0 - 0.9)) / 2.0)
    assert load._thread is None and not load_threads()
    assert seen[0] is None and seen[1].time == 0.0 and seen[2].time == 1.0  # follows its pids
    again = Load(interval=3600, read=lambda previous: Reading(0.0, 0.0, {}))
    assert again.other_cores == 0.0  # before it has measured anything
    with pytest.raises(RuntimeError, match="already measuring"):
        again.start().start()
    again.stop()
    assert not load_threads()


def test_the_load_meter_stops_its_thread_when_the_block_raises():
    def same(previous):
        return Reading(time.monotonic(), 0.0, {})

    with pytest.raises(ValueError, match="inside"), Load(interval=0.01, read=same):
        assert load_threads()
        raise ValueError("inside")
    assert not load_threads()


def test_a_busy_child_is_ours_and_its_exit_takes_nothing_back():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = read()
        assert child.pid in first.ours and first.ours[child.pid][0] == os.getpid()
        spent = 0.0
        deadline = time.monotonic() + 60
        while spent < 0.3 and time.monotonic() < deadline:  # wait for CPU seconds, not time
            time.sleep(0.05)
            second = read(first)
            spent = second.ours[child.pid][1] - first.ours[child.pid][1]
        assert spent >= 0.3, "the child got no CPU in 60 s"
        assert ours_used(first, second) >= spent  # all of the child's seconds are ours
    finally:
        child.kill()
        child.wait()  # reaped: its seconds move into ours
    third = read(second)
    assert child.pid not in third.ours
    assert ours_used(second, third) >= -0.02  # its whole total came back with the reaping


def test_the_docstrings_state_the_thresholds_in_use():
    import nbaccel.lab.scaling

    stated = [
        f"{THRESHOLDS['other_cores']:.2f} cores",
        f"{100 * THRESHOLDS['spread']:.0f} %",
        f"{1 + THRESHOLDS['baseline_slow']:.2f} x",
        f"efficiency exceeds {THRESHOLDS['efficiency']:.2f}",
        f"under {THRESHOLDS['training_s']:.2f} s",
    ]
    for doc in (nbaccel.lab.scaling.__doc__, measure_scaling.__doc__):
        text = " ".join(doc.split())
        assert [s for s in stated if s not in text] == []


def test_a_training_window_too_short_to_time_is_flagged():
    run = Run(world_size=1, started=0.0, finished=1.0)
    run.add(counters(0, [(0.5, 32.0), (0.6, 640.0)]))  # 0.1 s of training
    longer = Run(world_size=1, started=0.0, finished=2.0)
    longer.add(counters(0, [(0.5, 32.0), (1.5, 640.0)]))
    (row,) = Scaling(runs={1: run}).rows()
    assert [f.split(":")[0] for f in row["flags"]] == ["too short"]
    assert "0.10 s" in row["flags"][0] and f"{THRESHOLDS['training_s']:.2f} s" in row["flags"][0]
    assert Scaling(runs={1: longer}).rows()[0]["flags"] == []
