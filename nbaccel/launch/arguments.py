"""``notebook_launcher``'s arguments, checked before anything starts.

A bad argument is refused here, in the cell, with the value that was wrong and one that works:
before the fork server, the rendezvous or any worker starts, so a mistake never turns into a
worker's traceback or a supervisor's TypeError. ``LaunchConfig`` (``config.py``) checks the
options that ``nbaccel launch`` shares; these are the ones only a launch from Python has.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from functools import partial
from typing import Any

from ..config import LaunchConfig, check_seconds
from ..errors import NbaccelError
from ..observe.live.view import LiveView
from ..observe.records import Run
from .rendezvous import import_torch_distributed

START_METHODS = ("forkserver", "spawn")


def check_call(function: Any, args: Any, kwargs: Any) -> None:
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs the function itself, but got a {type(function).__name__} "
            "(did you call it?). Write notebook_launcher(train, args=(...)), "
            "not notebook_launcher(train(...))."
        )
    _check_plain(function)
    if not isinstance(args, list | tuple):
        raise TypeError(
            f"args must be a tuple of arguments, got {type(args).__name__}: "
            f"use args=({args!r},) for a single argument"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(
            f"kwargs must be a dict of keyword arguments (or None), got "
            f"{type(kwargs).__name__}: {kwargs!r}. Write kwargs={{'lr': 0.1}} for train(lr=0.1); "
            "positional arguments go in args=(...)."
        )
    for name in kwargs or ():
        if not isinstance(name, str):
            raise TypeError(
                f"kwargs={{{name!r}: ...}}: its keys are the function's parameter names, so "
                "they must be strings, e.g. kwargs={'lr': 0.1}"
            )


# Kinds of function whose call returns an object instead of running the body: what each is,
# and the plain function to launch instead ({name} is the user's function).
_NOT_PLAIN = (
    (
        inspect.isasyncgenfunction,
        "an async generator function",
        "Collect its items in a plain function: async def collect(): return [x async for x in "
        "{name}()], then def main(): return asyncio.run(collect()), and launch main",
    ),
    (
        inspect.iscoroutinefunction,
        "an async function (async def)",
        "Run it in a plain function: def main(*args): return asyncio.run({name}(*args)), and "
        "launch main",
    ),
    (
        inspect.isgeneratorfunction,
        "a generator function (it yields)",
        "Return the values instead of yielding them: def main(*args): return "
        "list({name}(*args)), and launch main; to see progress while it runs, "
        "accelerator.log({{...}}) draws it live",
    ),
)


def _check_plain(function: Any) -> None:
    """A generator or ``async def`` would run on every rank only to hand back an object whose
    body never ran (a generator, a coroutine never awaited): refused before anything starts,
    with the plain function to write instead."""
    inner = function
    while isinstance(inner, partial):
        inner = inner.func
    name = getattr(inner, "__name__", None) or type(inner).__name__
    for test, kind, fix in _NOT_PLAIN:
        if test(function):
            raise TypeError(
                f"notebook_launcher runs a plain function on every rank and brings back what "
                f"it returns, but {name} is {kind}: calling it returns an object, and its body "
                f"never runs. {fix.format(name=name)}."
            )


# What each option of notebook_launcher takes, and an example of a good value.
_OPTIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "return_all": ((bool,), "return_all=True"),
    "output": (("all", "main"), 'output="main"'),
    "live": ((bool, LiveView), "live=False"),
    "run": ((Run, type(None)), "run=Run()"),
    "cpu": ((bool, type(None)), "cpu=True"),
    "fsdp": ((bool, type(None)), "fsdp=True"),
    "deepspeed": ((bool, type(None)), "deepspeed=True"),
    "master_addr": ((str, type(None)), 'master_addr="10.0.0.1"'),
}


def check_options(**options: Any) -> None:
    """Options a worker (or the supervisor) would otherwise trip over, refused up front."""
    for name, value in options.items():
        allowed, example = _OPTIONS[name]
        if all(isinstance(a, type) for a in allowed):
            if not isinstance(value, allowed):
                kinds = " or ".join("None" if a is type(None) else a.__name__ for a in allowed)
                raise TypeError(f"{name}={value!r} must be {kinds}, e.g. {example}")
        elif not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{name}={value!r} is not one of {allowed}: e.g. {example}")
    if options.get("master_addr") == "":
        raise ValueError('master_addr="" names no machine: use "127.0.0.1" (one machine)')


# What notebook_launcher's rendezvous is, by the names torch elastic and Accelerate give it.
# Accelerate's notebook_launcher passes "c10d" to torch's elastic launcher with min_nodes equal
# to max_nodes: a fixed number of nodes meeting at master_addr:master_port, which is what this
# launcher's own (authenticated) store does, so both names mean it here.
RENDEZVOUS = ("static", "c10d")


def check_notebook_launch(
    config: LaunchConfig, start_method: Any, monitor_interval: Any, rdzv_backend: Any
) -> None:
    """torch elastic's knobs: honoured, or refused with the reason; never accepted and ignored.
    (``LaunchConfig`` checked the options that ``nbaccel launch`` shares.)"""
    max_restarts, num_nodes = config.max_restarts, config.num_nodes
    if max_restarts and num_nodes > 1:
        raise ValueError(
            f"max_restarts={max_restarts} with num_nodes={num_nodes}: a restart must stop and "
            "restart the workers on every node together, and each node's notebook_launcher "
            "sees only its own. Run a script on each node with `nbaccel launch --max-restarts "
            f"{max_restarts} --num-nodes {num_nodes} ...`, whose torchrun agents restart the "
            "whole job, or keep max_restarts=0 here."
        )
    check_seconds("monitor_interval", monitor_interval, "0.1")
    if not isinstance(rdzv_backend, str):
        raise TypeError(f'rdzv_backend={rdzv_backend!r} must be a string: "static" or "c10d"')
    if rdzv_backend not in RENDEZVOUS:
        raise ValueError(
            f"rdzv_backend={rdzv_backend!r}: notebook_launcher's workers meet at a store this "
            'process hosts, with a fixed world size: "static", or "c10d" as Accelerate\'s '
            "notebook_launcher uses it (the same meeting, on a fixed number of nodes). A "
            "rendezvous where nodes join and leave is torchrun's: run a script with `nbaccel "
            "launch` (torchrun underneath), or drop rdzv_backend here."
        )
    if (start_method or "forkserver") not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not one of {START_METHODS}")
    if not hasattr(os, "fork"):
        raise NbaccelError("notebook_launcher needs a POSIX system (Linux, macOS, WSL)")
    _check_no_process_group()


def _check_no_process_group() -> None:
    import_torch_distributed()  # the first import of a launch: whole even if stopped meanwhile
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise NbaccelError(
            f"a torch.distributed process group is already alive in this kernel (rank "
            f"{dist.get_rank()} of {dist.get_world_size()}). Workers create their own: call "
            "torch.distributed.destroy_process_group() (or accelerator.end_training()) first."
        )
