"""The metrics channel alone, the Accelerator's counters, and Run's exports."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator, Recorder, notebook_launcher
from nbaccel.observe.channel import SAMPLES, STEPS, Channel, Record, decode
from nbaccel.observe.live import panel
from nbaccel.observe.live.line import progress
from nbaccel.observe.records import Run


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    yield ours, theirs.fileno()
    ours.close()
    theirs.close()


def received(sock) -> list[Record]:
    records = []
    while True:
        try:
            records += decode(sock.recv(1 << 16))[0]
        except BlockingIOError:
            return records


def test_records_arrive_in_order(pair):
    ours, fd = pair
    channel = Channel(rank=1, fd=fd)
    for step in range(100):
        channel.add(step, {"loss": 1.0 / (step + 1), "lr": 0.1})
    channel.flush()
    got = received(ours)
    assert [(r.step, r.name) for r in got] == [(s, n) for s in range(100) for n in ("loss", "lr")]
    assert {r.rank for r in got} == {1} and got[2].value == 0.5
    channel.close()


def test_a_full_buffer_drops_the_oldest_and_counts_them(pair):
    ours, fd = pair
    channel = Channel(rank=0, fd=fd, capacity=50, interval=3600)  # nobody flushes
    for step in range(80):
        channel.add(step, {"loss": float(step)})
    assert channel.dropped == 30
    channel.flush()
    got = received(ours)
    assert [r.step for r in got] == list(range(30, 80))
    channel.close()


def test_a_busy_notebook_never_blocks_the_worker(pair):
    ours, fd = pair
    channel = Channel(rank=0, fd=fd, capacity=1_000_000, interval=0)
    for step in range(200_000):  # far more than a socket buffer holds, nobody reading
        channel.add(step, {"loss": 1.0})
    assert channel._buffer, "what could not be sent waits in the buffer"
    sent = received(ours)
    assert sent and len(sent) + len(channel._buffer) == 200_000  # nothing lost, nothing blocked
    channel.close()


def test_a_vanished_listener_never_raises(pair):
    ours, fd = pair
    channel = Channel(rank=0, fd=fd, interval=0)
    ours.close()
    for step in range(10):
        channel.add(step, {"loss": 1.0})  # no exception in the training loop
    assert not channel.connected


def test_without_a_listener_records_stay_in_the_run():
    run = Run()
    channel = Channel(rank=0, fd=None, run=run)
    channel.add(3, {"loss": 2.0})
    assert run.series("loss") == {0: ([3], [2.0])}


def test_the_accelerator_counts_samples_and_optimizer_steps():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 1)
    data = TensorDataset(torch.randn(100, 3), torch.randn(100, 1))
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8)
    )
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        accelerator.log({"loss": torch.tensor(1.5)})
    accelerator.end_training()
    assert accelerator.run.latest(SAMPLES) == {0: 100.0}  # 12 batches of 8 and one of 4
    assert accelerator.run.latest(STEPS) == {0: 7.0}  # 13 micro-batches in windows of 2
    steps, values = accelerator.run.series("loss")[0]
    assert steps == list(range(13)) and set(values) == {1.5}


class Dicts(torch.utils.data.Dataset):
    """Samples as dicts: the prepared loader counts them by its general rules."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "index": i}


@pytest.mark.parametrize(
    "data",
    [TensorDataset(torch.randn(100, 3)), Dicts(100), torch.randn(100, 3)],
    ids=["list of tensors (inline)", "dict", "a bare tensor"],
)
def test_the_prepared_loader_counts_every_kind_of_batch(data):
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(data, batch_size=8))
    seen = 0
    for batch in loader:
        if not isinstance(batch, torch.Tensor):
            batch = batch["x"] if isinstance(batch, dict) else batch[0]
        seen += len(batch)
    assert seen == accelerator.recorder.samples == 100  # 12 batches of 8 and one of 4
    accelerator.end_training()
    assert accelerator.run.latest(SAMPLES) == {0: 100.0}


