"""Every test leaves the environment, the process table and torch's process group as it found
them; and the fast tier (``make check``, ``pytest --fast``) holds only tests that start no
process.

The fast tier is what the markers leave: every test not marked as starting a process (``process``,
``multiprocess``) or as needing more than this machine (``gpu``, ``browser``, ``install``,
``slurm``), and no notebook (nbval runs each in a kernel). Nobody keeps a list: while the tier
runs, starting a process (a subprocess, a fork, a multiprocessing worker, a Jupyter kernel) fails
the test and says which marker it needs, so the tier stays as fast as it claims.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import multiprocessing.process
import multiprocessing.util
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator

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


# The markers that keep a test out of the fast tier (all registered in pyproject.toml).
NOT_FAST = ("process", "multiprocess", "gpu", "browser", "install", "slurm")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="the fast tier (make check): only the tests that start no process, no kernel and "
        "no notebook; one that starts a process fails and names the marker it needs",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_PATH] = os.environ.get("PATH")
    os.environ["PATH"] = without_env_bin(os.environ.get("PATH", os.defpath))
    if config.getoption("fast"):
        # Python asks `uname -p` once per interpreter, for whichever test (or library: MLflow)
        # first wants the processor's name; asked here, no test of the tier is blamed for it.
        platform.processor()


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_PATH, None)
    if path is None:
        os.environ.pop("PATH", None)
    else:
        os.environ["PATH"] = path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("fast"):
        return
    fast, slow = [], []
    for item in items:
        starts = item.path.suffix == ".ipynb" or any(item.get_closest_marker(m) for m in NOT_FAST)
        (slow if starts else fast).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = fast


class ProcessStarted(RuntimeError):
    """A test of the fast tier started a process."""


# Every way a test could start a process, down to the call both subprocess and multiprocessing's
# spawn make (_posixsubprocess.fork_exec); the higher ones come first to name what was started.
_STARTS = (
    (subprocess.Popen, "__init__", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "a multiprocessing Process"),
    (multiprocessing.util, "spawnv_passfds", "a multiprocessing helper"),
    (_posixsubprocess, "fork_exec", "a subprocess"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
)


@contextlib.contextmanager
def _processes_refused(test: str) -> Iterator[list[str]]:
    """While it lasts, each way of starting a process raises ``ProcessStarted``; yields the list
    of what was tried (a test may catch the error, so the phase is failed afterwards too)."""
    tried: list[str] = []
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in _STARTS]

    def refuse(what: str) -> Callable[..., None]:
        def refused(*args: object, **kwargs: object) -> None:
            command = args[1] if what == "subprocess.Popen" and len(args) > 1 else None
            if command is None:
                command = kwargs.get("args")
            tried.append(what + (f" {command!r}" if command is not None else ""))
            raise ProcessStarted(_refusal(test, tried[-1]))

        return refused

    for owner, name, what in _STARTS:
        setattr(owner, name, refuse(what))
    try:
        yield tried
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _refusal(test: str, what: str) -> str:
    return (
        f"{test} started a process ({what}) in the fast tier (make check, pytest --fast), "
        "which holds only tests that start none. Mark it, so that only make test runs it: "
        "@pytest.mark.process (a subprocess, a kernel, a fork), or @pytest.mark.multiprocess "
        "(CPU workers on gloo); `pytestmark = pytest.mark.process` at the top of a module whose "
        "tests all do."
    )


def _guarded_phase(item: pytest.Item) -> Iterator[None]:
    """The body of the three hook wrappers below: in the fast tier, one phase of one test (its
    fixtures' set-up, its call, their teardown) runs with process starts refused."""
    if not item.config.getoption("fast"):
        return (yield)
    with _processes_refused(item.nodeid) as tried:
        try:
            result = yield
        except (Exception, pytest.fail.Exception, pytest.skip.Exception) as err:
            if tried and not isinstance(err, ProcessStarted):  # failed or skipped for want of one
                raise ProcessStarted(_refusal(item.nodeid, tried[0])) from err
            raise
    if tried:  # refused, and the test caught the error: it must still fail
        raise ProcessStarted(_refusal(item.nodeid, tried[0]))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    return (yield from _guarded_phase(item))


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
