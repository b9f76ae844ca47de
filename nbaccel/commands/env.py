"""``nbaccel env``: a paste-ready report of the versions and hardware a bug depends on."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict

from ..config import config_path, load_config
from ..env import usable_cores, visible_gpus


def env_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "env",
        help="print versions and hardware for a bug report",
        description="Print a Markdown list to paste into a bug report: nbaccel, Python, torch "
        "and its build, GPUs, NCCL/gloo, CPU threads, and the nbaccel config file.",
    )
    parser.set_defaults(func=env_command)
    return parser


def env_command(args: argparse.Namespace) -> int:
    print("Copy and paste the list below into your bug report.\n")
    print("\n".join(f"- {name}: {value}" for name, value in report().items()))
    return 0


def report() -> dict[str, str]:
    import torch
    import torch.distributed as dist

    from .. import __version__

    cores = usable_cores()
    gpus = visible_gpus()
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]  # initialises CUDA: fine here
    mps = getattr(torch.backends, "mps", None)
    return {
        "nbaccel": __version__,
        "Python": f"{platform.python_version()} ({sys.executable})",
        "Platform": platform.platform(),
        "torch": f"{torch.__version__} ({_build(torch)})",
        "CUDA available": str(torch.cuda.is_available()),
        "GPUs": f"{gpus} ({', '.join(names)})" if names else "0",
        "NCCL": _nccl(torch),
        "gloo": "available" if dist.is_available() and dist.is_gloo_available() else "missing",
        "MPS": "available" if mps is not None and mps.is_available() else "not available",
        "CPU cores": f"{cores} usable of {os.cpu_count()}",
        "OMP_NUM_THREADS": f"{os.environ.get('OMP_NUM_THREADS', 'unset')} "
        f"(torch uses {torch.get_num_threads()} threads)",
        "DeepSpeed": _deepspeed(),
        "Config": _config(),
    }


def _build(torch) -> str:
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip} build"
    return "CPU build"


def _nccl(torch) -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # CPU builds have no NCCL, and some builds raise on the query
        return "not available"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _deepspeed() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:  # the installed version, without importing it (DeepSpeed probes ops on import)
        return version("deepspeed")
    except PackageNotFoundError:
        return "not installed (pip install 'nbaccel[deepspeed]' for ZeRO)"


def _config() -> str:
    path = config_path()
    if not path.is_file():
        return f"{path} (no file: built-in defaults)"
    try:
        return f"{path} {json.dumps(asdict(load_config(path)))}"
    except ValueError as err:
        return f"{path} (invalid: {err})"