def test_run_exports_and_reloads(tmp_path):
    run = Run(world_size=2)
    run.add(
        [
            Record(rank, step, 100.0 + step, "loss", step * 0.5 + rank)
            for step in range(3)
            for rank in range(2)
        ]
    )
    assert run.mean("loss") == ([0, 1, 2], [0.5, 1.0, 1.5])
    again = Run.from_json(run.to_json(tmp_path / "run.json"))
    assert again.records == run.records and again.world_size == 2
    lines = run.to_csv(tmp_path / "run.csv").read_text().splitlines()
    assert lines[0] == "rank,step,time,name,value" and lines[1] == "0,0,100.0,loss,0.0"
    saved = panel.save_png(run, tmp_path / "panel.png")  # the view is given the records
    assert saved.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rates_come_from_cumulative_counters():
    run = Run(started=10.0)
    run.add(
        [
            Record(0, 0, 10.0, SAMPLES, 0.0),
            Record(0, 1, 11.0, SAMPLES, 500.0),
            Record(0, 2, 13.0, SAMPLES, 1500.0),
        ]
    )
    assert run.rates() == {0: ([1.0, 3.0], [500.0, 500.0])}


def test_the_channel_reads_its_descriptor_from_the_environment(monkeypatch, pair):
    _, fd = pair
    monkeypatch.setenv("NBACCEL_METRICS_FD", str(fd))
    channel = Channel.from_environ(rank=0)
    assert channel.connected and channel._sock.fileno() != fd  # its own duplicate
    channel.close()
    os.fstat(fd)  # the launcher's descriptor is still open


DEVICE = "GPU" if torch.cuda.is_available() else "CPU"  # what a launch's workers train on


def test_a_one_process_launch_records_into_the_callers_run():
    from nbaccel import Run, notebook_launcher

    def train():
        accelerator = Accelerator(live=False)
        accelerator.log({"loss": 0.5})
        return accelerator.run

    run = Run()
    inner = notebook_launcher(train, num_processes=1, run=run)
    assert inner is run and run.series("loss") == {0: ([0], [0.5])} and run.results == {0: run}
    assert progress(run).startswith(f"step 1 | 1 rank on {DEVICE} |")


def test_counters_are_current_at_the_end_of_each_epoch_without_end_training():
    accelerator = Accelerator(live=False)
    accelerator.recorder.clock = lambda: 0.0  # no quarter second ever passes: only epochs count
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.randn(50, 2)), batch_size=8))
    for epoch in range(2):
        for _batch in loader:
            pass
        assert accelerator.run.latest(SAMPLES) == {0: 50.0 * (epoch + 1)}
    accelerator.end_training()
    assert accelerator.run.latest(SAMPLES) == {0: 100.0}
    # the first batch, then each epoch's end; no repeat of the unchanged count at the end
    assert accelerator.run.series(SAMPLES)[0][1] == [8.0, 50.0, 100.0]


def test_a_plain_loop_tracks_loss_and_samples_without_the_accelerator():
    with Recorder(total_steps=5, live=False) as recorder:
        for step in range(5):
            recorder.log({"loss": torch.tensor(1.0 / 2**step)}, samples=8)
    assert recorder.run.series("loss")[0] == ([0, 1, 2, 3, 4], [1.0, 0.5, 0.25, 0.125, 0.0625])
    assert recorder.run.latest(SAMPLES) == {0: 40.0}
    assert recorder.run.latest(STEPS) == {}  # no optimizer counted: the log calls are the steps
    assert progress(recorder.run, 5).startswith("step 5/5 | 1 rank |")
    with pytest.raises(TypeError, match="numbers only"):
        recorder.log({"loss": "low"})


def test_tracker_is_the_recorders_old_name_and_still_works():
    """Before the glossary gave "tracker" to Accelerate's sense, the recorder was ``Tracker``
    and ``accelerator.tracker``: code written then runs unchanged."""
    import nbaccel

    assert nbaccel.Tracker is nbaccel.Recorder and "Tracker" in nbaccel.__all__
    with nbaccel.Tracker(live=False) as old:
        old.log({"loss": 0.5}, samples=2)
    assert old.run.series("loss")[0] == ([0], [0.5])
    accelerator = Accelerator(live=False)
    assert accelerator.tracker is accelerator.recorder
    accelerator.end_training()


