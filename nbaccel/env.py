"""Where this process stands: its rank, its device, and how it talks to the others.

Everything here is read from the environment that a launcher sets (torchrun's contract:
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; SLURM's ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS`` as a fallback),
so ``torchrun script.py``, ``nbaccel launch`` and ``notebook_launcher`` all reach the same
``DistEnv``. With none of it set, this is one process: rank 0 of 1.

This module imports nothing else from nbaccel, and torch only when a device is chosen.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Every NBACCEL_* variable, in one place.
#: Launch options travel to workers in the environment, so ``Accelerator()`` needs no arguments
#: (``config.LaunchConfig.to_environ`` writes them, ``from_environ`` reads them back).
MIXED_PRECISION_VAR = "NBACCEL_MIXED_PRECISION"
CPU_VAR = "NBACCEL_CPU"  # "1": use the CPU even where GPUs are visible
FSDP_VAR = "NBACCEL_FSDP"  # "1": Accelerator() shards with FSDP2's defaults
DEEPSPEED_VAR = "NBACCEL_DEEPSPEED"  # "0".."3": Accelerator() uses DeepSpeed at that ZeRO stage
CHANNEL_VAR = "NBACCEL_METRICS_FD"  # the worker's end of the channel (``observe/channel.py``)
METRICS_DIR_VAR = "NBACCEL_METRICS_DIR"  # on a cluster: the job folder the channel writes to
JOB_KEY_VAR = (
    "NBACCEL_JOB_KEY"  # on a cluster: the launch's secret (hex) that seals the folder's files
)
PANEL_VAR = "NBACCEL_SAVE_PANEL"  # a path: without a notebook, save the final panel there
CONFIG_VAR = "NBACCEL_CONFIG"  # where the ``nbaccel config`` file is, if not the usual place
BREAKDOWN_VAR = "NBACCEL_BREAKDOWN"  # "0": time nothing (``breakdown.py``); on by default
STACKS_VAR = "NBACCEL_STACKS_DIR"  # a folder: each rank answers stack requests there (stacks.py)
PRESTART_VAR = "NBACCEL_PRESTART"  # "0": a kernel starts no worker server ahead (launch/client.py)
LAUNCH_VAR = "NBACCEL_LAUNCH"  # one id per launch, inherited by all it starts (leftovers.py)

# (rank, local rank, world size, local world size): torchrun's names first, then SLURM's.
_SCHEMES = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as plain data that can cross a process boundary."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read the launcher's variables; with none set, one process (rank 0 of 1)."""
        environ = os.environ if environ is None else environ
        for rank_var, local_var, world_var, local_world_var in _SCHEMES:
            if rank_var in environ and world_var in environ:
                env = cls(
                    rank=_int(environ, rank_var),
                    local_rank=_int(environ, local_var, default=0),
                    world_size=_int(environ, world_var),
                    local_world_size=_int(environ, local_world_var, default=1),
                    master_addr=environ.get("MASTER_ADDR"),
                    master_port=_int(environ, "MASTER_PORT", default=None),
                )
                env.validate()
                return env
        return cls()

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def validate(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE={self.world_size} must be at least 1.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"RANK={self.rank} is outside 0..{self.world_size - 1} (WORLD_SIZE="
                f"{self.world_size}); check the variables your launcher sets."
            )
        if self.is_distributed and (self.master_addr is None or self.master_port is None):
            raise ValueError(
                f"WORLD_SIZE={self.world_size} but MASTER_ADDR/MASTER_PORT are not set, so the "
                "ranks cannot find each other. Start the script with `torchrun` or "
                "`nbaccel launch`, or set both variables."
            )


def accelerate_defaults(
    gpus: int, mixed_precision: str, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The launch's choices in Hugging Face Accelerate's own variables, so that a worker that
    builds Accelerate's ``Accelerator`` (code ported by one import) makes the same ones: without
    ``ACCELERATE_USE_CPU``, Accelerate's Accelerator in each of several CPU workers believes it
    is alone (``DistributedType.NO``) and trains its own copy. DeepSpeed's device is named too
    (``DS_ACCELERATOR=cpu``), since Accelerate imports DeepSpeed where it is installed, and
    DeepSpeed, left to guess, warns on every rank that it found no GPU. A value the user set (in
    ``environ``, default ``os.environ``) is kept."""
    environ = os.environ if environ is None else environ
    chosen = {}
    if not gpus:
        chosen["ACCELERATE_USE_CPU"] = environ.get("ACCELERATE_USE_CPU", "1")
        chosen["DS_ACCELERATOR"] = environ.get("DS_ACCELERATOR", "cpu")
    if mixed_precision != "no":
        chosen["ACCELERATE_MIXED_PRECISION"] = mixed_precision
    return chosen


def _int(environ: Mapping[str, str], name: str, default: int | object | None = ...) -> int:
    value = environ.get(name)
    if value is None:
        if default is ...:
            raise ValueError(f"the environment variable {name} is not set")
        return default  # type: ignore[return-value]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not an integer") from None


def choose_device(local_rank: int = 0, cpu: bool = False) -> torch.device:
    """CUDA at ``local_rank`` if there is one, else Apple's MPS, else the CPU."""
    import torch  # here, not at import: the view's side reads this module without torch

    if not cpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    mps = getattr(torch.backends, "mps", None)
    if not cpu and mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def visible_gpus() -> int:
    """CUDA devices this process may use; asks the driver without initialising CUDA in torch."""
    import torch

    return torch.cuda.device_count()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def threads_per_worker(local_workers: int, environ: Mapping[str, str] | None = None) -> int:
    """``OMP_NUM_THREADS`` if the user set it, else an even share of the cores per worker."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(int(environ["OMP_NUM_THREADS"]), 1)
    return max(usable_cores() // local_workers, 1)


def device_label(kind: str) -> str:
    """How the live view and the summaries name a device type: ``"cuda"`` is a GPU."""
    return {"cpu": "CPU", "cuda": "GPU"}.get(kind, kind)


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors between GPUs; gloo handles everything else (CPU, MPS)."""
    return "nccl" if device.type == "cuda" else "gloo"


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. The OS picks it, so parallel jobs do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def in_notebook() -> bool:
    """True inside a Jupyter kernel (including VS Code's), False in a terminal or script."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})
