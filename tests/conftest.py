"""Every test leaves the environment, the process table and torch's process group as it found
them."""

from __future__ import annotations

import os
import sys

import psutil
import pytest
import torch.distributed as dist

# The suite runs as a Jupyter kernel registered from a virtual environment runs (JupyterHub, VS
# Code, `python -m ipykernel install`): that environment's bin is not on PATH. So the lessons
# (under nbval), the workers and the CLI tests prove they need nothing from PATH, even when the
# tests are started from an activated environment or by `make`.
ENV_BIN = os.path.dirname(sys.executable) if sys.prefix != sys.base_prefix else None
_PATH = pytest.StashKey[str | None]()  # PATH as pytest found it, put back at the end


def without_env_bin(path: str) -> str:
    same = os.path.realpath(ENV_BIN) if ENV_BIN else None
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and os.path.realpath(p) != same)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_PATH] = os.environ.get("PATH")
    os.environ["PATH"] = without_env_bin(os.environ.get("PATH", os.defpath))


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_PATH, None)
    if path is None:
        os.environ.pop("PATH", None)
    else:
        os.environ["PATH"] = path


@pytest.fixture(autouse=True)
def leaves_nothing_behind():
    environ = _environ()
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    assert _environ() == environ, "the test changed os.environ"
    assert not dist.is_initialized(), "the test left a process group behind"
    leftover = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in children and not _is_long_lived_helper(p)
    ]
    # Exited children may take a moment to be reaped; anything still running is a leak.
    _, alive = psutil.wait_procs(leftover, timeout=5)
    assert not alive, f"the test left processes running: {alive}"


def _environ() -> dict[str, str]:
    # pytest sets PYTEST_CURRENT_TEST, and torch's optimizers set TORCHINDUCTOR_CACHE_DIR once
    # on first use; neither comes from nbaccel.
    ignored = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
    return {k: v for k, v in os.environ.items() if k not in ignored}


def _is_long_lived_helper(process: psutil.Process) -> bool:
    """Helpers meant to live as long as this interpreter: multiprocessing's resource tracker,
    and nbaccel's fork server (one per launching process). Their workers are not exempt."""
    try:
        command = " ".join(process.cmdline())
        parent = process.parent()
        parents_command = " ".join(parent.cmdline()) if parent else ""
    except psutil.NoSuchProcess:
        return False
    server = "-m nbaccel.launch.forkserver"  # a worker is forked from it: same command line
    # the test cluster's daemons live for the session (tests/slurm); its jobs' processes do not
    daemons = ("cluster.py --supervise", "slurmctld -D", "slurmd -D", "munged -F")
    return (
        "multiprocessing.resource_tracker" in command
        or (server in command and server not in parents_command)
        or any(d in command for d in daemons)
    )
