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
