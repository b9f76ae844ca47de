"""``SlurmCluster``: where and how a launch goes to SLURM, and the checks made before it does.

The options are ``sbatch``'s; submitit turns them into the batch script (``executor``), which
``batch_script`` shows before anything is submitted. ``job.py`` submits and watches. Before
submitting, ``check_slurm`` finds SLURM and holds the request against the partition's limits
(``limits.py``): what can never start is refused, in one sentence that names the fix.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ...config import load_config
from ...errors import NbaccelError
from .limits import TIME_FORMS, check_request, minutes, read_nodes, read_partition
from .queue import slurm as _output

#: Folders that are each machine's own on most clusters (a local disk, or memory).
LOCAL_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")


class SlurmCluster:
    """Where and how ``notebook_launcher`` submits to SLURM (``sbatch``'s options).

    Args:
        partition: SLURM's partition (``sinfo -s`` lists them); default: ``nbaccel config
            --slurm-partition``'s, else the cluster's.
        time: the job's time limit, in minutes (int) or in one of SLURM's forms ("1:30:00",
            "2-00:00:00", "UNLIMITED"); default: ``nbaccel config --slurm-time``'s, else 60.
        account: the account to charge, where the cluster asks for one; default: ``nbaccel
            config --slurm-account``'s.
        gpus_per_node: GPUs on each node (``--gpus-per-node``); one process per GPU is usual.
        cpus_per_task: CPUs for each node's task, which runs all of that node's processes.
        folder: where job folders go (``folder/<job id>-<launch tag>``: a job ID can recur, on
            a cluster whose state was reset, and a folder must never hold an older job's files);
            every node must see it (a shared filesystem: your home or the cluster's scratch, not
            /tmp).
        new_job: for a kernel that itself runs inside a SLURM job (under ``salloc``, or
            started by a SLURM spawner): None (the default) launches a step of that job when
            its nodes suffice, else a new job, said in one line; True always a new job
            (``sbatch``); False always a step (refused when the job has too few nodes).
        **options: any other ``sbatch`` option, named as on its command line without the dashes
            (``mem="16G"``, ``constraint="a100"``, ``qos="high"``).
    """

    def __init__(
        self,
        partition: str | None = None,
        time: int | str | None = None,
        account: str | None = None,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        folder: str | os.PathLike = "nbaccel-jobs",
        new_job: bool | None = None,
        **options: Any,
    ) -> None:
        saved = load_config()  # `nbaccel config --slurm-partition ...`: where arguments say none
        partition = partition if partition is not None else saved.slurm_partition
        account = account if account is not None else saved.slurm_account
        time = time if time is not None else saved.slurm_time or 60
        try:
            limit = minutes(time)
        except ValueError:
            limit = 0.0
        if limit == 0:  # SLURM reads 0 as no limit; UNLIMITED says that on purpose
            raise NbaccelError(
                f"SlurmCluster(time={time!r}) is not a SLURM time limit: give minutes as an int "
                f"> 0 (time=30) or a string in one of SLURM's forms: {TIME_FORMS}"
            )
        if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 0):
            raise NbaccelError(f"SlurmCluster(gpus_per_node={gpus_per_node!r}): give an int >= 0")
        self.partition, self.time, self.account = partition, time, account
        self.gpus_per_node, self.cpus_per_task = gpus_per_node, cpus_per_task
        if new_job not in (None, True, False):
            raise NbaccelError(f"SlurmCluster(new_job={new_job!r}): give None, True or False")
        self.folder, self.new_job = Path(folder).expanduser().absolute(), new_job
        self.options = {k.replace("_", "-"): v for k, v in options.items()}

    def __repr__(self) -> str:
        shown = {k: v for k, v in vars(self).items() if v not in (None, {})}
        return "SlurmCluster(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def executor(self, num_nodes: int, folder: Path):
        """submitit's executor for this cluster: one task per node."""
        import submitit

        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
        parameters = {"nodes": num_nodes, "ntasks_per_node": 1, "job_name": "nbaccel"}
        parameters |= {"time": self.time, "signal_delay_s": 0, "stderr_to_stdout": True}
        optional = {"partition": self.partition, "account": self.account}
        optional |= {"gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task}
        parameters |= {k: v for k, v in optional.items() if v is not None}
        if self.options:
            parameters["additional_parameters"] = dict(self.options)
        executor.update_parameters(**parameters)
        return executor

    def job_folder(self) -> Path:
        """A new launch's job folder, as a template for submitit and ``sbatch``: ``%j`` (the
        job ID, which SLURM may hand out again) and a tag of this launch alone."""
        return self.folder / f"%j-{secrets.token_hex(4)}"

    def batch_script(self, num_nodes: int = 1) -> str:
        """The batch script ``sbatch`` gets, to read before anything is submitted."""
        executor = self.executor(num_nodes, self.job_folder())
        return executor._make_submission_file_text(executor._submitit_command_str, "preview")


def folder_warning(cluster: SlurmCluster, num_nodes: int) -> str | None:
    """A sentence for a job folder on a machine's own disk (/tmp and the like), which the
    job's nodes other than this one cannot see on most clusters; None for any other folder.
    A warning, not a refusal: where the nodes do share it (a one-machine cluster, as the tests
    start), the launch works."""
    folder = cluster.folder
    real = Path(os.path.realpath(folder))
    for root in dict.fromkeys((*LOCAL_ROOTS, tempfile.gettempdir())):
        if folder.is_relative_to(root) or real.is_relative_to(os.path.realpath(root)):
            nodes = "node" if num_nodes == 1 else f"{num_nodes} nodes"
            return (
                f"the job folder {folder} is under {root}, which on most clusters is each "
                f"machine's own, so the job's {nodes} may not see it: give SlurmCluster("
                "folder=...) a folder on your home or the cluster's scratch, e.g. "
                "SlurmCluster(folder='~/nbaccel-jobs')"
            )
    return None


def check_slurm(cluster: SlurmCluster, num_nodes: int = 1) -> None:
    """Refuse what SLURM would refuse, or queue forever, in one sentence that names the fix."""
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        raise NbaccelError(
            "no SLURM commands on PATH (sbatch, squeue): run the notebook on the cluster's login "
            "node or inside an allocation, or load SLURM first (often `module load slurm`)"
        )
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise NbaccelError(
            "the cluster path needs submitit: %pip install 'nbaccel[slurm]'"
        ) from None
    if cluster.partition is not None:
        known = _output("sinfo", "-h", "-o", "%R").split()
        if cluster.partition not in known:
            raise NbaccelError(
                f"SLURM has no partition {cluster.partition!r}; this cluster's: "
                f"{', '.join(sorted(set(known))) or 'none'} (`sinfo -s` lists them)"
            )
    name = cluster.partition or default_partition(_output("sinfo", "-h", "-o", "%P"))
    if name is None:
        return
    partition = read_partition(_output("scontrol", "show", "partition", name, "-o"))
    nodes = read_nodes(_output("sinfo", "-h", "-N", "-p", name, "-o", "%N|%c|%m|%G"))
    check_request(cluster, num_nodes, partition, nodes)


def default_partition(sinfo: str) -> str | None:
    """SLURM's default partition from ``sinfo -h -o "%P"`` (marked with a trailing '*')."""
    for line in sinfo.split():
        if line.endswith("*") and len(line) > 1:
            return line[:-1]
    return None
