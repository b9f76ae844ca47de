"""Issue 31's cases, as a notebook user meets them: from one real kernel, each case gives one
clear error naming the real rank and cause, the next launch works, and a scan of the whole
machine finds nothing the launch started (``nothing_left``: by marker and command line, not by
parentage, since an orphan is nobody's child).
"""

from __future__ import annotations

import ast
import os
import signal
import time

import psutil
import pytest

from ..kernel import kernel_with
from .processes import MARKER

pytestmark = pytest.mark.multiprocess

CELLS = """
import os, signal, subprocess, sys, time, torch
from nbaccel import Accelerator, LaunchError, NbaccelError, notebook_launcher

def normal():
    accelerator = Accelerator()
    total = accelerator.reduce(torch.ones(1), "sum").item()
    accelerator.end_training()
    return total

def check():  # what the test asks after every case
    assert notebook_launcher(normal, num_processes=2, timeout=120) == 2.0
    return "ok"

def leaves(how):
    accelerator = Accelerator()
    if accelerator.rank == 1:
        if how == "exit 3":
            sys.exit(3)
        if how == "message":
            raise SystemExit("config file missing")
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit 0":
            sys.exit(0)
    if how != "exit 0":
        accelerator.reduce(torch.ones(1))  # rank 0 waits here for rank 1
    return accelerator.rank

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")

def unprintable():
    if Accelerator().rank == 1:
        raise Unprintable()
    return 0

def returns_model(rank_returning_it):
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    return model if accelerator.rank in rank_returning_it else float(accelerator.rank)

def two_accelerators():
    a1, a2 = Accelerator(), Accelerator()
    a1.end_training()
    total = a2.reduce(torch.ones(1), "sum").item()
    try:
        a1.reduce(torch.ones(1), "sum")
        late = "no error"
    except NbaccelError as err:
        late = str(err)
    a2.end_training()
    return total, a2.num_processes, late

def starts_subprocesses(detached_pid_file):
    accelerator = Accelerator()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if accelerator.rank == 0:
        kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                start_new_session=True)
        with open(detached_pid_file, "w") as f:
            f.write(str(kept.pid))
    accelerator.end_training()
    return "done"

def trains_until_told(pid_file):
    accelerator = Accelerator()
    with open(f"{pid_file}.{accelerator.rank}", "w") as f:
        f.write(str(os.getpid()))
    for _ in range(1200):
        accelerator.reduce(torch.ones(1))
        time.sleep(0.05)
    return "finished"
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with kernel_with(str(tmp_path_factory.mktemp("kernel")), CELLS) as kernel:
        yield kernel


def nothing_left(kernel) -> None:
    """A normal launch works, and no process of any launch is alive anywhere on the machine:
    none carries the launch marker, and every process running the fork server's command line
    is a live server of the kernel or of this test process (a worker has its server's
    command line: one whose parent is anything else is an orphan)."""
    out = kernel.run("check()")
    assert out.error is None and out.value == "'ok'", out.error
    servers = {kernel.pid, os.getpid()}
    left = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            try:
                marked = MARKER in process.environ()
            except psutil.AccessDenied:
                marked = False
            server_line = "nbaccel.launch.forkserver" in " ".join(process.cmdline())
            if marked or (server_line and process.ppid() not in servers):
                left.append(process)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(left, timeout=15)  # a hang catcher: they are ending already
    assert not alive, f"left running: {alive}"


def error_of(kernel, code: str) -> dict:
    out = kernel.run(code)
    assert out.error is not None, out.stdout
    return out.error


@pytest.mark.parametrize(
    ("how", "headline"),
    [
        ("exit 3", "rank 1 (pid {}) exited with code 3"),
        ("message", "rank 1 (pid {}) exited with code 1: config file missing"),
        ("sigkill", "rank 1 (pid {}) was killed by SIGKILL; "),
    ],
)
def test_a_rank_that_leaves_while_its_peer_waits_is_named(kernel, how, headline):
    err = error_of(kernel, f"notebook_launcher(leaves, args=({how!r},), num_processes=2)")
    assert err["ename"] == "LaunchError"
    first = err["evalue"].splitlines()[0]
    prefix, suffix = headline.split("{}")
    assert first.startswith(prefix) and suffix in first, err["evalue"]
    if how == "sigkill":  # the memory hint: a verdict and how to check
        assert "dmesg" in err["evalue"] and "memory" in err["evalue"]
    nothing_left(kernel)


def test_sys_exit_0_on_one_rank_is_one_warning(kernel):
    out = kernel.run("notebook_launcher(leaves, args=('exit 0',), num_processes=2)")
    assert out.error is None and out.value == "0"
    warnings = [line for line in out.stderr.splitlines() if "sys.exit(0)" in line]
    assert len(warnings) == 1 and "rank 1" in warnings[0], out.stderr
    nothing_left(kernel)


def test_an_exception_whose_str_raises_is_named(kernel):
    err = error_of(kernel, "notebook_launcher(unprintable, num_processes=2)")
    assert err["evalue"].splitlines()[0].startswith("rank 1 (pid ")
    assert "Unprintable" in err["evalue"].splitlines()[0], err["evalue"]
    nothing_left(kernel)


def test_a_model_that_cannot_come_back_is_named_and_the_others_survive(kernel):
    out = kernel.run("notebook_launcher(returns_model, args=((1,),), num_processes=2)")
    assert out.error is None and out.value == "0.0"  # rank 1's model is not the call's value
    code = """
