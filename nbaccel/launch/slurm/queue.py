"""What SLURM says about a job and its nodes, and how a launch stops its job.

The launch asks SLURM's own commands (``squeue``, ``sinfo``, ``scontrol``, ``scancel``), as a
person at the login node would: no accounting daemon is needed (``sacct`` is not used), and
nothing here keeps state. The words for what SLURM reports (a job that can never start, a
refusal by ``sbatch``) live here too, so the watch (``watch.py``) and the submission
(``job.py``) say them alike.
"""

from __future__ import annotations

import subprocess
import time

#: Job states in which the job still holds (or waits for) its nodes.
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"}
#: Job states in which SLURM, not the launched function, ended the job.
ENDED_BY_SLURM = {"TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL"}
#: How often the launch asks ``squeue`` about the job; SLURM's own tools poll likewise.
POLL_S = 0.5
#: A stop: how long the job's processes get after SIGTERM before SIGKILL (torch's agent does
#: not see a SIGTERM while it waits in its exit barrier), then how long the queue is watched
#: for the job to leave before the cell says what SLURM still shows.
TERM_S, GONE_S = 2.0, 5.0

#: Pending reasons that no wait resolves, with what the job asked that the partition cannot
#: give and the option to change (SLURM's ``squeue --help``/``man squeue`` "JOB REASON CODES").
NEVER_STARTS = {
    "PartitionNodeLimit": "more nodes than its partition has or allows (num_nodes=...)",
    "PartitionTimeLimit": "a time limit above its partition's MaxTime (SlurmCluster(time=...))",
    "PartitionConfig": "more than its partition's nodes can give: nodes (num_nodes=...), or "
    "CPUs, memory or GPUs per node (SlurmCluster(cpus_per_task=..., mem=..., gpus_per_node=...))",
    "BadConstraints": "features no node of its partition has (SlurmCluster(constraint=...))",
    "InvalidAccount": "an account it may not use (SlurmCluster(account=...))",
    "InvalidQOS": "a QOS it may not use (SlurmCluster(qos=...))",
    "QOSMaxNodePerJobLimit": "more nodes than its QOS allows a job (num_nodes=...)",
    "QOSMaxWallDurationPerJobLimit": "a time limit above its QOS's (SlurmCluster(time=...))",
}

#: Words in ``sbatch``'s refusals, and the option each one names.
REFUSALS = (
    ("memory specification", "mem"),
    ("time limit", "time"),
    ("account", "account"),  # before "partition": "account/partition combination"
    ("partition", "partition"),
    ("qos", "qos"),
    ("feature", "constraint"),
    ("gres", "gpus_per_node"),
    ("node count", "num_nodes"),
    ("node configuration is not available", "cpus_per_task, mem or gpus_per_node"),
)


def slurm(*command: str) -> str:
    """A SLURM command's output; "" when it failed (a refusal, or SLURM busy)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def state(job_id: str) -> tuple[str, str, str]:
    """(state, reason, nodes) from squeue; ("GONE", "", "") once the job left the queue."""
    shown = slurm("squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N").strip()
    if not shown:
        return "GONE", "", ""
    job_state, reason, nodes = [*shown.splitlines()[0].split("|"), "", ""][:3]
    return job_state, reason, nodes


def final(job_id: str) -> dict:
    """``scontrol show job``'s fields (JobState, Reason, NodeList, ...), while SLURM keeps the
    ended job (``MinJobAge``, 300 s by default); {} after that."""
    shown = slurm("scontrol", "show", "job", str(job_id), "-o")
    return dict(f.split("=", 1) for f in shown.split() if "=" in f)


def hostnames(nodes: str) -> list[str]:
    """``n[1-2]`` as ["n1", "n2"], in SLURM's node order."""
    return slurm("scontrol", "show", "hostnames", nodes).split() if nodes else []


