"""Teardown in the canonical order a learner writes, under the launcher and under torchrun.

The loop every tutorial teaches ends with ``destroy_process_group()``, after which the function
returns and its DDP model is freed. With gloo (torch 2.13) the Reducer freed after its group can
hang its process (measured: 3 launches in 150 on 2 cores). nbaccel's workers keep destroyed
groups alive until they exit (``nbaccel.launch.kept_groups``), and nbaccel's
``end_training`` frees its models before it leaves the group, so the lessons teach no workaround.

Whether the fix is in place is read from the worker itself, never from luck: the repeated
launches below would catch a hang only now and then, so the first test asks the worker which
groups it kept. The timeouts catch hangs, not slowness.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from nbaccel import notebook_launcher

pytestmark = pytest.mark.multiprocess


def canonical(check_kept: bool = False):
    """Lesson 2's loop, cut short: DDP, a few steps, destroy, return (the model freed after)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    world = dist.group.WORLD
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
    if check_kept:
        from nbaccel.launch import kept_groups as groups

        return any(group is world for group in groups.KEPT_GROUPS)
    return dist.is_initialized()


def test_a_worker_keeps_the_group_it_destroyed_until_it_exits():
    kept = notebook_launcher(canonical, args=(True,), num_processes=2, cpu=True, return_all=True)
    assert kept == [True, True]


def test_the_canonical_loop_ends_without_a_workaround_launch_after_launch():
    for _ in range(12):  # each launch about 0.1 s once the server runs
        assert notebook_launcher(canonical, num_processes=2, cpu=True, timeout=120) is False


SCRIPT = textwrap.dedent(
    """
    import pathlib
    import sys

    import torch
    import torch.nn.functional as F
    from nbaccel import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.cycle = [model]  # a reference cycle: only the collector frees it
    for _ in range(3):
        accelerator.backward(F.mse_loss(model(torch.randn(8, 16)), torch.zeros(8, 4)))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()  # no free_memory(), no gc.collect(), no del
    # one file per rank: two ranks' prints share one pipe and may interleave
    pathlib.Path(sys.argv[1], f"ended-{accelerator.process_index}").touch()
    """
)


def test_end_training_under_torchrun_needs_no_workaround(tmp_path):
    """A plain interpreter's exit, where the launcher's keeping cannot help: ``end_training``
    frees the DDP model before it destroys the group, whatever still refers to the model."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    for attempt in range(3):
        ended = tmp_path / str(attempt)
        ended.mkdir()
        done = subprocess.run(
            [*command, str(ended)], env=env, capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(p.name for p in ended.iterdir()) == ["ended-0", "ended-1"], done.stdout
