"""``nbaccel launch --slurm``: a script on the two-node test cluster, as the cell's path runs a
function (its output, its errors with rank and node, the batch script printed first)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if "--fail" in sys.argv and os.environ["SLURMD_NODENAME"] == "n2":
        raise RuntimeError("the second node's shard is empty")
    print("rank", rank, "of", dist.get_world_size(), "on", os.environ["SLURMD_NODENAME"],
          "argv", sys.argv[1:])
    dist.barrier()
    dist.destroy_process_group()
    """
)


def nbaccel(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nbaccel", "launch", "--slurm", "--num-nodes", "2"]
    command += ["--folder", str(tmp_path / "jobs"), *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=280, cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_a_script_runs_on_two_nodes(empty_queue, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = nbaccel(tmp_path, "-n", "1", "train.py", "--epochs", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rank 0] rank 0 of 2 on n1 argv ['--epochs', '2']" in done.stdout
    assert "[rank 1] rank 1 of 2 on n2 argv ['--epochs', '2']" in done.stdout


def test_a_failing_script_names_the_rank_and_node(empty_queue, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = nbaccel(tmp_path, "train.py", "--fail")
    assert done.returncode == 1
    assert "rank 1 (pid " in done.stderr and "on node n2 raised RuntimeError" in done.stderr
    assert "the second node's shard is empty" in done.stderr


def test_the_batch_script_is_printed_and_nothing_is_submitted(empty_queue, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = nbaccel(tmp_path, "--print-script", "--gpus-per-node", "4", "--time", "30", "train.py")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --gpus-per-node=4" in lines
    assert "#SBATCH --time=30" in lines
    assert empty_queue.queue() == []
