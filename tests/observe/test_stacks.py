"""Where a hung rank is stuck: naming collectives and call sites, desyncs, the report, the
listener and its transport, and what a hung ``notebook_launcher`` says about it."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from nbaccel import LaunchError, notebook_launcher
from nbaccel.observe.channel import STEPS, Record
from nbaccel.observe.hang import (
    Stall,
    check_stall_warning,
    desyncs,
    report,
    shown_path,
    steps_apart,
    where,
)
from nbaccel.observe.records import Run
from nbaccel.observe.stacks import Frame, RankStack, ThreadStack, collect, socket_path

HANG = 120  # seconds: a launch that takes this long is hung, not slow
TORCH = os.path.dirname(torch.__file__)
C10D = os.path.join(TORCH, "distributed", "distributed_c10d.py")
LOGGER = os.path.join(TORCH, "distributed", "c10d_logger.py")
NBACCEL = os.path.dirname(os.path.abspath(sys.modules["nbaccel"].__file__))
USER = "/home/me/train.py"


def stack(rank: int, *frames: tuple[str, int, str], waiting: str | None = None) -> RankStack:
    main = ThreadStack("MainThread", True, tuple(Frame(*f) for f in frames))
    return RankStack(rank, 1000 + rank, (main,), waiting)


def in_all_reduce(rank: int, line: int = 10, function: str = "train") -> RankStack:
    return stack(
        rank,
        (USER, 20, "main"),
        (USER, line, function),
        (os.path.join(NBACCEL, "collectives.py"), 50, "reduce"),
        (LOGGER, 83, "wrapper"),
        (C10D, 3252, "all_reduce"),
    )


def in_the_moon(rank: int) -> RankStack:
    return stack(rank, (USER, 20, "main"), (USER, 12, "train"), (USER, 8, "wait_for_the_moon"))


# -- naming: the collective, and the user's frame ------------------------------------------------
def test_a_collective_is_named_with_the_users_call_site():
    place = where(in_all_reduce(0))
    assert place.collective == "`all_reduce`"
    assert place.frame == Frame(USER, 10, "train")  # not nbaccel's reduce, not torch's wrapper
    assert place.said() == "rank 0 waits in `all_reduce` called from `train` (train.py, line 10)"


def test_a_rank_in_no_collective_is_in_its_innermost_own_frame():
    event_wait = (os.path.join(os.path.dirname(threading.__file__), "threading.py"), 320, "wait")
    place = where(stack(1, (USER, 12, "train"), (USER, 8, "wait_for_the_moon"), event_wait))
    assert place.collective is None
    assert place.said() == "rank 1 is in `wait_for_the_moon` (train.py, line 8)"


def test_the_label_a_library_set_names_a_collective_its_frames_do_not_show():
    backward = (os.path.join(TORCH, "autograd", "__init__.py"), 300, "backward")
    place = where(stack(0, (USER, 14, "train"), backward, waiting="DDP's gradient all_reduce"))
    assert place.said() == (
        "rank 0 waits in DDP's gradient all_reduce called from `train` (train.py, line 14)"
    )


def test_a_function_named_like_a_collective_outside_torch_is_not_one():
    place = where(stack(0, (USER, 3, "main"), (USER, 9, "barrier")))
    assert place.collective is None and place.frame.function == "barrier"


# -- desyncs -------------------------------------------------------------------------------------
def test_a_rank_that_returned_while_another_waits_is_a_desync():
    lines = desyncs([where(in_all_reduce(0))], returned=[1])
    assert lines[0].startswith(
        "desync: rank 0 waits in `all_reduce` (train, train.py, line 10) but rank 1 had "
        "already returned: the ranks ran different numbers of steps"
    )


def test_different_collectives_and_different_call_sites_are_desyncs():
    barrier = stack(1, (USER, 30, "evaluate"), (C10D, 4000, "barrier"))
    (line,) = desyncs([where(in_all_reduce(0)), where(barrier)], returned=[])
    assert line.startswith(
        "desync: the ranks wait in different collectives: rank 0 in `all_reduce` (train, "
        "train.py, line 10), rank 1 in `barrier` (evaluate, train.py, line 30)."
    )
    (line,) = desyncs([where(in_all_reduce(0)), where(in_all_reduce(1, 40, "eval"))], [])
    assert "called from different places: rank 0 at train, train.py, line 10; rank 1 at eval" in (
        line
    )


def test_a_rank_waiting_for_one_in_no_collective_is_named():
    (line,) = desyncs([where(in_all_reduce(0)), where(in_the_moon(1))], returned=[])
    assert line == (
        "desync: rank 0 waits in `all_reduce` (train, train.py, line 10) while rank 1 is in no "
        "collective (it is in `wait_for_the_moon`, train.py, line 8): rank 1 is stuck or slow "
        "there, or it skipped that collective."
    )


def test_ranks_in_the_same_collective_at_the_same_place_are_no_desync():
    assert desyncs([where(in_all_reduce(0)), where(in_all_reduce(1))], returned=[]) == []


def records(rank: int, name: str, steps: list[int], every: float = 1.0) -> list[Record]:
    return [Record(rank, s, 100.0 + i * every, name, 1.0) for i, s in enumerate(steps)]


def test_ranks_at_different_steps_are_named_beyond_what_unsent_records_explain():
    run = Run(records=records(0, "loss", [0, 1, 2, 3, 4, 5]) + records(1, "loss", [0, 1, 2]))
    assert steps_apart(run, [0, 1]) == ("loss", {0: 5, 1: 2})
    places = [where(in_all_reduce(0)), where(in_all_reduce(1))]
    assert desyncs(places, [], run) == [
        "desync: the ranks are at different steps of loss: rank 0 at step 5, rank 1 at step 2."
    ]
    one_apart = Run(records=records(0, "loss", [0, 1, 2]) + records(1, "loss", [0, 1]))
    assert steps_apart(one_apart, [0, 1]) is None  # its last record may still be unsent
    fast = [0, 100, 200, 300]  # 100 steps a second: half a second of them may be unsent
    close = Run(records=records(0, STEPS, fast) + records(1, STEPS, [0, 100, 200, 260]))
    assert steps_apart(close, [0, 1]) is None
    far = Run(records=records(0, STEPS, fast) + records(1, STEPS, [0, 100, 150]))
    assert steps_apart(far, [0, 1]) == (STEPS, {0: 300, 1: 150})


# -- the report ----------------------------------------------------------------------------------
def test_the_report_names_every_rank_then_shows_their_frames_with_source():
    here = os.path.abspath(__file__)
    line = test_the_report_names_every_rank_then_shows_their_frames_with_source.__code__
    first = line.co_firstlineno  # this test's own def line, readable through linecache
    hung = stack(1, (here, first, "test_the_report_names_every_rank"))
    found = report({0: in_all_reduce(0), 1: hung, 2: None}, asked=[0, 1, 2, 3])
    assert found.summary == (
        "rank 1 is in `test_the_report_names_every_rank` (test_stacks.py, line "
        f"{first}); rank 0 waits in `all_reduce` called from `train` (train.py, line 10); "
        "rank 2 did not answer within 0.3 s (busy in C code that holds Python's lock, or "
        "overloaded); rank 3 was not listening (not started yet, or already gone)"
    )
    text = str(found)
    assert "Where each rank was (innermost frame last):" in text
    assert f'File "{here}", line {first}, in test_the_report_names_every_rank' in text
    assert "def test_the_report_names_every_rank_then_shows_their_frames_with_source():" in text
    assert "rank 0 (pid 1000):" in text and "rank 1 (pid 1001):" in text


def test_a_librarys_frames_name_no_folder_of_the_machine():
    """The report is pasted into issues and committed in lessons: torch's, the standard
    library's and nbaccel's files read as their import paths; a user's file stays whole."""
    c10d = importlib.util.find_spec("torch.distributed.distributed_c10d").origin
    assert shown_path(c10d) == "torch/distributed/distributed_c10d.py"
    assert shown_path(threading.__file__) == "threading.py"
    runner = importlib.util.find_spec("nbaccel.launch.forkserver").origin
    assert shown_path(runner) == "nbaccel/launch/forkserver.py"
    assert shown_path(USER) == USER
    found = report({0: stack(0, (USER, 8, "train"), (c10d, 2500, "all_reduce"))}, asked=[0])
    assert 'File "torch/distributed/distributed_c10d.py", line 2500' in found.details
    assert os.path.dirname(c10d) not in str(found)


