"""`make demo`'s job: 2 CPU workers started by torch's own elastic launcher, loss falling."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_demo_trains_on_two_workers_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "nbaccel.lessons.demo",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 workers on cpu, 32 batches of 32 per worker per epoch" in done.stdout
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 8, done.stdout  # printed once, by the main process only
    assert losses[-1] < losses[0] / 4, losses


EXITS = """
import os, sys, weakref
import torch
from nbaccel import Accelerator

def train():
    accelerator = Accelerator(live=False)
    model = torch.nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(4, 2)).sum())
    optimizer.step()
    accelerator.end_training()
    line = f"rank {accelerator.process_index}: freed while finalizing=%s\\n"
    say = lambda: os.write(1, (line % sys.is_finalizing()).encode())
    weakref.finalize(model, say).atexit = False  # said when freed, not at exit

train()  # the Accelerator and its wrappers form reference cycles: only a collection frees them
import gc; gc.disable()  # no collection happens to run before the interpreter's teardown
"""


@pytest.mark.multiprocess
def test_a_prepared_ddp_model_is_freed_before_the_interpreter_tears_down(tmp_path):
    """A DDP model keeps its gloo group alive; freed during the interpreter's teardown, the
    group can abort a worker after training succeeded (SIGABRT, "terminate called without an
    active exception"). The process group's owner frees such cycles at exit, while Python is
    whole."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    freed = sorted(line for line in done.stdout.splitlines() if "freed" in line)
    assert freed == [f"rank {r}: freed while finalizing=False" for r in (0, 1)], done.stdout
