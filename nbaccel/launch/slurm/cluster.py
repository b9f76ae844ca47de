"""``SlurmCluster``: where and how a launch goes to SLURM, and the checks made before it does.

The options are ``sbatch``'s; submitit turns them into the batch script (``executor``), which
``batch_script`` shows before anything is submitted. ``job.py`` submits and watches.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ...config import load_config
from ...errors import NbaccelError


class SlurmCluster:
    """Where and how ``notebook_launcher`` submits to SLURM (``sbatch``'s options).

    Args:
        partition: SLURM's partition (``sinfo -s`` lists them); default: ``nbaccel config
            --slurm-partition``'s, else the cluster's.
        time: the job's time limit, in minutes (int) or as SLURM writes it ("1:30:00");
            default: ``nbaccel config --slurm-time``'s, else 60 minutes.
        account: the account to charge, where the cluster asks for one; default: ``nbaccel
            config --slurm-account``'s.
        gpus_per_node: GPUs on each node (``--gpus-per-node``); one process per GPU is usual.
        cpus_per_task: CPUs for each node's task, which runs all of that node's processes.
        folder: where job folders go (``folder/<job id>-<launch tag>``: a job ID can recur, on
            a cluster whose state was reset, and a folder must never hold an older job's files);
            every node must see it (a shared filesystem: your home or the cluster's scratch, not
            /tmp).
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
        **options: Any,
    ) -> None:
        saved = load_config()  # `nbaccel config --slurm-partition ...`: where arguments say none
        partition = partition if partition is not None else saved.slurm_partition
        account = account if account is not None else saved.slurm_account
        time = time if time is not None else saved.slurm_time or 60
        if not (isinstance(time, str) and time) and not (isinstance(time, int) and time > 0):
            raise NbaccelError(
                f"SlurmCluster(time={time!r}): give minutes (an int > 0) or SLURM's form, "
                "e.g. time=30 or time='1:30:00'"
            )
        if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 0):
            raise NbaccelError(f"SlurmCluster(gpus_per_node={gpus_per_node!r}): give an int >= 0")
        self.partition, self.time, self.account = partition, time, account
        self.gpus_per_node, self.cpus_per_task = gpus_per_node, cpus_per_task
        self.folder = Path(folder).expanduser().absolute()
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


def check_slurm(cluster: SlurmCluster) -> None:
    """Refuse what SLURM would refuse, in one sentence that names the fix."""
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


def _output(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else ""
