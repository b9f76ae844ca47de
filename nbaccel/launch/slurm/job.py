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
by ``scontrol show job`` (TIMEOUT, CANCELLED, OUT_OF_MEMORY, NODE_FAIL).

The job folder is the channel: ``folder/<job id>-<launch tag>`` (a job ID can recur; the tag
does not), created readable by the user alone (0700), holds the batch script, the pickled call,
each task's log and result, and each failed rank's error. Nothing listens on the network for
the notebook; torch's rendezvous between the nodes is the only traffic, as under torchrun. What
the job writes there while it runs is sealed with a secret made for this launch, and the
notebook drops and logs what lacks the seal (``folder.py``).

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
import time
from pathlib import Path
from typing import Any

from ...env import JOB_KEY_VAR
from ...errors import LaunchError, root_cause_report
from .cluster import SlurmCluster, check_slurm
from .folder import JobFolder, stacks_answer, write_sealed

#: How often the launch asks ``squeue`` about the job; SLURM's own tools poll likewise.
POLL_S = 0.5
#: After a rank's error, how long the other ranks get to fail or finish before ``scancel``.
GRACE_S = 10.0
#: Job states in which the job still holds (or waits for) its nodes.
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"}
#: How long the notebook waits for every node's answer to "where are your ranks?" (each node
#: polls the job folder every 0.2 s; a shared filesystem may take a moment more to show it).
ASK_S = 5.0
#: Job states in which SLURM, not the launched function, ended the job.
ENDED_BY_SLURM = {"TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL"}


def _slurm(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else ""


def launch(payload: bytes, environ: dict, nproc: int, num_nodes: int, cluster: SlurmCluster,
           return_all: bool, timeout: float | None, run=None, view=None) -> list[Any]:  # fmt: skip
    """Submit (or, inside an allocation, start a job step), watch, and return every rank's
    value in rank order (or raise)."""
    from .node import run_node

    check_slurm(cluster)
    key = secrets.token_bytes(32)  # this launch's seal; it travels in the 0700 job folder
    environ = {**environ, JOB_KEY_VAR: key.hex()}
    cluster.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    umask = os.umask(0o077)  # the job folder, its pickles and its logs: the user's alone
    try:  # (sbatch and srun pass this umask on to the job's tasks)
        if os.environ.get("SLURM_JOB_ID"):  # this kernel runs inside an allocation
            job, folder, step = _in_allocation(
                run_node, (payload, nproc, environ), num_nodes, cluster
            )
            watch = _Watch(job, folder, key, step, run=run, view=view)
        else:
            template = cluster.job_folder()
            executor = cluster.executor(num_nodes, template)
            job = executor.submit(run_node, payload, nproc, environ, str(template))
            folder = Path(str(template).replace("%j", str(job.job_id)))
            watch = _Watch(job, folder, key, run=run, view=view)
    finally:
        os.umask(umask)
    watch.nodes, watch.world_size = num_nodes, num_nodes * nproc
    try:
        watch.until_done(timeout)
    except KeyboardInterrupt:
        where = watch.where()  # before the ranks are stopped, as a local launch does
        watch.cancel()
        print(f"nbaccel: interrupted; {watch.name} was cancelled.", file=sys.stderr)
        if where is not None:
            print(where, file=sys.stderr)
        raise
    except BaseException:
        watch.cancel()
        raise
    return watch.outcome(return_all, num_nodes * nproc)


def _in_allocation(run_node, args: tuple, num_nodes: int, cluster: SlurmCluster):
    """One job step (``srun``) in the allocation this kernel runs in, no new ``sbatch``:
    submitit's own task runner reads the call from a folder of this launch alone (submitit has
    no call for steps)."""
    import tempfile

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


def _cancel(job_id: str) -> None:
    """scancel, then wait until the job has left the queue (nothing stays behind)."""
    subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=60)
    deadline = time.monotonic() + 120
    while _state(job_id)[0] in ACTIVE and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _state(job_id: str) -> tuple[str, str, str]:
    """(state, reason, nodes) from squeue; ("GONE", "", "") once the job left the queue."""
    shown = _slurm("squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N").strip()
    if not shown:
        return "GONE", "", ""
    state, reason, nodes = [*shown.splitlines()[0].split("|"), "", ""][:3]
    return state, reason, nodes