def test_the_workers_own_runner_frames_are_left_out():
    runner = importlib.util.find_spec(
        "nbaccel.launch.forkserver"
    ).origin  # the real one, wherever it is
    found = report({0: stack(0, (runner, 170, "run_worker"), (USER, 8, "wait"))}, asked=[0])
    assert "run_worker" not in found.details and "in wait" in found.details


# -- the stall clock -----------------------------------------------------------------------------
def test_a_stall_is_told_once_and_again_only_after_progress():
    stall = Stall(2.0)
    assert stall.quiet([0, 1], now=100.0) == []  # nothing recorded yet: start-up is no stall
    stall.heard_from(0, now=100.0)
    assert stall.quiet([0, 1], now=101.0) == []
    assert stall.quiet([0, 1], now=102.5) == [0, 1]  # rank 1 never recorded since the first
    assert stall.quiet([0, 1], now=110.0) == []  # the same stall
    stall.heard_from(0, now=111.0)
    assert stall.quiet([0, 1], now=114.0) == []  # rank 1 has still not moved
    stall.heard_from(1, now=114.0)
    assert stall.quiet([0, 1], now=116.5) == [0, 1]  # progress, then a new stall
    assert Stall(None).quiet([0], now=1e9) == []


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("60", TypeError, "stall_warning='60' must be a number of seconds"),
        (True, TypeError, "must be a number of seconds"),
        (0, ValueError, "stall_warning=0 must be a positive, finite number"),
        (float("inf"), ValueError, "must be a positive, finite number"),
    ],
)
def test_a_bad_stall_warning_is_refused_with_the_fix(value, error, match):
    with pytest.raises(error, match=match):
        check_stall_warning(value)
    with pytest.raises(error, match=match):
        notebook_launcher(print, num_processes=2, stall_warning=value)
    assert check_stall_warning(None) is None and check_stall_warning(5) == 5.0


