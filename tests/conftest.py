"""Every test leaves the environment, the process table and torch's process group as it found
them."""

from __future__ import annotations

import os

import psutil
import pytest
import torch.distributed as dist


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
        if p.pid not in children and not _is_resource_tracker(p)
    ]
    # Exited children may take a moment to be reaped; anything still running is a leak.
    _, alive = psutil.wait_procs(leftover, timeout=5)
    assert not alive, f"the test left processes running: {alive}"


def _environ() -> dict[str, str]:
    # pytest sets PYTEST_CURRENT_TEST, and torch's optimizers set TORCHINDUCTOR_CACHE_DIR once
    # on first use; neither comes from nbaccel.
    ignored = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
    return {k: v for k, v in os.environ.items() if k not in ignored}


def _is_resource_tracker(process: psutil.Process) -> bool:
    """Python's multiprocessing keeps one helper per interpreter for its whole life."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False