try:
    notebook_launcher(returns_model, args=((0,),), num_processes=2, return_all=True)
except LaunchError as err:
    print("RESULTS", err.results)
    raise
"""
    out = kernel.run(code)
    assert out.error["ename"] == "LaunchError"
    assert (
        "rank 0" in out.error["evalue"]
        and "unwrap_model(model).state_dict()" in out.error["evalue"]
    )
    assert "RESULTS {1: 1.0}" in out.stdout
    nothing_left(kernel)


def test_two_accelerators_share_the_group_until_the_last_ends(kernel):
    out = kernel.run("notebook_launcher(two_accelerators, num_processes=2)")
    assert out.error is None, out.error
    total, processes, late = ast.literal_eval(out.value)
    assert (total, processes) == (2.0, 2)
    assert "end_training" in late, late  # a collective after its own end raises and says why
    nothing_left(kernel)


def test_what_a_rank_started_ends_with_the_launch_unless_detached(kernel, tmp_path):
    pid_file = tmp_path / "detached"
    out = kernel.run(f"notebook_launcher(starts_subprocesses, args=({str(pid_file)!r},), "
                     "num_processes=2)")  # fmt: skip
    assert out.error is None and out.value == "'done'"
    detached = psutil.Process(int(pid_file.read_text()))
    try:
        assert out.stderr.count("nbaccel: ended ") == 2, out.stderr
        kept = [line for line in out.stderr.splitlines() if "nbaccel: left running" in line]
        assert len(kept) == 1 and str(detached.pid) in kept[0], out.stderr
        assert detached.is_running()
    finally:
        os.kill(detached.pid, signal.SIGTERM)
        detached.wait(timeout=15)
    nothing_left(kernel)


def test_a_fork_server_killed_mid_launch_takes_its_workers_with_it(kernel, tmp_path):
    pid_file = tmp_path / "rank"
    msg_id = kernel.start(f"notebook_launcher(trains_until_told, args=({str(pid_file)!r},), "
                          "num_processes=2)")  # fmt: skip
    files = [tmp_path / f"rank.{r}" for r in (0, 1)]
    deadline = time.monotonic() + 60  # a hang catcher
    while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [psutil.Process(int(f.read_text())) for f in files]
    (server,) = kernel.servers()
    server.kill()  # the OOM killer, or a process monitor
    out = kernel.finish(msg_id, timeout=120)
    assert out.error["ename"] == "LaunchError"
    assert f"fork server (pid {server.pid}) died" in out.error["evalue"], out.error["evalue"]
    _, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, "workers outlived their fork server"
    nothing_left(kernel)


@pytest.mark.parametrize(
    ("arguments", "ename", "words"),
    [
        ("timeout='10'", "TypeError", "timeout"),
        ("timeout=-1", "ValueError", "timeout"),
        ("kwargs=[1]", "TypeError", "kwargs"),
        ("num_processes=1, kwargs=[1]", "TypeError", "kwargs"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kernel, arguments, ename, words):
    if "num_processes" not in arguments:
        arguments += ", num_processes=2"
    err = error_of(kernel, f"notebook_launcher(normal, {arguments})")
    assert err["ename"] == ename and words in err["evalue"], err
    nothing_left(kernel)
