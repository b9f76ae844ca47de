"""The cluster path when things die, from cells of a real Jupyter kernel on the two-node test
cluster (``cluster.py``): the culprit named (a rank SIGKILLed on n2, a dead node, a late error),
jobs that never start, cancels from outside, sbatch's refusals. Verdicts come from what the cell
says and what the queue holds after it; the timeouts only catch hangs."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.kernel import kernel_with
from tests.slurm.test_slurm_notebook import in_allocation

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

CELL = """
from nbaccel import SlurmCluster, notebook_launcher

def steps(seconds=600):
    import os, time, torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("pid", os.getpid(), "on", os.environ["SLURMD_NODENAME"], flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.1)
    dist.destroy_process_group()

def late():
    import os, time
    import torch.distributed as dist
    from nbaccel import Accelerator
    accelerator = Accelerator(cpu=True)
    accelerator.end_training()
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails after end_training()")
    return "rank 0 returned"

def exits():
    import os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    if os.environ["RANK"] == "1":
        sys.exit(3)

def unpicklable():
    import threading
    return threading.Lock()

cluster = SlurmCluster(time=10, folder="jobs")
"""


@pytest.fixture(scope="module")
def kernel(slurm, tmp_path_factory):  # slurm first: the kernel inherits SLURM_CONF
    with kernel_with(str(tmp_path_factory.mktemp("kernel")), CELL) as kernel:
        yield kernel


def pid_on(out: str, node: str) -> int:
    return int(re.search(rf"pid (\d+) on {node}", out).group(1))


def test_a_rank_sigkilled_on_the_second_node_is_named_killed(kernel, empty_queue):
    msg_id = kernel.start("notebook_launcher(steps, num_nodes=2, cluster=cluster, timeout=300)")
    seen = kernel.wait_for_output("[rank 1] pid", "[rank 0] pid", timeout=240)
    os.kill(pid_on(seen, "n2"), signal.SIGKILL)  # what the OOM killer does; this launch's rank
    out = kernel.finish(msg_id, timeout=120)
    assert out.error is not None and out.error["ename"] == "LaunchError", out.error
    said = out.error["evalue"]
    assert said.startswith("rank 1 (pid ") and "on node n2 was killed by SIGKILL" in said, said
    assert "out of memory?" in said  # the hint, and rank 0's lost connection only after it
    assert "Other ranks:" in said and "rank 0" in said.split("Other ranks:")[1]


def test_a_dead_node_ends_the_cell_and_is_named(kernel, empty_queue):
    msg_id = kernel.start("notebook_launcher(steps, num_nodes=2, cluster=cluster, timeout=400)")
    kernel.wait_for_output("[rank 1] pid", "[rank 0] pid", timeout=240)
    empty_queue.kill_node("n2")  # its slurmd, its step's slurmstepd and its ranks: a power cut
    try:
        out = kernel.finish(msg_id, timeout=200)
    finally:
        empty_queue.revive("n2")
    said = out.error["evalue"]
    assert said.startswith("rank 1 on node n2 went silent with its node"), said
    assert "nothing was heard from n2 for" in said
    assert "Other ranks:" in said and "rank 0" in said.split("Other ranks:")[1]
    assert "SLURM job" in said  # what the queue showed after the stop, said truly


def test_the_stop_button_on_a_dead_node_ends_the_cell_and_says_what_the_queue_shows(
    kernel, empty_queue
):
    msg_id = kernel.start("notebook_launcher(steps, num_nodes=2, cluster=cluster)")
    kernel.wait_for_output("[rank 1] pid", "[rank 0] pid", timeout=240)
    empty_queue.kill_node("n2")
    try:
        kernel.manager.interrupt_kernel()  # Jupyter's stop button, before SLURM knows
        out = kernel.finish(msg_id, timeout=120)
        queue = empty_queue.queue()
    finally:
        empty_queue.revive("n2")
    assert out.error["ename"] == "KeyboardInterrupt", out.error
    said = out.stderr.split("nbaccel: interrupted; ")[1]
    if said.startswith("SLURM job") and " was cancelled." in said.splitlines()[0]:
        assert queue == []  # said gone: it was (a job never comes back to the queue)
    else:  # still there: said so, with the node that does not answer
        assert "was cancelled, and the queue still shows it" in said, said
        assert "once n2 answers again or is marked down" in said, said


def test_an_error_after_end_training_is_named_and_the_job_stopped(kernel, empty_queue):
    out = kernel.run("notebook_launcher(late, num_nodes=2, cluster=cluster, timeout=300)", 360)
    said = out.error["evalue"]
    assert said.startswith("rank 1 (pid ") and "on node n2 raised ValueError" in said, said
    assert "rank 1 fails after end_training()" in said
    # rank 0's agent waited in torch's exit barrier: the launch stopped the job, and says what
    # the queue showed after (gone, or still completing: SLURM's KillWait, up to a minute)
    assert "was cancelled." in said or "was cancelled, and the queue still shows it" in said


def test_sys_exit_3_is_said_with_its_code(kernel, empty_queue):
    out = kernel.run("notebook_launcher(exits, num_nodes=2, cluster=cluster, timeout=300)", 360)
    said = out.error["evalue"]
    assert said.startswith("rank 1 (pid ") and "on node n2 exited with code 3" in said, said
    assert "code None" not in said


def test_an_unpicklable_value_gets_the_hint(kernel, empty_queue):
    out = kernel.run("notebook_launcher(unpicklable, num_nodes=1, cluster=cluster)", 300)
    said = out.error["evalue"]
    assert "raised TypeError: the function returned a " in said, said
    assert "that cannot be sent back to the notebook" in said
    assert "return" in said.split("cannot be sent back")[1]  # what to return instead


def test_a_job_that_can_never_start_is_refused_before_it_is_submitted(kernel, empty_queue):
    out = kernel.run("notebook_launcher(steps, num_nodes=3, cluster=cluster)", 120)
    assert out.error["ename"] == "NbaccelError", out.error
    assert "2 nodes" in out.error["evalue"] and "num_nodes=3" in out.error["evalue"]
    assert empty_queue.queue() == []


def test_a_pending_reason_that_never_resolves_cancels_at_once(slurm, empty_queue, tmp_path,
                                                             monkeypatch):  # fmt: skip
    """Past the check (which a cluster may not allow to read its limits), SLURM's own reason:
    the job pends with PartitionConfig (22.05; PartitionNodeLimit elsewhere), and the launch
    cancels it with that reason."""
    from nbaccel import LaunchError, SlurmCluster, notebook_launcher
    from nbaccel.launch.slurm import job

    monkeypatch.setattr(job, "check_slurm", lambda *args: None)
    never = r"can never start: it is pending \((PartitionConfig|PartitionNodeLimit)\)"
    with pytest.raises(LaunchError, match=never):
        notebook_launcher(sorted, args=([1],), num_nodes=3, cluster=SlurmCluster(folder=tmp_path))
    assert slurm.queue() == []


def hold_both_nodes(slurm) -> str:
    """A job of another user's kind that takes every CPU of both nodes, so the next waits."""
    done = slurm.run(
        "sbatch", "--parsable", "-N2", "-c2", "--time=10", "-o", "/dev/null", "--wrap", "sleep 600"
    )
    return done.stdout.strip().split(";")[0]