class _Watch:
    """One job (or job step) from the queue to its end: its state shown, its output relayed,
    its errors read, its values back."""

    def __init__(self, job, folder: Path, key: bytes, step=None, run=None, view=None) -> None:
        self.job, self.folder, self.key, self.step = job, folder, key, step
        self.run, self.view = run, view
        self.name = (
            f"a job step in SLURM allocation {job.job_id}" if step else f"SLURM job {job.job_id}"
        )
        self.shown_state = None
        self.files = JobFolder(folder, key, self.name)
        self.first_error_at: float | None = None
        self.ran = False  # the job reached RUNNING: its ranks can be asked where they are
        self.nodes = self.world_size = 1  # set by launch()

    def _status(self) -> tuple[str, str, str]:
        if self.step is None:
            return _state(self.job.job_id)
        nodes = os.environ.get("SLURM_JOB_NODELIST", "")
        return ("RUNNING", "", nodes) if self.step.poll() is None else ("GONE", "", "")

    def cancel(self) -> None:
        """Stop the job (scancel) or the step (srun forwards SIGTERM to its tasks)."""
        if self.step is None:
            _cancel(self.job.job_id)
            return
        if self.step.poll() is None:
            self.step.terminate()
            try:
                self.step.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.step.kill()
                self.step.wait()

    def until_done(self, timeout: float | None) -> None:
        started = time.monotonic()
        while True:
            state, reason, nodes = self._status()
            self.ran = self.ran or state == "RUNNING"
            self._show_state(state, reason, nodes)
            self.files.relay(self.run, self.view)
            if state == "GONE" or state not in ACTIVE:
                break
            if self.first_error_at is None and self.files.failures():
                self.first_error_at = time.monotonic()
            if self.first_error_at and time.monotonic() - self.first_error_at > GRACE_S:
                self.cancel()  # the others stayed blocked on the failed rank
            if timeout is not None and time.monotonic() - started > timeout:
                where = self.where()
                self.cancel()
                self.files.relay(self.run, self.view)
                said = f"{self.name} did not finish within timeout={timeout:g} s and was cancelled"
                said += f". {where}" if where is not None else ""
                stacks = where.stacks if where is not None else {}
                raise LaunchError(f"{said}\n\nIts logs: {self.folder}", run=self.run, stacks=stacks)
            time.sleep(POLL_S)
        # The loop ends only once the job left ACTIVE (COMPLETING included: its nodes are let
        # go) or the step's srun exited, so nothing of it stays behind when the cell returns.
        self.files.relay(self.run, self.view)

    def where(self):
        """Where every rank is (``hang.Report``), asked through the job folder: each node asks
        its own ranks at their sockets (``node.py``). None before the job ran."""
        if not self.ran:
            return None
        import uuid

        from ...observe.hang import report
        from ...observe.stacks import RankStack

        request = uuid.uuid4().hex[:12]
        write_sealed(self.folder / "stacks.request", self.key, request)
        answers = [stacks_answer(self.folder, request, n) for n in range(self.nodes)]
        deadline = time.monotonic() + ASK_S
        while not all(p.exists() for p in answers) and time.monotonic() < deadline:
            time.sleep(0.1)
        stacks = {
            rank: None if text is None else RankStack.from_json(text.encode())
            for rank, text in self.files.answers(answers).items()
        }
        return report(stacks, list(range(self.world_size)), [], self.run)

    def _show_state(self, state: str, reason: str, nodes: str) -> None:
        if state == "PENDING":
            why = reason if reason and reason != "None" else "queued"
            line = f"{self.name}: pending ({why})"
        elif state == "RUNNING":
            line = f"{self.name}: running on {nodes}"
        else:
            return
        if line != self.shown_state:
            print(line, file=sys.stderr, flush=True)
            self.shown_state = line

    def outcome(self, return_all: bool, world_size: int) -> list[Any]:
        from types import SimpleNamespace

        from ..child_failed import LaunchError  # also torch's ChildFailedError
        from ..results import collect

        run = self.run
        failures = self.files.failures()
        tasks = [self.job.task(i) for i in range(self.job.num_tasks)]
        missing = [t for t in tasks if not t.paths.result_pickle.exists()]
        if failures:
            if run is not None:
                run.failures = failures
            report = root_cause_report(failures, set(), [])
            raise LaunchError(f"{report}\n\nThe job's logs: {self.folder}", failures, run)
        state, fields = self._final_state()
        if missing or state in ENDED_BY_SLURM:
            raise LaunchError(self._ended_by_slurm(state, fields, bool(missing)), run=run)
        values: dict[int, tuple] = {}
        for i, task in enumerate(tasks):
            try:
                values.update(task.result())
            except Exception as exc:  # the node's own task failed, outside the function
                raise LaunchError(
                    f"{self.name}: node task {i} failed before or after its ranks ran "
                    f"({state}):\n{exc}",
                    run=run,
                ) from None
        if len(values) != world_size:
            raise LaunchError(
                f"{self.name} returned {len(values)} of {world_size} ranks' values; see "
                f"{self.folder}",
                run=run,
            )
        ranks = [
            SimpleNamespace(rank=r, pid=values[r][0], result=values[r][1]) for r in sorted(values)
        ]
        return collect(ranks, return_all, run if run is not None else SimpleNamespace())

    def _final_state(self) -> tuple[str, dict]:
        shown = _slurm("scontrol", "show", "job", str(self.job.job_id), "-o")
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        return fields.get("JobState", "UNKNOWN"), fields

    def _ended_by_slurm(self, state: str, fields: dict, missing: bool) -> str:
        job, limit = self.job.job_id, fields.get("TimeLimit", "?")
        if missing and not list(self.folder.glob("*_log.out")):
            return (
                f"SLURM job {job} ended ({state}) without writing to {self.folder}: the nodes "
                "cannot see that folder; give SlurmCluster(folder=...) a folder on a filesystem "
                "every node mounts (your home or the cluster's scratch)"
            )
        if state == "TIMEOUT":
            return (
                f"SLURM stopped job {job} at its time limit ({limit}): give SlurmCluster("
                f"time=...) more minutes; its logs: {self.folder}"
            )
        if state == "OUT_OF_MEMORY":
            return (
                f"SLURM killed job {job} for using more memory than it asked for: ask for more "
                f"with SlurmCluster(mem='32G'); its logs: {self.folder}"
            )
        return (
            f"SLURM job {job} ended ({state}, {fields.get('Reason', '')}) before every node "
            f"returned; its logs: {self.folder}"
        )
