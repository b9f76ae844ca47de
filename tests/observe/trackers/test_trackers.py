"""Experiment trackers behind ``log_with``: what each library wrote, read back by that library.

TensorBoard's event files are read by TensorBoard's ``EventAccumulator``, MLflow's store by
``MlflowClient``, wandb's offline run by wandb's own protobuf records (``wandb_records``). The
multi-process runs are in ``test_tracking_notebook.py`` (a real kernel) and here under
``nbaccel launch``; this module also checks the errors, which need no worker.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nbaccel import Accelerator
from nbaccel.observe.trackers.general import GeneralTracker, installed


# -- reading each library's records back ---------------------------------------------------
def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def tensorboard_config(folder: Path) -> dict[str, object]:
    """The hyperparameters TensorBoard's HParams tab shows for the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(folder))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = data.session_start_info.hparams
    return {
        k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in hparams.items()
    }


def mlflow_run(folder: Path, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    return client, runs


def wandb_records(folder: Path) -> tuple[list[dict], dict, list[Path]]:
    """(history rows, config) of the one offline run under ``folder``, read from wandb's
    transaction log with wandb's own ``Record`` protobuf. The log is LevelDB's format: 32 KiB
    blocks of chunks, each a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle,
    4 last) and its bytes."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = sorted(Path(folder).glob("wandb/offline-run-*"))
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    history, config, pos, pending = [], {}, 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record.FromString(pending)
            pending = b""
            which = record.WhichOneof("record_type")
            if which == "history":
                row = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                history.append(row)
            elif which in ("config", "run"):
                items = record.config.update if which == "config" else record.run.config.update
                config.update({i.key: json.loads(i.value_json) for i in items})
    return history, config, runs


needs = {
    name: pytest.mark.skipif(not installed(name), reason=f"{name} is not installed")
    for name in ("tensorboard", "mlflow", "wandb")
}


# -- one process ----------------------------------------------------------------------------
def fit(tmp_path: Path, log_with, steps: int = 6, **init) -> tuple[Accelerator, list[float]]:
    torch.manual_seed(0)
    accelerator = Accelerator(log_with=log_with, project_dir=str(tmp_path), live=False)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers("fit", config={"lr": 0.1, "layers": [3, 1], "opt": {"m": 0}}, **init)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss, "note": "text", "pair": {"a": 1.0, "b": 2.0}})
        losses.append(loss.item())
    return accelerator, losses


@needs["tensorboard"]
def test_tensorboard_records_every_step_text_and_the_config(tmp_path):
    accelerator, losses = fit(tmp_path, "tensorboard")
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    from torch.utils.tensorboard import SummaryWriter

    assert isinstance(writer, SummaryWriter)
    accelerator.end_training()
    run = tmp_path / "fit"
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    scalars = tensorboard_scalars(run, "loss")
    assert [s for s, _ in scalars] == list(range(1, 7))  # the optimizer steps taken
    assert [v for _, v in scalars] == pytest.approx(losses, rel=1e-6)  # stored as float32
    assert tensorboard_config(run) == {"lr": 0.1, "layers": "[3, 1]", "opt/m": 0.0}
    assert accelerator.run.series("loss")[0][1] == pytest.approx(losses)  # the live view's too


@needs["mlflow"]
def test_mlflow_keeps_a_local_store_under_the_project(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    accelerator, losses = fit(tmp_path, "mlflow")
    accelerator.end_training()
    client, runs = mlflow_run(tmp_path, "fit")
    assert len(runs) == 1
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == list(zip(range(1, 7), losses, strict=True))
    assert runs[0].data.params == {"lr": "0.1", "layers": "[3, 1]", "opt/m": "0"}
    assert client.get_run(runs[0].info.run_id).info.status == "FINISHED"


@needs["mlflow"]
def test_mlflow_honours_mlflow_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    accelerator, _ = fit(tmp_path / "project", "mlflow", steps=2)
    accelerator.end_training()
    assert (tmp_path / "elsewhere.db").is_file()
    assert not (tmp_path / "project" / "mlflow.db").exists()


@needs["wandb"]
@pytest.mark.process
def test_wandb_logs_offline_without_an_account_and_says_so(tmp_path, monkeypatch, capfd):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_SILENT", "true")
    accelerator, losses = fit(tmp_path, "wandb")
    accelerator.end_training()
    assert "logged offline under" in capfd.readouterr().err
    history, config, runs = wandb_records(tmp_path)
    assert len(runs) == 1
    assert [(r["_step"], r["loss"]) for r in history] == list(zip(range(1, 7), losses, strict=True))
    assert config["lr"] == 0.1 and config["opt"] == {"m": 0}


def test_a_tracker_of_your_own(tmp_path):
    class CallLog(GeneralTracker):
        name = "calls"

        def __init__(self):
            self.calls = []

        @property
        def tracker(self):
            return self.calls

        def store_init_configuration(self, values):
            self.calls.append(("config", values))

        def log(self, values, step, **kwargs):
            self.calls.append(("log", step, values["loss"], kwargs))

        def finish(self):
            self.calls.append(("finish",))

    mine = CallLog()
    accelerator, losses = fit(tmp_path, [mine], steps=2)
    accelerator.log({"loss": 1.5}, step=40, log_kwargs={"calls": {"commit": True}})
    assert accelerator.get_tracker("calls", unwrap=True) is mine.calls
    assert accelerator.trackers == [mine]
    accelerator.end_training()
    assert mine.calls == [
        ("config", {"lr": 0.1, "layers": [3, 1], "opt": {"m": 0}}),
        ("log", 1, losses[0], {}),
        ("log", 2, losses[1], {}),
        ("log", 40, 1.5, {"commit": True}),
        ("finish",),
    ]


# -- errors, at construction -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tensorboard", "mlflow", "wandb"])
def test_a_tracker_that_is_not_installed_fails_at_construction(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "nbaccel\[trackers\]"') as err:
        Accelerator(log_with=name, project_dir=str(tmp_path), live=False)
    assert f'log_with="{name}" needs the {name} package' in str(err.value)
    assert sys.executable in str(err.value)  # the install line for this very interpreter


def test_all_with_no_tracker_installed(tmp_path, monkeypatch):
    for name in ("tensorboard", "mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="found no tracker installed"):
        Accelerator(log_with="all", project_dir=str(tmp_path), live=False)


def test_tensorboard_without_a_folder_and_an_unknown_name():
    with pytest.raises(ValueError, match='project_dir="runs"'):
        Accelerator(log_with="tensorboard", live=False)
    with pytest.raises(ValueError, match="'tensorboard', 'mlflow', 'wandb', 'all'"):
        Accelerator(log_with="comet_ml", live=False)


def test_get_tracker_before_init_trackers_says_what_to_do(tmp_path):
    accelerator = Accelerator(log_with=[], live=False)
    with pytest.raises(ValueError, match="call init_trackers first"):
        accelerator.get_tracker("tensorboard")


# -- under nbaccel launch -----------------------------------------------------------------------
LAUNCHED = """
import torch
from nbaccel import Accelerator

accelerator = Accelerator(log_with="tensorboard", project_dir={folder!r})
accelerator.init_trackers("launched", config={{"world": accelerator.num_processes}})
for step in range(5):
    accelerator.log({{"rank": float(accelerator.rank), "value": step * 1.5}})
    accelerator.recorder.count(optimizer_steps=1)
accelerator.end_training()
"""


@needs["tensorboard"]
@pytest.mark.multiprocess
def test_under_nbaccel_launch_only_the_main_process_writes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED.format(folder=str(tmp_path / "runs")))
    done = subprocess.run(
        [sys.executable, "-m", "nbaccel", "launch", "-n", "2", "--cpu", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NBACCEL_CONFIG": str(tmp_path / "none.json")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "launched"
    assert len(glob.glob(str(run / "events.out.tfevents.*"))) == 1
    assert tensorboard_scalars(run, "rank") == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0)]
    assert [v for _, v in tensorboard_scalars(run, "value")] == [0.0, 1.5, 3.0, 4.5, 6.0]
    assert tensorboard_config(run) == {"world": 2.0}


def test_on_main_process_runs_a_trackers_method_on_rank_0_only(monkeypatch):
    from nbaccel.observe.trackers.general import on_main_process

    class Ported(GeneralTracker):  # as a tracker written for Accelerate declares its methods
        def __init__(self):
            super().__init__(_blank=False)
            self.seen = []

        @on_main_process
        def log(self, values, step, **kwargs):
            self.seen.append(step)

    tracker = Ported()
    tracker.log({}, 1)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29500")  # read, never bound: no process group is made
    tracker.log({}, 2)
    tracker.main_process_only = False
    tracker.log({}, 3)
    assert tracker.seen == [1, 3]