def test_an_outside_scancel_is_said_as_a_cancellation(kernel, empty_queue):
    blocker = hold_both_nodes(empty_queue)
    try:
        msg_id = kernel.start("notebook_launcher(steps, num_nodes=2, cluster=cluster)")
        kernel.wait_for_output(": pending (", timeout=120)
        ours = [j for j in empty_queue.queue() if j != blocker]
        empty_queue.run("scancel", *ours)
        out = kernel.finish(msg_id, timeout=120)
    finally:
        empty_queue.run("scancel", blocker)
    said = out.error["evalue"]
    assert "was cancelled from outside this launch" in said and "before it started" in said, said
    assert "cannot see that folder" not in said

    blocker = hold_both_nodes(empty_queue)  # a timeout while it waits says it never ran
    try:
        out = kernel.run("notebook_launcher(steps, num_nodes=2, cluster=cluster, timeout=5)", 120)
    finally:
        empty_queue.run("scancel", blocker)
    said = out.error["evalue"]
    assert "did not start within timeout=5 s and was cancelled: it waited in the queue (" in said
    assert said.endswith("and never ran"), said

    msg_id = kernel.start("notebook_launcher(steps, num_nodes=2, cluster=cluster, timeout=300)")
    kernel.wait_for_output("[rank 1] pid", "[rank 0] pid", timeout=240)
    empty_queue.run("scancel", *empty_queue.queue())
    out = kernel.finish(msg_id, timeout=120)
    said = out.error["evalue"]
    assert "was cancelled from outside this launch" in said and "while it ran on n" in said, said
    assert "SignalException" not in said and "Traceback" not in said


def test_sbatch_refusals_are_one_sentence_and_leave_nothing(kernel, empty_queue, tmp_path):
    cell = (
        f"bad = SlurmCluster(time=10, folder={str(tmp_path)!r}, constraint='no-such-feature')\n"
        "notebook_launcher(steps, num_nodes=2, cluster=bad)"
    )
    out = kernel.run(cell, 120)
    assert out.error["ename"] == "NbaccelError", out.error
    said = out.error["evalue"]
    assert said.startswith("sbatch refused the job: Invalid feature specification"), said
    assert "change constraint" in said
    assert list(tmp_path.iterdir()) == []  # neither the pickled call nor the batch script


def test_a_launch_leaves_no_submission_links_or_stacks_folders(kernel, empty_queue, tmp_path):
    import tempfile

    old = Path(tempfile.gettempdir()) / "nbaccel-node-stacks-999999.0-leftover"
    old.mkdir(exist_ok=True)  # as a SIGKILLed step of a job long gone leaves it
    cluster = f"SlurmCluster(folder={str(tmp_path)!r})"
    cell = f"notebook_launcher(sorted, args=([2, 1],), num_nodes=2, cluster={cluster})"
    assert kernel.run(cell, 300).value == "[1, 2]"
    assert not old.exists()
    assert list(tmp_path.glob(".submission_file_*")) == []
    assert list(Path(tempfile.gettempdir()).glob("nbaccel-node-stacks-*")) == []


def test_a_kernel_in_a_one_node_job_launches_a_new_job_for_two_nodes(slurm, empty_queue,
                                                                     tmp_path):  # fmt: skip
    """A kernel that runs as a one-node SLURM job (a JupyterHub SLURM spawner's) asks for two
    nodes: the launch is a job of its own, said in one line, not a step that cannot fit."""
    call = "notebook_launcher(sorted, args=([2, 1],), num_nodes=2, cluster=cluster)"
    done = in_allocation(slurm, 1, tmp_path, CELL, call)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "value: [1, 2] error: None" in done.stdout, done.stdout
    assert "needs more, so the launch is a new job" in done.stdout
