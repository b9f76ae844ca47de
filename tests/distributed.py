"""Run a test function on several CPU ranks (gloo) and return what each rank returned.

A small stand-in for the launcher: it sets torchrun's variables in each child (never in the
test process), uses a port the OS picked, and kills every child if one fails or hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from nbaccel.env import find_free_port


def move_the_meeting() -> None:
    """In a rank, while its process group lives: agree on a fresh port for the next group, so
    that no rank meets at the old store while rank 0 still closes it. A group destroyed and made
    again at once in the same processes on the same port is a race (torch's): a rank that gets
    there first joins the old store or its old gloo pairs and fails with "Connection closed" or
    "Connection reset by peer"."""
    import torch.distributed as dist

    port = [find_free_port()]
    dist.broadcast_object_list(port, src=0)  # rank 0 hosts the store: its port wins
    os.environ["MASTER_PORT"] = str(port[0])  # this rank's own environment (a child process)


def run_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 180
) -> list:
    """``[fn(*args) on rank 0, fn(*args) on rank 1, ...]``; a rank's exception fails the test.

    ``timeout`` catches hangs, not slowness: a loaded 2-core box takes seconds, not minutes.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, args, rank, world_size, port, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, bytes | str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.5)
                outcomes[rank] = (status, payload)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not results.qsize():
                    raise AssertionError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise AssertionError(f"ranks {missing} hung for {timeout} s") from None
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results.close()
        results.join_thread()
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _child(fn, args, rank, world_size, port, results) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share two cores
    try:
        value = fn(*args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_each(cases: dict[str, Callable[[], Any]]) -> dict[str, tuple[str, Any]]:
    """On one rank, every case in order, each keeping its own error: ``{name: ("ok", value)}``
    or ``{name: ("error", traceback)}``. Starting ranks is the expensive part, so a module
    computes all its cases in one ``run_ranks`` and each test reads one (``values_of``)."""
    out = {}
    for name, case in cases.items():
        try:
            out[name] = ("ok", case())
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


def values_of(results: list[dict], name: str) -> list:
    """Every rank's value of the case ``name`` (``run_each``'s); a rank's error fails the test."""
    values = []
    for rank, result in enumerate(results):
        status, value = result[name]
        assert status == "ok", f"rank {rank}, case {name!r}:\n{value}"
        values.append(value)
    return values
