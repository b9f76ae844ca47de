"""Scaling: the same function at 1 and 2 processes, from Python and from the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nbaccel.lab.scaling import Scaling, measure_scaling
from nbaccel.observe.channel import (
    BREAKDOWN,
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
"""


def test_one_and_two_processes(tmp_path):
    namespace: dict = {}
    exec(compile(TRAIN, str(tmp_path / "train.py"), "exec"), namespace)  # like a notebook cell
    result = measure_scaling(namespace["train"], counts=(1, 2), cpu=True, live=False)
    rows = result.rows()
    assert [r["processes"] for r in rows] == [1, 2]
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["efficiency"] == pytest.approx(
        rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"])
    )
    for r in rows:  # one measurement: the clock splits into parts, throughput is its ratio
        assert r["startup_s"] > 0 and r["training_s"] > 0 and r["finish_s"] >= 0
        assert r["startup_s"] + r["training_s"] + r["finish_s"] == pytest.approx(r["seconds"])
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["training_s"])
    # every sample of the 61 steps of 32 is counted, on each rank: 32 x 61 per process
    assert [r["samples"] for r in rows] == [32 * 61, 2 * 32 * 61]
    assert result.runs[2].world_size == 2 and len(result.runs[2].series("loss")) == 2
    for r in rows:  # the ranks timed their loops: the shares of each count's loop add up
        assert sum(r[f"{p}_share"] for p in BREAKDOWN) == pytest.approx(1.0)
    assert rows[1]["communication_share"] > 0  # two ranks wait for each other's gradients
    assert len(result.breakdown(2)) == 2
    assert len(result.figure().axes) == 4  # throughput, efficiency, the shares, loss
    assert result.table().splitlines()[2].startswith("| 1 | ")
    assert result._repr_png_()[:4] == b"\x89PNG"


def test_counts_must_be_positive_ints():
    with pytest.raises(ValueError, match=r"counts=\[0, 2\] must be positive ints"):
        measure_scaling(print, counts=[0, 2])


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
    assert list(measure_scaling(print).runs) == expected == launched


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
    run.add(counters(1, [(1.0, 32.0), (1.5, 82.0)]))
    scaling = Scaling(runs={2: run})
    assert run.samples_per_s() == scaling.live_rate(2) == pytest.approx(100.0 + 100.0)
    assert "200 samples/s (last 3 s)" in progress(run)  # one definition, read by both
    run.finished = 3.0  # once ended, the line shows the table's number: the training window
    assert "214 samples/s (training window 1.0 s)" in progress(run)
    assert scaling.throughput(2) == run.throughput() == pytest.approx(214.0)
    assert scaling.timing(2) == run.timing()  # the window, defined with the records


def test_the_figure_draws_the_tables_numbers():
    from nbaccel.lab.scaling import figure

    run = Run(world_size=1, started=0.0, finished=3.0)
    run.add(counters(0, [(1.0, 32.0), (2.0, 132.0)]))
    run.add([Record(0, s, 1.0 + s / 2, "loss", 1.0 / (s + 1)) for s in range(3)])
    fig = figure(Scaling(runs={1: run}))
    speed, efficiency, loss = fig.axes
    assert [line.get_label() for line in speed.lines] == ["measured", "ideal"]
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
    header, _, first, second = scaling.table().splitlines()
    assert header.endswith("| efficiency | data % | compute % | comm % | other % |")
    assert first.endswith("| 6 | 88 | 0 | 6 |") and second.endswith("| 12 | 62 | 19 | 6 |")


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
