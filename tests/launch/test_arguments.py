"""notebook_launcher refuses a bad argument before anything starts: no fork server, no worker,
no rendezvous. Each error names the bad value and shows a good one.

The ``nothing_starts`` fixture replaces every way a launch begins (workers here or in
processes, and the rendezvous both need) with a failure, so a check that came too late fails
the test instead of starting workers.
"""

from __future__ import annotations

from functools import partial
from types import MappingProxyType

import pytest

from nbaccel import notebook_launcher
from nbaccel.launch import launcher


def work(*args, **kwargs):
    return args, kwargs


@pytest.fixture
def nothing_starts(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the launch started before its arguments were checked")

    for name in ("_run_workers", "_run_here", "meeting"):
        monkeypatch.setattr(launcher, name, started)


@pytest.mark.parametrize(
    "timeout, error, match",
    [
        ("10", TypeError, r"timeout='10' must be a number of seconds, e.g. 600, or None"),
        (-1, ValueError, r"timeout=-1 must be a positive, finite number of seconds, e.g. 600,"),
        (0, ValueError, r"timeout=0 must be a positive"),
        (float("inf"), ValueError, r"timeout=inf must be a positive, finite"),
        (True, TypeError, r"timeout=True must be a number of seconds"),
    ],
)
def test_timeout_must_be_positive_seconds_or_none(nothing_starts, timeout, error, match):
    with pytest.raises(error, match=match):
        notebook_launcher(work, num_processes=2, timeout=timeout)


def test_the_timeout_error_does_not_call_its_example_the_default(nothing_starts):
    with pytest.raises(ValueError) as info:
        notebook_launcher(work, num_processes=2, timeout=-1)
    assert "(the default)" not in str(info.value)  # the default is None: no timeout


@pytest.mark.parametrize("kwargs", [["lr", 0.1], "lr=0.1", 0.1])
def test_kwargs_must_be_a_mapping(nothing_starts, kwargs):
    with pytest.raises(TypeError, match=r"kwargs must be a dict .* kwargs=\{'lr': 0.1\}"):
        notebook_launcher(work, kwargs=kwargs, num_processes=2)


def test_kwargs_keys_must_be_parameter_names(nothing_starts):
    with pytest.raises(TypeError, match=r"kwargs=\{1: ...\}: its keys .* must be strings"):
        notebook_launcher(work, kwargs={1: "a"}, num_processes=2)


@pytest.mark.parametrize("args", [3, "abc", {"lr": 0.1}, None])
def test_args_must_be_a_tuple(nothing_starts, args):
    with pytest.raises(TypeError, match=r"args must be a tuple of arguments, got .*: use args=\("):
        notebook_launcher(work, args=args, num_processes=2)


@pytest.mark.parametrize(
    "option, value, error, match",
    [
        ("return_all", "yes", TypeError, r"return_all='yes' must be bool, e.g. return_all=True"),
        ("output", "rank0", ValueError, r"output='rank0' is not one of .* e.g. output=\"main\""),
        ("output", None, ValueError, r"output=None is not one of \('all', 'main'\)"),
        ("live", "panel", TypeError, r"live='panel' must be bool or LiveView, e.g. live=False"),
        ("run", {}, TypeError, r"run=\{\} must be Run or None, e.g. run=Run\(\)"),
        ("cpu", "no", TypeError, r"cpu='no' must be bool or None, e.g. cpu=True"),
        ("fsdp", 1, TypeError, r"fsdp=1 must be bool or None, e.g. fsdp=True"),
        ("deepspeed", "zero2", TypeError, r"deepspeed='zero2' must be bool or None"),
        ("master_addr", 127, TypeError, r"master_addr=127 must be str or None"),
        ("master_addr", "", ValueError, r'master_addr="" names no machine: use "127.0.0.1"'),
        ("monitor_interval", 0, ValueError, r"monitor_interval=0 must be a positive"),
        ("stall_warning", "1m", TypeError, r"stall_warning='1m' must be a number of seconds"),
        ("max_restarts", -1, ValueError, r"max_restarts=-1 must be 0 \(no restarts\) or more"),
        ("master_port", "29500", TypeError, r"master_port='29500' must be an int, e.g. 29500"),
        ("rdzv_backend", "etcd", ValueError, r"rdzv_backend='etcd'"),
        ("zero_stage", 4, ValueError, r"zero_stage=4 must be 0, 1, 2, 3"),
    ],
)
def test_each_option_is_checked_before_anything_starts(nothing_starts, option, value, error, match):
    with pytest.raises(error, match=match):
        notebook_launcher(work, num_processes=2, **{option: value})


def test_a_bad_argument_is_refused_on_one_process_too(nothing_starts):
    # One process runs in this process: the same checks, before it runs.
    with pytest.raises(TypeError, match=r"kwargs must be a dict"):
        notebook_launcher(work, kwargs=("lr", 0.1), num_processes=1)
    with pytest.raises(ValueError, match=r"timeout=-1 must be a positive"):
        notebook_launcher(work, num_processes=1, timeout=-1)


def test_good_arguments_reach_the_launch(monkeypatch):
    # Any mapping is accepted for kwargs; what travels is a plain dict.
    seen = {}

    def run_here(function, args, kwargs, config, run):
        seen.update(args=args, kwargs=kwargs)
        return "ran"

    monkeypatch.setattr(launcher, "_run_here", run_here)
    value = notebook_launcher(work, (1,), MappingProxyType({"lr": 0.1}), num_processes=1, timeout=5)
    assert value == "ran"
    assert seen == {"args": (1,), "kwargs": {"lr": 0.1}}
    assert type(seen["kwargs"]) is dict


def numbers(n):
    yield from range(n)


async def fetch(n):
    return n


async def stream(n):
    for i in range(n):
        yield i


@pytest.mark.parametrize(
    "function, match",
    [
        (numbers, r"numbers is a generator function .* return list\(numbers\(\*args\)\)"),
        (fetch, r"fetch is an async function \(async def\).* asyncio.run\(fetch\(\*args\)\)"),
        (stream, r"stream is an async generator function.* async for x in stream\(\)"),
        (partial(numbers, 3), r"numbers is a generator function"),  # a partial of one too
    ],
)
@pytest.mark.parametrize("num_processes", [1, 2])
def test_generators_and_coroutines_are_refused_before_any_worker_starts(
    nothing_starts, function, match, num_processes
):
    """Run, each rank would hand back a generator or a coroutine whose body never ran: refused
    up front, with the plain function to write instead."""
    with pytest.raises(TypeError, match=match):
        notebook_launcher(function, args=(3,), num_processes=num_processes)


def test_a_plain_function_that_returns_a_generator_is_not_refused(nothing_starts):
    """Only the function's own kind is judged: a plain ``def`` passes the check (and reaches
    the start, which the fixture turns into a failure)."""
    with pytest.raises(AssertionError, match="the launch started"):
        notebook_launcher(lambda n: numbers(n), args=(3,), num_processes=2)
