"""Resuming a run that died mid-epoch: automatic checkpoints, registered objects, the loader's
place in its epoch. The oracle is the same loop run without interruption: a killed-and-resumed
run must end on exactly its weights (CPU: bit for bit).

The loop is source text, as a notebook cell holds it: this module runs it in-process (one
process, the "kill" an exception), in a subprocess killed by SIGKILL, and in a real kernel on 2
ranks (``test_resume_notebook.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nbaccel import Accelerator, CheckpointError, ProjectConfiguration
from nbaccel.accelerator.checkpoint import MANIFEST
from nbaccel.accelerator.project import newest
from nbaccel.observe.trackers.general import installed

from ..observe.trackers.test_trackers import tensorboard_scalars

LOOP = textwrap.dedent(
    """
    import os
    import signal

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, DataLoaderConfiguration, ProjectConfiguration, set_seed


    class Progress:  # where the loop is, saved with every checkpoint
        def __init__(self):
            self.epoch, self.batch = 0, 0

        def state_dict(self):
            return {"epoch": self.epoch, "batch": self.batch}

        def load_state_dict(self, state):
            self.epoch, self.batch = state["epoch"], state["batch"]


    class Killed(Exception):
        pass


    def resumable(folder, kill_after=None, resume=False, epochs=3, every=3, seedable=False,
                  total_limit=2, accumulation=1, how="raise", log_with=None):
        set_seed(0)
        config = ProjectConfiguration(folder, automatic_checkpoint_naming=True,
                                      total_limit=total_limit)
        accelerator = Accelerator(
            project_config=config, gradient_accumulation_steps=accumulation, live=False,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable),
            log_with=log_with,
        )
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(100, 6, generator=g), torch.randn(100, 1, generator=g)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.9)
        loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
        progress = Progress()
        accelerator.register_for_checkpointing(progress)
        if log_with:
            accelerator.init_trackers("resume", config={"lr": 1e-2})
        if resume:
            accelerator.load_state()
        steps = 0
        for epoch in range(progress.epoch, epochs):
            progress.epoch = epoch
            loader.set_epoch(epoch)
            batches = (
                accelerator.skip_first_batches(loader, progress.batch) if progress.batch else loader
            )
            for xb, yb in batches:
                with accelerator.accumulate(model):
                    loss = F.mse_loss(model(xb), yb)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                accelerator.log({"loss": loss})
                progress.batch += 1
                steps += 1
                if progress.batch % every == 0:
                    accelerator.save_state()
                if steps == kill_after:
                    if how == "raise":
                        raise Killed(steps)
                    if accelerator.is_main_process:  # the others are stopped by the launcher
                        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind
            progress.batch = 0
        accelerator.end_training()
        state = accelerator.unwrap_model(model).state_dict()
        return {k: v.detach().cpu().clone() for k, v in state.items()}
    """
)


@pytest.fixture(scope="module")
def loop():
    namespace: dict = {}
    exec(compile(LOOP, "<the loop>", "exec"), namespace)
    return namespace


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "options",
    [
        {},  # shuffled by the global RNG
        {"seedable": True},  # shuffled from data_seed + epoch
        {"accumulation": 2, "every": 4},  # saved at the end of an accumulation window
    ],
    ids=["shuffle", "seedable", "accumulation"],
)
def test_a_run_killed_mid_epoch_resumes_to_the_same_weights(tmp_path, loop, options):
    uninterrupted = loop["resumable"](str(tmp_path / "whole"), **options)
    folder = str(tmp_path / "killed")
    with pytest.raises(loop["Killed"]):
        loop["resumable"](folder, kill_after=22, **options)  # epoch 1 (17 batches an epoch)
    saved = json.loads((newest(ProjectConfiguration(folder, True)) / MANIFEST).read_text())
    assert saved["dataloaders"] == 1 and saved["custom"] == 1
    resumed = loop["resumable"](folder, resume=True, **options)
    assert same(resumed, uninterrupted)
    # the oracle can fail: restarting the interrupted epoch from its first batch is different
    restarted = _restart_epoch(loop, tmp_path, options)
    assert not same(restarted, uninterrupted)


def _restart_epoch(loop, tmp_path, options):
    folder = str(tmp_path / "restarted")
    with pytest.raises(loop["Killed"]):
        loop["resumable"](folder, kill_after=22, **options)
    config = ProjectConfiguration(folder, automatic_checkpoint_naming=True)
    progress_file = newest(config) / "custom_checkpoint_0.pt"
    progress = torch.load(progress_file, weights_only=True)
    torch.save({**progress, "batch": 0}, progress_file)  # forget where the epoch was
    return loop["resumable"](folder, resume=True, **options)


def test_total_limit_keeps_the_newest_and_numbers_go_on(tmp_path, loop):
    folder = tmp_path / "run"
    loop["resumable"](str(folder), epochs=1, every=3, total_limit=2)  # 17 batches: 5 saves
    names = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert names == ["checkpoint_3", "checkpoint_4"]
    with pytest.raises(loop["Killed"]):
        loop["resumable"](str(folder), resume=True, epochs=2, kill_after=6)  # saves at step 5
    names = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert names == ["checkpoint_4", "checkpoint_5"]  # a resumed run never overwrites


SCRIPT = """
import sys
sys.path.insert(0, {here!r})
exec(compile({loop!r}, "<the loop>", "exec"))
import nbaccel.accelerator.checkpoint as checkpoint
saves, real = [0], checkpoint.atomic_save

