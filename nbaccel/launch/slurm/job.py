"""The cluster path: ``notebook_launcher(..., num_nodes=N, cluster=SlurmCluster(...))``.

Existing engines do the work. submitit writes the batch script, submits the pickled call with
``sbatch`` and brings each task's value back through the job folder; SLURM allocates the nodes
and starts one task per node with ``srun``; on each node torch's elastic agent (torchrun's
engine) meets the other nodes' agents, with SLURM's node order as node ranks, and starts,
watches and stops that node's processes (``node.py``). nbaccel keeps the cell's contract: rank
0's value back (every rank's with ``return_all``), one ``LaunchError`` naming the failing rank
and its node with that rank's own traceback, every rank's output with its rank prefix, the
job's state and SLURM's reason while it waits in the queue, and the stop button (``scancel``;
the kernel lives on).

How ranks start, the choice: one elastic agent per node rather than one SLURM task per rank.
The agent is the engine that supervises a node's workers everywhere else in torch (torchrun,
``nbaccel launch``): it stops a node's other workers when one fails, and it starts the same on
a GPU node (one process per GPU) as on a CPU node. One task per rank would hand each rank to
``srun`` alone and leave the stopping of the others to SLURM's task kill. The cost is one more
process per node (the agent), which imports torch once while SLURM starts the job.

When the job ends: submitit learns a job's end from ``sacct``, which needs SLURM's accounting
daemon that many small clusters (and this project's test cluster) do not run. So the launch
watches the job through ``squeue`` (pending, running, its reason) and, once the job has left
the queue, reads each task's result from the job folder; a task without a result is explained
by ``scontrol show job`` (TIMEOUT, CANCELLED, OUT_OF_MEMORY, NODE_FAIL). The watch itself, and
how it tells the culprit from the consequences and a dead node from a busy one, is
``watch.py``; what SLURM's commands say, and the stop, ``queue.py``.

The job folder is the only link between notebook and nodes: ``folder/<job id>-<launch tag>`` (a job
ID can recur; the tag does not), created readable by the user alone (0700), holds the batch script,
the pickled call, each task's log and result, and each failed rank's error. Nothing listens on the
network for the notebook; torch's rendezvous between the nodes is the only traffic, as under
torchrun. What the job writes there while it runs is sealed with a secret made for this launch, and
the notebook drops and logs what lacks the seal (``folder.py``).

Clocks: the records carry each node's ``time.time()``, and rates and the run's timing compare
them across nodes, as SLURM itself assumes synchronized clocks (NTP, chrony). A node whose
records come from the notebook's future is a clock that is off, and the cell says so, since the
cross-node times are off by as much.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...env import JOB_KEY_VAR
from ...errors import NbaccelError
from . import queue
from .cluster import SlurmCluster, check_slurm, folder_warning
from .watch import Watch


def launch(
    payload: bytes,
    environ: dict,
    nproc: int,
    num_nodes: int,
    cluster: SlurmCluster,
    return_all: bool,
    timeout: float | None,
    run=None,
    view=None,
) -> list[Any]:
    """Submit (or, inside an allocation, start a job step), watch, and return every rank's
    value in rank order (or raise)."""
    from .node import run_node

    check_slurm(cluster, num_nodes)
    if warning := folder_warning(cluster, num_nodes):
        print(f"nbaccel: {warning}", file=sys.stderr, flush=True)
    key = secrets.token_bytes(32)  # this launch's seal; it travels in the 0700 job folder
    environ = {**environ, JOB_KEY_VAR: key.hex()}
    cluster.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    umask = os.umask(0o077)  # the job folder, its pickles and its logs: the user's alone
    try:  # (sbatch and srun pass this umask on to the job's tasks)
        if _as_step(cluster, num_nodes):
            job, folder, step = _in_allocation(
                run_node, (payload, nproc, environ), num_nodes, cluster
            )
        else:
            job, folder, step = _submit(run_node, (payload, nproc, environ), num_nodes, cluster)
    finally:
        os.umask(umask)
    watch = Watch(job, folder, key, step, run=run, view=view, nodes=num_nodes, nproc=nproc)
    try:
        watch.until_done(timeout)
    except KeyboardInterrupt:
        where = watch.where()  # before the ranks are stopped, as a local launch does
        watch.cancel()
        print(f"nbaccel: interrupted; {watch.said_after_stop()}", file=sys.stderr, flush=True)
        if where is not None:
            print(where, file=sys.stderr)
        raise
    except BaseException:
        watch.cancel()
        raise
    return watch.outcome(return_all)


def _as_step(cluster: SlurmCluster, num_nodes: int) -> bool:
    """Inside an allocation (a kernel started under ``salloc`` or as a SLURM job), a launch is
    a job step of it when its nodes suffice, else a new job; ``SlurmCluster(new_job=...)``
    chooses instead."""
    job_id = os.environ.get("SLURM_JOB_ID")
    new_job = cluster.new_job
    if not job_id or new_job:
        return False
    have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    if num_nodes <= have:
        return True
    nodes = f"{have} node{'s' if have > 1 else ''}"
    if new_job is False:
        raise NbaccelError(
            f"this kernel's SLURM allocation {job_id} has {nodes}; num_nodes={num_nodes} cannot "
            "run as a step of it: ask for fewer nodes, or let SlurmCluster(new_job=True) submit "
            "a job of its own"
        )
    print(
        f"nbaccel: this kernel runs inside SLURM job {job_id} ({nodes}); num_nodes={num_nodes} "
        "needs more, so the launch is a new job (SlurmCluster(new_job=False) keeps it a step).",
        file=sys.stderr,
        flush=True,
    )
    return False


def _submit(run_node, args: tuple, num_nodes: int, cluster: SlurmCluster):
    """sbatch, through submitit; a refusal is said in one sentence, and nothing of it stays in
    the folder (submitit's pickled call and batch script, named by uuids, hold the launch's own
    folder name, by which they are found)."""
    from submitit.core.utils import FailedJobError

    template = cluster.job_folder()
    executor = cluster.executor(num_nodes, template)
    try:
        with _outside_allocation():
            job = executor.submit(run_node, *args, str(template))
    except FailedJobError as refused:
        _remove_submission(cluster.folder, str(template))
        raise NbaccelError(queue.refusal(str(refused))) from None
    folder = Path(str(template).replace("%j", str(job.job_id)))
    for link in cluster.folder.glob(".submission_file_*.sh"):  # submitit's, one per submission
        if link.is_symlink() and Path(os.readlink(link)).parent == folder:
            link.unlink(missing_ok=True)
    return job, folder, None


def _remove_submission(folder: Path, template: str) -> None:
    marker = template.encode()
    for path in [*folder.glob("*.pkl"), *folder.glob(".submission_file_*.sh")]:
        try:
            if path.is_file() and not path.is_symlink() and marker in path.read_bytes():
                path.unlink()
        except OSError:
            pass


@contextmanager
def _outside_allocation():
    """sbatch from inside a SLURM job, without that job's ``SLURM_*`` variables: sbatch passes
    the environment on to the new job, where ``srun`` would read the outer job's (its CPUs per
    task, its tasks) as its own options. ``SLURM_CONF`` stays. The environment is the kernel's
    own again when sbatch returns."""
    outer = {k: v for k, v in os.environ.items() if k.startswith("SLURM_") and k != "SLURM_CONF"}
    for name in outer:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(outer)


def _in_allocation(run_node, args: tuple, num_nodes: int, cluster: SlurmCluster):
    """One job step (``srun``) in the allocation this kernel runs in, no new ``sbatch``:
    submitit's own task runner reads the call from a folder of this launch alone (submitit has
    no call for steps)."""
    import submitit

    job_id = os.environ["SLURM_JOB_ID"]
    folder = Path(tempfile.mkdtemp(prefix=f"{job_id}-step-", dir=cluster.folder))
    submission = submitit.core.utils.DelayedSubmission(run_node, *args, str(folder))
    submission.dump(folder / f"{job_id}_submitted.pkl")
    command = ["srun", "--overlap", f"--nodes={num_nodes}", "--ntasks-per-node=1"]
    command += [f"--output={folder}/%j_%t_log.out", sys.executable, "-u"]
    command += ["-m", "submitit.core._submit", str(folder)]
    step = subprocess.Popen(
        command,
        env={**os.environ, "SUBMITIT_EXECUTOR": "slurm"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "srun.err", "wb"),  # noqa: SIM115 (srun's own; the child keeps it)
    )
    job = submitit.SlurmJob(folder=folder, job_id=job_id, tasks=list(range(num_nodes)))
    return job, folder, step
