"""transformers' Trainer under notebook_launcher with nbaccel's LiveCallback: what reaches the
notebook's Run from every rank, and that Trainer's numbers do not move (the oracle: the same
Trainer without the callback, to 1e-6)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nbaccel import Run, notebook_launcher
from nbaccel.observe.channel import SAMPLES, STEPS, TOTAL_STEPS

from .loops import BATCH, EPOCHS, trainer_loop
from .loops import SAMPLES as DATA

pytest.importorskip("transformers", reason="make installs it (nbaccel[transformers])")
pytestmark = pytest.mark.multiprocess

PER_RANK = DATA // 2 // 2  # Tokens holds half of SAMPLES; each rank gets half of that
STEPS_PER_RANK = EPOCHS * PER_RANK // BATCH


def test_every_ranks_loss_samples_and_steps_reach_the_run_and_no_weight_moves(tmp_path):
    run = Run()
    launch = {"num_processes": 2, "cpu": True, "return_all": True, "live": False, "timeout": 300}
    values = notebook_launcher(trainer_loop, args=(True, str(tmp_path / "a")), run=run, **launch)
    plain = notebook_launcher(trainer_loop, args=(False, str(tmp_path / "b")), **launch)
    for rank in (0, 1):
        assert all(
            torch.allclose(p, q, rtol=0, atol=1e-6)
            for p, q in zip(values[rank], plain[rank], strict=True)
        ), f"rank {rank}'s weights moved"
    # Trainer calls callbacks on every process: both ranks' loss (logging_steps=2), counted
    # from 0 as nbaccel's steps are (Trainer's global step 2 is step 1)
    loss = run.series("loss")
    assert sorted(loss) == [0, 1]
    assert loss[0][0] == loss[1][0] == list(range(1, STEPS_PER_RANK, 2))
    assert sorted(run.series("learning_rate")) == [0, 1]
    assert "train_runtime" not in run.names()  # Trainer's own clock stays out
    assert run.latest(SAMPLES) == {0: EPOCHS * PER_RANK, 1: EPOCHS * PER_RANK}
    assert run.latest(STEPS) == {0: STEPS_PER_RANK, 1: STEPS_PER_RANK}
    assert run.latest(TOTAL_STEPS) == {0: STEPS_PER_RANK, 1: STEPS_PER_RANK}
    assert sorted(run.breakdown()) == [0, 1]
    assert all(parts["compute"] > 0 for parts in run.breakdown().values())
    assert run.unmeasured() == ["communication"]  # DDP's all-reduce is inside compute here
    assert "loss" in run.to_csv(tmp_path / "run.csv").read_text()


def test_without_transformers_the_import_says_what_to_install():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    from nbaccel import LiveCallback\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install" in out.stdout and "nbaccel[transformers]" in out.stdout, out