def unreachable(nodes: str) -> dict[str, str]:
    """{node: SLURM's state} for those of ``nodes`` that SLURM cannot reach: not responding
    (sinfo's ``*``) or down."""
    shown = slurm("sinfo", "-h", "-N", "-n", nodes, "-o", "%N|%t") if nodes else ""
    found = {}
    for line in shown.splitlines():
        name, _, node_state = line.partition("|")
        if node_state.endswith("*") or node_state.startswith(("down", "fail")):
            found[name] = "not responding" if node_state.endswith("*") else node_state
    return found


def cancel(job_id: str, patient: bool = True) -> tuple[str, str]:
    """Stop the job and return (state, nodes) as the queue shows it after: ("GONE", "") once
    it left. A running job's processes get SIGTERM, then SIGKILL after ``TERM_S``: a job
    whose processes all died leaves the queue at once, where a plain ``scancel`` would wait
    SLURM's KillWait for one that ignores SIGTERM (torch's agent in its exit barrier). Then the
    job is cancelled, and the queue watched for ``GONE_S`` (not when ``patient`` is False: a
    node that does not answer keeps the job COMPLETING however long one waits)."""
    if state(job_id)[0] in ("RUNNING", "SUSPENDED"):
        scancel(job_id, "--signal=TERM")
        if _wait(job_id, TERM_S if patient else 0)[0] in ACTIVE:
            scancel(job_id, "--signal=KILL", "--full")  # the batch step too: its srun waits
            _wait(job_id, TERM_S if patient else 0)
    scancel(job_id)
    now, _, nodes = _wait(job_id, GONE_S if patient else 0.5)
    return now, nodes


def scancel(job_id: str, *options: str) -> None:
    try:
        subprocess.run(["scancel", *options, str(job_id)], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _wait(job_id: str, seconds: float) -> tuple[str, str, str]:
    deadline = time.monotonic() + seconds
    while (shown := state(job_id))[0] in ACTIVE and time.monotonic() < deadline:
        time.sleep(0.25)
    return shown


def still_queued(job_id: str, job_state: str, nodes: str, silent: list[str]) -> str:
    """One sentence on a cancelled job that the queue still shows, with what the user can do
    (``silent``: the job's nodes that were not heard from)."""
    dead = sorted(set(silent) | set(unreachable(nodes)))
    shows = f"SLURM job {job_id} was cancelled, and the queue still shows it {job_state}"
    if dead:
        names = ",".join(dead)
        return (
            f"{shows} on {nodes}: SLURM lets the job go once {names} answers again or is marked "
            f"down (by SLURM after its SlurmdTimeout, or now by an administrator: `scontrol "
            f"update nodename={names} state=down reason=...`); `squeue -j {job_id}` shows it"
        )
    return (
        f"{shows} on {nodes or 'no node'}: SLURM is stopping its processes (up to its "
        f"KillWait); `squeue -j {job_id}` shows when it is gone"
    )


def never_starts(job_id: str, reason: str) -> str:
    """The cell's words for a job that waited for a reason no wait resolves."""
    return (
        f"SLURM job {job_id} can never start: it is pending ({reason}), for it asks for "
        f"{NEVER_STARTS[reason]}; it was cancelled. `sinfo -p <partition> -N -l` shows what "
        "the partition's nodes have"
    )


def refusal(text: str) -> str:
    """sbatch's refusal in one sentence, with the option to change."""
    lines = [line for line in text.splitlines() if "error" in line.lower()]
    said = (lines[-1] if lines else text.strip()).split("error:", 1)[-1].strip()
    said = said.removeprefix("Batch job submission failed:").strip() or "no reason given"
    option = next((o for words, o in REFUSALS if words in said.lower()), None)
    fix = (
        f"change {option} (SlurmCluster(...) or notebook_launcher's)"
        if option
        else "change the SlurmCluster option it names"
    )
    return f"sbatch refused the job: {said}; {fix}. Nothing was submitted."