@pytest.mark.multiprocess
def test_a_plain_loop_in_launched_workers_reaches_the_notebook():
    def work():
        from nbaccel import Recorder

        recorder = Recorder(total_steps=3)
        for step in range(3):
            recorder.log({"loss": float(step)}, samples=4)
        recorder.close()

    run = Run()
    notebook_launcher(work, num_processes=2, run=run, timeout=120)
    assert run.series("loss") == {r: ([0, 1, 2], [0.0, 1.0, 2.0]) for r in (0, 1)}
    assert run.latest(SAMPLES) == {0: 12.0, 1: 12.0}
    assert progress(run).startswith(f"step 3 | 2 ranks on {DEVICE} |")


@pytest.mark.multiprocess
def test_a_function_without_end_training_still_sends_its_last_numbers():
    """The function drops its Accelerator when it returns: the numbers it had not yet sent
    (here, in a loop shorter than a quarter second, all but the first) still reach the
    notebook, the counters as they were at the end (``rank_recorder.close_all``)."""

    def work():
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        from nbaccel import Accelerator

        accelerator = Accelerator()
        accelerator.recorder.clock = lambda: 0.0  # no quarter second passes: no periodic send
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = DataLoader(TensorDataset(torch.randn(40, 2)), batch_size=4)
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        for (x,) in data:  # 5 batches a rank
            accelerator.backward(model(x).sum())
            optimizer.step()
            optimizer.zero_grad()
        accelerator.log({"last": 1.0})  # no end_training()

    run = Run()
    notebook_launcher(work, num_processes=2, cpu=True, run=run, timeout=120)
    assert run.latest(SAMPLES) == {0: 20.0, 1: 20.0} and run.latest(STEPS) == {0: 5.0, 1: 5.0}
    assert run.latest("last") == {0: 1.0, 1: 1.0}
    assert set(run.breakdown()) == {0, 1}


def test_a_one_process_launch_without_end_training_keeps_its_last_numbers():
    """``num_processes=1`` runs the function in this process, recording straight into the Run;
    a function that stops mid-pass without ``end_training()`` still leaves its counters as they
    were at the end (its last quarter second, here all but the first batch), and the launch
    keeps no recorder once it is over."""
    from nbaccel.observe import rank_recorder

    def work():
        accelerator = Accelerator(cpu=True)
        accelerator.recorder.clock = lambda: 0.0  # no quarter second passes: no periodic tick
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = DataLoader(TensorDataset(torch.randn(40, 2)), batch_size=4)
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        for i, (x,) in enumerate(data):
            accelerator.backward(model(x).sum())
            optimizer.step()
            optimizer.zero_grad()
            if i == 4:  # 5 of the pass's 10 batches, so no epoch's end records them either
                return

    run = Run()
    notebook_launcher(work, num_processes=1, cpu=True, run=run)
    assert run.latest(SAMPLES) == {0: 20.0} and run.latest(STEPS) == {0: 5.0}
    assert set(run.breakdown()) == {0}
    assert progress(run).startswith("step 5 | 1 rank on CPU |")
    assert not rank_recorder._unclosed


def test_total_steps_counts_batches_and_the_line_counts_as_its_steps():
    from nbaccel.observe.channel import ACCUMULATION, Record

    accelerator = Accelerator(gradient_accumulation_steps=4, live=False)
    accelerator.total_steps = 10  # batches
    assert accelerator.total_steps == 10
    run = accelerator.run
    assert run.latest("nbaccel/total_steps") == {0: 10.0} and run.latest(ACCUMULATION) == {0: 4}
    accelerator.end_training()
    # a loop that logs every micro-batch: the line counts batches, of the 10
    run.add([Record(0, i, 1.0 + i, "loss", 1.0) for i in range(8)])
    run.add([Record(0, 2, 9.0, STEPS, 2.0)])
    assert progress(run, total_steps=10).startswith("step 8/10 (micro-batches; 2 optimizer")
    # a loop that logs only when it steps: the line counts optimizer steps, of ceil(10 / 4)
    run.reset()
    run.add([Record(0, 0, 0.0, ACCUMULATION, 4.0)])
    run.add([Record(0, i, 1.0 + i, "loss", 1.0) for i in range(2)])
    run.add([Record(0, 2, 3.0, STEPS, 2.0)])
    assert progress(run, total_steps=10).startswith("step 2/3 |")
