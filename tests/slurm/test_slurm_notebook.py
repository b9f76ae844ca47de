"""The cluster path from notebook cells in a real Jupyter kernel, on the two-node test cluster:
the value back with both nodes' output, and the stop button (``scancel``; the kernel lives on)."""

from __future__ import annotations

import pytest

from tests.kernel import kernel_with

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

CELL = """
from nbaccel import SlurmCluster, notebook_launcher

def where(seconds=0):
    import os, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("on", os.environ["SLURMD_NODENAME"], flush=True)
    time.sleep(seconds)
    rank = dist.get_rank() * 10 + dist.get_world_size()
    dist.destroy_process_group()
    return rank

def logs():
    import time
    import torch.distributed as dist
    from nbaccel import Recorder
    dist.init_process_group("gloo")
    recorder = Recorder(total_steps=20)
    for step in range(20):
        time.sleep(0.1)
        recorder.log({"loss": 1.0 / (step + 1)}, samples=8)
    recorder.close()
    dist.destroy_process_group()

def wait_for_the_moon():
    import time
    time.sleep(600)

def hangs():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        print("waiting for the moon", flush=True)
        wait_for_the_moon()
    print("at the barrier", flush=True)
    dist.barrier()

cluster = SlurmCluster(time=10, folder="jobs")
"""


@pytest.fixture(scope="module")
def kernel(slurm, tmp_path_factory):  # slurm first: the kernel inherits SLURM_CONF
    with kernel_with(str(tmp_path_factory.mktemp("kernel")), CELL) as kernel:
        yield kernel


def test_a_cell_runs_a_function_on_two_nodes_and_gets_rank_0s_value(kernel, empty_queue):
    out = kernel.run("notebook_launcher(where, num_nodes=2, cluster=cluster, timeout=240)", 300)
    assert out.error is None, out.error
    assert out.value == "2"  # rank 0 of a world of 2
    assert "[rank 0] on n1" in out.stdout and "[rank 1] on n2" in out.stdout
    assert "running on n[1-2]" in out.stderr


def test_the_live_panel_draws_every_nodes_loss(kernel, empty_queue):
    code = "run = Run(); notebook_launcher(logs, num_nodes=2, cluster=cluster, run=run)"
    out = kernel.run("from nbaccel import Run\n" + code, 300)
    assert out.error is None, out.error
    assert out.images, "no panel was drawn"
    assert kernel.run("sorted(run.series('loss'))").value == "[0, 1]"


def test_the_stop_button_says_where_each_rank_was_cancels_the_job_and_keeps_the_kernel(
    kernel, empty_queue
):
    msg_id = kernel.start("notebook_launcher(hangs, num_nodes=2, cluster=cluster)")
    kernel.wait_for_output("[rank 1] waiting for the moon", "[rank 0] at the barrier", timeout=240)
    kernel.manager.interrupt_kernel()  # Jupyter's stop button
    out = kernel.finish(msg_id, timeout=180)
    assert out.error["ename"] == "KeyboardInterrupt"
    assert "was cancelled" in out.stderr
    # each node asked its own ranks, through the job folder
    assert "rank 1 is in `wait_for_the_moon`" in out.stderr, out.stderr
    assert "rank 0 waits in `barrier` called from `hangs`" in out.stderr, out.stderr
    if " was cancelled.\n" in out.stderr:  # said gone: it was gone before the cell ended
        assert empty_queue.queue() == []
    else:  # said still there, with why (SLURM stopping it, up to its KillWait)
        assert "was cancelled, and the queue still shows it" in out.stderr, out.stderr
    assert kernel.run("1 + 1").value == "2"


#: A kernel started inside an allocation runs ``call`` after ``cell``; then the queue is shown.
INSIDE = """
import subprocess, sys
sys.path.insert(0, {root!r})
from tests.kernel import kernel_with
with kernel_with({cwd!r}, {cell!r}) as kernel:
    out = kernel.run({call!r}, 300)
    print("value:", out.value, "error:", out.error)
    print(out.stdout + out.stderr)
queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
print("queue:", queue.split())
"""


def test_a_kernel_inside_an_allocation_runs_a_job_step_there(slurm, empty_queue, tmp_path):
    """Jupyter started under ``salloc``: the launch runs as a step of that allocation, and no
    second job enters the queue."""
    call = "notebook_launcher(where, num_nodes=2, cluster=cluster, timeout=240)"
    done = in_allocation(slurm, 2, tmp_path, CELL, call)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "value: 2 error: None" in out, out
    assert "[rank 0] on n1" in out and "[rank 1] on n2" in out
    assert "a job step in SLURM allocation" in out
    assert out.split("queue: ")[1].strip() == str(sorted(slurm_ids(out))), out


def in_allocation(slurm, nodes: int, cwd, cell: str, call: str):
    """A kernel started under ``salloc --nodes=nodes`` (in ``cwd``) runs ``cell``, then
    ``call``; the finished ``salloc`` (``INSIDE`` prints the value, the output, the queue)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = INSIDE.format(root=str(Path(__file__).parents[2]), cwd=str(cwd), cell=cell, call=call)
    return subprocess.run(
        ["salloc", f"--nodes={nodes}", "--time=10", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=400, env={**os.environ, **slurm.env},
    )  # fmt: skip


def slurm_ids(out: str) -> list[str]:
    """The allocation's id, as the launch named it."""
    return [out.split("a job step in SLURM allocation ")[1].split(":")[0]]