# -- the listener and the transport --------------------------------------------------------------
LISTENER = """
import sys, threading, time
from nbaccel.observe import stacks

def helper():
    time.sleep(60)

def wait_for_the_moon():
    stacks.waiting_in("the moon's all_reduce")
    print("ready", flush=True); time.sleep(60)  # one line: asked between the two, still 10

stacks.listen(sys.argv[1], 3)
stacks.listen(sys.argv[1], 3)  # twice: one listener
threading.Thread(target=helper, name="helper", daemon=True).start()
wait_for_the_moon()
"""


@pytest.mark.process
def test_a_rank_answers_with_every_thread_but_its_listener(tmp_path):
    script = tmp_path / "listener.py"
    script.write_text(LISTENER)
    path = socket_path(str(tmp_path), 3)
    child = subprocess.Popen(
        [sys.executable, str(script), path], stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "ready\n"
        answers = collect({3: path, 4: socket_path(str(tmp_path), 4)}, timeout=HANG)
        assert list(answers) == [3]  # nobody listens for rank 4
        answer = answers[3]
        assert (answer.rank, answer.pid, answer.waiting) == (3, child.pid, "the moon's all_reduce")
        assert [t.name for t in answer.threads] == ["MainThread", "helper"]
        assert answer.main.frames[-1] == Frame(str(script), 10, "wait_for_the_moon")
        assert answer.main.frames[-2].function == "<module>"
        again = collect({3: path}, timeout=HANG)[3]  # it answers every time
        assert again.main.frames == answer.main.frames
    finally:
        child.kill()
        child.wait()


def test_a_rank_that_takes_the_call_but_never_answers_is_none(tmp_path):
    path = socket_path(str(tmp_path), 0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(path)
        mute.listen(1)  # connections queue up; nobody accepts them
        assert collect({0: path}, timeout=0.2) == {0: None}


# -- a hung launch -------------------------------------------------------------------------------
def wait_for_the_moon():
    time.sleep(HANG)


def moon(hang_rank: int = 1, returns_early: bool = False):
    import torch.distributed as dist

    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == hang_rank:
        if returns_early:
            return "early"
        wait_for_the_moon()
    dist.all_reduce(torch.ones(1))
    return "done"


def line_of(function, text: str) -> int:
    """The line of this file, inside ``function``, that holds ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.fixture
def temp(monkeypatch):
    """A temporary folder of this test's own (short: socket paths have a length limit)."""
    folder = tempfile.mkdtemp(prefix="s-")
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    os.rmdir(folder)  # fails if anything was left in it


@pytest.mark.multiprocess
def test_a_timeout_names_each_ranks_frame_and_collective(temp):
    with pytest.raises(LaunchError, match=r"timeout: ranks \[0, 1\] had not finished") as info:
        notebook_launcher(moon, num_processes=2, timeout=8, live=False)
    message = str(info.value)
    sleeps, reduces = line_of(wait_for_the_moon, "sleep"), line_of(moon, "all_reduce")
    assert f"rank 1 is in `wait_for_the_moon` (test_stacks.py, line {sleeps})" in message, message
    assert f"rank 0 waits in `all_reduce` called from `moon` (test_stacks.py, line {reduces})" in (
        message
    )
    assert "time.sleep(HANG)" in message and "dist.all_reduce(torch.ones(1))" in message
    assert info.value.stacks[1].main.frames[-1].function == "wait_for_the_moon"
    assert os.listdir(temp) == []  # the sockets' folder is gone


@pytest.mark.multiprocess
def test_a_rank_that_returned_early_is_named_a_desync():
    """gloo tells rank 0 at once that its peer left (an error, the root cause report); a
    back end that does not (NCCL) leaves it waiting until the timeout (the stacks report)."""
    with pytest.raises(LaunchError) as info:
        notebook_launcher(moon, kwargs={"returns_early": True}, num_processes=2, timeout=HANG)
    message = str(info.value)
    assert re.search(r"ranks? \[?1\]? had already returned", message, re.I), message
    assert "desync" in message and "the ranks ran different numbers of steps" in message


class Tee:
    """stderr that also tells a test when a text appeared in it."""

    def __init__(self, stream, text: str) -> None:
        self.stream, self.text, self.seen, self.written = stream, text, threading.Event(), ""

    def write(self, data: str) -> int:
        self.written += data
        if self.text in self.written:
            self.seen.set()
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()


def wait_for_the_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def stalls(go: str):
    import torch.distributed as dist

    from nbaccel import PartialState, Recorder

    state = PartialState()
    recorder = Recorder(live=False)
    recorder.log({"loss": 1.0})
    recorder.channel.flush()  # the launcher has heard from this rank
    if state.process_index == 1:
        wait_for_the_file(go)
    dist.all_reduce(torch.ones(1))
    recorder.close()
    return state.process_index


@pytest.mark.multiprocess
def test_a_stall_is_told_while_the_launch_runs_on(tmp_path, monkeypatch):
    go = str(tmp_path / "go")
    tee = Tee(sys.stderr, "no step, sample or log from ranks")
    monkeypatch.setattr(sys, "stderr", tee)

    def release():  # the file appears once the warning did, and not before
        if tee.seen.wait(HANG):
            open(go, "w").close()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    values = notebook_launcher(
        stalls, args=(go,), num_processes=2, stall_warning=2, timeout=HANG, live=False,
        return_all=True,
    )  # fmt: skip
    releaser.join()
    assert values == [0, 1]  # nothing was stopped
    warning = tee.written
    assert warning.count("no step, sample or log from ranks") == 1, warning
    assert "they are still running, nothing was stopped" in warning
    assert "rank 1 is in `wait_for_the_file` (test_stacks.py, line" in warning
    assert "rank 0 waits in `all_reduce` called from `stalls` (test_stacks.py, line" in warning
