"""Trackers and resuming, as a notebook user meets them: functions defined in cells of a real
kernel, launched on 2 ranks; every tracker's records read back by its own library, and a run
whose rank 0 is SIGKILLed mid-epoch resumed to the uninterrupted run's weights."""

from __future__ import annotations

import pytest
import torch

from ...accelerator.test_resume import LOOP
from ...kernel import kernel_with, no_workers_left
from .test_trackers import (
    installed,
    mlflow_run,
    tensorboard_config,
    tensorboard_scalars,
    wandb_records,
)

pytestmark = pytest.mark.multiprocess

TRAIN = """
import os
import torch
from nbaccel import Accelerator, LaunchError, Run, notebook_launcher
from nbaccel.observe.trackers.general import GeneralTracker, installed

os.environ.pop("WANDB_API_KEY", None)
os.environ["WANDB_SILENT"] = "true"

class Calls(GeneralTracker):          # a tracker of one's own, defined in a cell
    name = "calls"
    def __init__(self, path):
        self.path, self.lines = path, []
    def store_init_configuration(self, values):
        self.lines.append(f"config {sorted(values)}")
    def log(self, values, step, **kwargs):
        self.lines.append(f"log {step} {values['loss']:.6f}")
    def finish(self):
        with open(f"{self.path}.{os.getpid()}", "w") as f:
            f.write("\\n".join(self.lines))

def tracked(folder, steps=8):
    names = [n for n in ("tensorboard", "mlflow", "wandb") if installed(n)]
    accelerator = Accelerator(log_with=[*names, Calls(f"{folder}/calls")], project_dir=folder)
    torch.manual_seed(accelerator.rank)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers("two_ranks", config={"lr": 0.05, "steps": steps})
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss, "note": f"rank {accelerator.rank}"})  # text: trackers'
        losses.append(loss.item())
    accelerator.end_training()
    return losses
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with kernel_with(str(tmp_path_factory.mktemp("kernel")), TRAIN, LOOP) as kernel:
        yield kernel


@pytest.fixture(autouse=True)
def _no_workers_left(kernel):
    yield
    no_workers_left(kernel)


def test_two_ranks_write_one_run_per_tracker_read_back_by_each_library(kernel, tmp_path):
    out = kernel.run(
        f"run = Run()\n"
        f"losses = notebook_launcher(tracked, args=({str(tmp_path)!r},), num_processes=2,"
        f" run=run)\n"
        f"print(losses)\n"
        f"print(run.series('loss')[0][1] == losses, sorted(run.series('loss')))",
        timeout=300,
    )
    assert out.error is None, out.error
    lines = out.stdout.strip().splitlines()
    losses = [float(x) for x in lines[-2].strip("[]").split(",")]
    assert lines[-1] == "True [0, 1]"  # the notebook's own record has both ranks, as before
    steps = list(range(1, 9))
    if installed("tensorboard"):
        run = tmp_path / "two_ranks"
        assert len(list(run.glob("events.out.tfevents.*"))) == 1  # rank 0 alone wrote
        scalars = tensorboard_scalars(run, "loss")
        assert [s for s, _ in scalars] == steps
        assert [v for _, v in scalars] == pytest.approx(losses, rel=1e-6)
        assert tensorboard_config(run) == {"lr": 0.05, "steps": 8.0}
    if installed("mlflow"):
        client, runs = mlflow_run(tmp_path, "two_ranks")
        assert len(runs) == 1
        history = client.get_metric_history(runs[0].info.run_id, "loss")
        assert [(m.step, m.value) for m in history] == list(zip(steps, losses, strict=True))
        assert runs[0].data.params == {"lr": "0.05", "steps": "8"}
    if installed("wandb"):
        history, config, runs = wandb_records(tmp_path)
        assert len(runs) == 1
        assert [(r["_step"], r["loss"]) for r in history] == list(zip(steps, losses, strict=True))
        assert config["lr"] == 0.05 and config["steps"] == 8
    written = sorted(tmp_path.glob("calls.*"))
    assert len(written) == 1  # main_process_only: the tracker object ran on rank 0 alone
    expected = ["config ['lr', 'steps']"] + [
        f"log {s} {v:.6f}" for s, v in zip(steps, losses, strict=True)
    ]
    assert written[0].read_text().splitlines() == expected


def test_two_ranks_killed_mid_epoch_resume_to_the_uninterrupted_weights(kernel, tmp_path):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    code = f"""
whole = notebook_launcher(resumable, args=({whole!r},), num_processes=2)
try:
    notebook_launcher(resumable, args=({killed!r}, 13), kwargs={{"how": "sigkill"}},
                      num_processes=2)
except LaunchError as err:
    print("died:", str(err).splitlines()[0])
resumed = notebook_launcher(resumable, args=({killed!r},), kwargs={{"resume": True}},
                            num_processes=2)
torch.save({{"whole": whole, "resumed": resumed}}, {str(tmp_path / "weights.pt")!r})
"""
    out = kernel.run(code, timeout=400)
    assert out.error is None, out.error
    assert "died: rank 0 " in out.stdout and "killed by SIGKILL" in out.stdout, out.stdout
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    whole, resumed = weights["whole"], weights["resumed"]
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)  # bit for bit, on 2 ranks
    names = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert len([n for n in names if not n.startswith(".")]) <= 2  # total_limit=2