def dying_save(obj, path):  # SIGKILL in the middle of the second checkpoint
    if str(path).endswith("custom_checkpoint_0.pt"):
        saves[0] += 1
        if saves[0] == {die_in}:
            import os, signal
            os.kill(os.getpid(), signal.SIGKILL)
    real(obj, path)

checkpoint.atomic_save = dying_save
resumable({folder!r}, total_limit={total_limit}, every=3, epochs=1)
"""


@pytest.mark.parametrize("total_limit", [1, 2])
@pytest.mark.process
def test_a_save_killed_halfway_never_replaces_the_last_good_checkpoint(tmp_path, loop, total_limit):
    folder = tmp_path / "run"
    script = SCRIPT.format(
        here=str(Path(__file__).parent),
        loop=LOOP,
        folder=str(folder),
        total_limit=total_limit,
        die_in=2,
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=300, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    checkpoints = folder / "checkpoints"
    visible = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith("."))
    assert visible == ["checkpoint_0"]  # the good one, even with total_limit=1
    assert (checkpoints / ".checkpoint_1.staging").is_dir()  # the half-written one, hidden
    assert (checkpoints / "checkpoint_0" / MANIFEST).is_file()
    config = ProjectConfiguration(str(folder), automatic_checkpoint_naming=True)
    assert newest(config).name == "checkpoint_0"
    # resumed from checkpoint_0, the run ends where the uninterrupted one does
    resumed = loop["resumable"](str(folder), resume=True, every=3, epochs=1)
    whole = loop["resumable"](str(tmp_path / "whole"), every=3, epochs=1)
    assert same(resumed, whole)
    assert not (checkpoints / ".checkpoint_1.staging").exists()  # cleaned by the next save


@pytest.mark.process
def test_a_process_killed_by_sigkill_resumes_to_the_same_weights(tmp_path, loop):
    folder = tmp_path / "run"
    script = (
        f"exec(compile({LOOP!r}, '<the loop>', 'exec'))\n"
        f"resumable({str(folder)!r}, kill_after=22, how='sigkill')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=300, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    resumed = loop["resumable"](str(folder), resume=True)
    assert same(resumed, loop["resumable"](str(tmp_path / "whole")))


def test_load_state_without_a_complete_checkpoint(tmp_path):
    config = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, live=False)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        accelerator.load_state()
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)  # no manifest: incomplete
    with pytest.raises(CheckpointError, match="none complete"):
        accelerator.load_state()


def test_without_automatic_naming_a_folder_is_needed(tmp_path):
    accelerator = Accelerator(project_dir=str(tmp_path), live=False)
    for method in (accelerator.save_state, accelerator.load_state):
        with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
            method()
    assert not any(tmp_path.iterdir())  # nothing written


def test_project_configuration_is_checked():
    config = ProjectConfiguration(automatic_checkpoint_naming=True)  # project_dir may come later
    with pytest.raises(ValueError, match="needs a project_dir"):
        Accelerator(project_config=config, live=False).save_state()
    with pytest.raises(ValueError, match="total_limit=0"):
        ProjectConfiguration("runs", total_limit=0)
    assert ProjectConfiguration("runs").logging_dir == "runs"


def test_register_for_checkpointing_and_skip_first_batches_refuse_what_they_cannot_use():
    accelerator = Accelerator(live=False)
    with pytest.raises(ValueError, match="state_dict"):  # Accelerate's type
        accelerator.register_for_checkpointing(object())
    with pytest.raises(TypeError, match="prepare"):
        accelerator.skip_first_batches([1, 2, 3], 1)
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=2))
    with pytest.raises(ValueError, match="num_batches=-1"):
        accelerator.skip_first_batches(loader, -1)
    skipped = accelerator.skip_first_batches(loader, 2)
    assert len(skipped) == 3
    assert [b.tolist() for b in skipped] == [[4, 5], [6, 7], [8, 9]]
    assert loader.epoch == 1  # the skipped pass was the loader's pass


def test_a_registered_object_that_weights_only_cannot_load_is_named(tmp_path):
    class Opaque:
        def state_dict(self):
            return {"when": os.times()}  # a type weights_only loading refuses

        def load_state_dict(self, state):
            pass

    accelerator = Accelerator(live=False)
    accelerator.register_for_checkpointing(Opaque())
    accelerator.save_state(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="weights_only"):
        accelerator.load_state(tmp_path / "ckpt")


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard is not installed")
def test_the_trackers_step_counts_on_across_a_resume(tmp_path, loop):
    folder = str(tmp_path / "run")
    with pytest.raises(loop["Killed"]):
        loop["resumable"](folder, kill_after=22, log_with="tensorboard")
    loop["resumable"](folder, resume=True, log_with="tensorboard")
    first, second = sorted((tmp_path / "run" / "resume").glob("events.out.tfevents.*"))
    steps = [s for s, _ in tensorboard_scalars(first, "loss")]
    # died after step 22; save_state at step 20 wrote every record before it (the last ones
    # may be lost with the process, as TensorBoard's own writer loses its queue)
    assert steps[:20] == list(range(1, 21)) and len(steps) <= 22
    steps = [s for s, _ in tensorboard_scalars(second, "loss")]
    assert steps == list(range(21, 52))  # to 3 epochs of 17 batches, counted from the save
