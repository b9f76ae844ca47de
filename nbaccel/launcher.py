"""``notebook_launcher``: run a function on N worker processes from a notebook cell.

How workers start (the one decision that matters most here). Medians from
``benchmarks/launch.py`` on a shared 2-core CPU box (``benchmarks/results/launch-cpu.md``):

=====================  ===========  =========================================================
start method           trivial      safe after the kernel trained with torch / touched CUDA?
                       2-worker
=====================  ===========  =========================================================
plain ``fork``         0.13 s       no: a forked OpenMP pool can deadlock the children when
                                    they use more than one thread; CUDA cannot be forked
``spawn``              3-4.5 s      yes, but pays the torch import in every worker, every time
fork server (default)  0.07-0.12 s  yes: workers fork from a fresh interpreter that imported
                       (first 3.5)    torch and never ran a torch op (``forkserver.py``)
=====================  ===========  =========================================================

So ``start_method="forkserver"`` (the default) keeps one server per kernel and forks workers
from it; ``"spawn"`` starts a fresh server for this launch alone and shuts it down after, for
scripts that want nothing left running. Either way the function travels by value (cloudpickle),
so functions and classes defined in notebook cells work, and CUDA state in the kernel does not
matter: no worker is a fork of the kernel. The price: the server's own memory, a fixed ~60 MiB
(PSS) per kernel; the workers' memory equals bare fork's.

Rendezvous: the launching process hosts torch's TCPStore on a socket it bound itself (port 0:
the OS picks a free one, no race), on loopback unless ``num_nodes > 1``; workers join it as
clients, exactly as under torchrun's agent. The store, and so the port, go away when the launch
returns or fails.

Failure: the first real error wins. Every rank's exception travels back as plain data; when any
rank fails, the others get SIGTERM, then SIGKILL after a short grace, and one ``LaunchError``
names the failing rank and shows its own traceback. A rank that fails only because a peer
vanished mid-collective ("connection closed by peer") is reported after the rank that caused it.

Restarts (``max_restarts``) follow torch elastic's agent: a failed worker group is not patched
up one rank at a time; every worker is stopped, then the whole group meets again and starts
afresh. Here each attempt gets a store of its own (and a new port, unless ``master_port`` fixes
it), so nothing a dead attempt wrote to the store can mislead the next one. Workers read the
attempt number from ``TORCHELASTIC_RESTART_COUNT``, as under torchrun, to resume from a
checkpoint instead of starting over.
"""

from __future__ import annotations

import collections
import datetime
import io
import logging
import math
import os
import pickle
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

from .config import load_config, resolve_sharding
from .display import LiveView
from .env import (
    CPU_VAR,
    DEEPSPEED_VAR,
    FSDP_VAR,
    MIXED_PRECISION_VAR,
    accelerate_defaults,
    threads_per_worker,
    visible_gpus,
)
from .errors import LaunchError, NbaccelError, RankFailure
from .metrics import Run, local_run
from .precision import check_mode
from .supervisor import Launch

logger = logging.getLogger(__name__)
START_METHODS = ("forkserver", "spawn")


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_processes: int | None = None,
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    num_nodes: int = 1,
    node_rank: int = 0,
    start_method: Literal["forkserver", "spawn"] | None = None,
    timeout: float | None = None,
    return_all: bool = False,
    output: Literal["all", "main"] = "all",
    cpu: bool | None = None,
    live: bool | LiveView = True,
    run: Run | None = None,
    fsdp: bool | None = None,
    deepspeed: bool | None = None,
    zero_stage: int | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    rdzv_backend: Literal["static"] = "static",
) -> Any:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` workers; return rank 0's value.

    >>> def train(lr):
    ...     from nbaccel import Accelerator
    ...     return Accelerator().num_processes * lr
    >>> notebook_launcher(train, args=(0.5,), num_processes=2, cpu=True)  # doctest: +SKIP
    1.0

    Each worker gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and the launch defaults (``mixed_precision``, ``cpu``), so
    ``Accelerator()`` inside needs no arguments. Workers' prints appear here, each line prefixed
    with its rank (``output="main"`` shows rank 0 only).

    Args:
        num_processes: workers on this machine. Default: the ``nbaccel config`` value, else one
            per visible GPU, else 1. One process runs here, in this process, unless a
            ``start_method`` is given.
        mixed_precision: the default for ``Accelerator()`` in the workers.
        master_addr, master_port, num_nodes, node_rank: for several machines; run the same cell
            on each with its ``node_rank``. ``master_port`` defaults to a free port (one node).
        start_method: ``"forkserver"`` (default) or ``"spawn"``, see the module docstring.
        timeout: seconds; past it the launch stops and names the ranks that had not finished.
        return_all: return every local rank's value, in rank order.
        cpu: make the workers' Accelerator use the CPU even where GPUs are visible.
        fsdp: make the workers' ``Accelerator()`` shard with FSDP2 (``FSDPPlugin()``) instead
            of replicating the model with DDP. Default: the ``nbaccel config`` value.
        deepspeed, zero_stage: make the workers' ``Accelerator()`` train through a DeepSpeed
            engine, ``DeepSpeedPlugin(zero_stage=...)``. ``zero_stage`` (0-3) implies
            ``deepspeed=True``; ``deepspeed=True`` alone takes the config's stage, else 2.
        live: draw the live view while the workers train (``display.py``): a panel in a
            notebook, a progress line on stderr elsewhere; or pass your own ``LiveView``.
        run: a ``Run`` to fill with every rank's metrics, results and failures; the return
            value stays rank 0's result. (A ``LaunchError`` carries it as ``.run``.)
        max_restarts: as torch elastic's: when a worker raises or dies, stop every worker and
            start them all again, up to this many times; the first attempt that succeeds gives
            the result. Each attempt meets at a new rendezvous, has its own ``timeout``, and
            tells its workers its number in ``TORCHELASTIC_RESTART_COUNT`` (0 first); ``run``
            and the live view show the latest attempt. A timeout, a stop (Ctrl-C, the kernel's
            interrupt) and a lost fork server are not restarted. With ``max_restarts > 0`` one
            process also runs in a worker, so that each attempt starts afresh (a retry in this
            process would inherit what the failed one left behind). Several nodes: refused;
            a restart must restart every node together, which ``nbaccel launch --max-restarts
            N`` (torchrun's agents) does.
        monitor_interval: seconds the launcher waits at most between its checks of the workers
            (the ``timeout``, the grace before SIGKILL, the live view), as torch elastic's
            agent polls at this interval (default 0.1 s too). Unlike that agent's, a worker's
            exit or error is heard the moment it happens, not at the next check. One process
            running in this process has nothing to check.
        rdzv_backend: only ``"static"``, what this launcher does: the launching process hosts
            the store the workers meet at, with a fixed world size. Elastic rendezvous
            (``"c10d"``, ``"etcd"``), where nodes may join and leave, is torchrun's: use
            ``nbaccel launch``.

    Raises:
        LaunchError: a worker raised, died, or timed out; the message holds its traceback
            (with ``max_restarts``, the last attempt's, after a line per earlier attempt).
    """
    _check_function(function)
    if not isinstance(args, list | tuple):
        raise TypeError(
            f"args must be a tuple of arguments, got {type(args).__name__}: "
            f"use args=({args!r},) for a single argument"
        )
    config = load_config()
    cpu = config.cpu if cpu is None else bool(cpu)
    fsdp, zero_stage = resolve_sharding(config, fsdp, deepspeed, zero_stage)
    mixed_precision = check_mode(mixed_precision or config.mixed_precision)
    gpus = 0 if cpu else visible_gpus()
    if num_processes is None:
        num_processes = config.num_processes or max(gpus, 1)
    _check_counts(num_processes, gpus, num_nodes, node_rank, master_port)
    _check_restarts(max_restarts, monitor_interval, rdzv_backend, num_nodes)
    in_process = num_processes * num_nodes == 1 and start_method is None and not max_restarts
    start_method = start_method or "forkserver"
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not one of {START_METHODS}")
    if not hasattr(os, "fork"):
        raise NbaccelError("notebook_launcher needs a POSIX system (Linux, macOS, WSL)")
    _check_no_process_group()

    world_size = num_processes * num_nodes
    threads = threads_per_worker(num_processes)
    defaults = {
        MIXED_PRECISION_VAR: mixed_precision,
        CPU_VAR: "1" if cpu else "0",
        FSDP_VAR: "1" if fsdp else "0",
        DEEPSPEED_VAR: "" if zero_stage is None else str(zero_stage),
        "OMP_NUM_THREADS": str(threads),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store below is the rendezvous
    }
    defaults.update(accelerate_defaults(gpus, mixed_precision))
    loopback = _loopback_interface() if num_nodes == 1 else None
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        defaults["GLOO_SOCKET_IFNAME"] = loopback  # gloo's own sockets stay on this machine too
    common = {**os.environ, **defaults, "MASTER_ADDR": master_addr}

    def envs(port: int, attempt: int) -> list[dict[str, str]]:
        """torchrun's variables for each worker, at this rendezvous, in this attempt."""
        return [
            {
                **common,
                "MASTER_PORT": str(port),
                "RANK": str(node_rank * num_processes + local_rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(num_processes),
                "GROUP_RANK": str(node_rank),
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
                "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            }
            for local_rank in range(num_processes)
        ]

    def rendezvous():
        return _rendezvous(num_nodes, node_rank, master_addr, master_port)

    run = run if run is not None else Run()
    run.world_size = world_size
    run.device = "GPU" if gpus else "CPU"  # what the workers' Accelerator picks
    with _launch_slot():
        if in_process:  # here, in this process; its Accelerator draws its own view
            with rendezvous() as port:
                run.started = time.time()
                values = [_run_here(function, args, kwargs or {}, envs(port, 0)[0], run)]
                run.results, run.finished = {0: values[0]}, time.time()
        else:
            payload = _serialize(function, args, kwargs or {})
            view = live if isinstance(live, LiveView) else LiveView() if live else None

            def start(port: int, attempt: int) -> Launch:
                return Launch(
                    start_method, envs(port, attempt), threads, payload, timeout, output, run,
                    view, monitor_interval,
                )  # fmt: skip

            try:
                values = _attempts(max_restarts, rendezvous, start, run)
            finally:
                if view is not None:
                    view.close(run)
    return values if return_all else values[0]


def _attempts(max_restarts: int, rendezvous, start, run: Run) -> list[Any]:
    """Launch until an attempt succeeds, fails in a way no restart cures, or none are left."""
    attempt, attempts, earlier = 0, max_restarts + 1, []
    while True:
        if attempt:  # the Run starts over with the workers: records from step 0 again
            run.reset()
        with rendezvous() as port:  # a new store for every attempt: nothing stale in it
            run.started = time.time()
            launch = start(port, attempt)
            try:
                return launch.execute()
            except LaunchError as err:
                if not max_restarts:
                    raise
                if not launch.worker_failed or attempt == max_restarts:
                    raise _attempts_error(err, earlier, launch, max_restarts) from None
                earlier.append(err.root_cause.describe() if err.root_cause else str(err))
                print(
                    f"nbaccel: attempt {attempt + 1} of {attempts} failed: {earlier[-1]}. "
                    f"Restarting all {len(launch.envs)} workers, attempt {attempt + 2} of "
                    f"{attempts}.",
                    file=sys.stderr,
                    flush=True,
                )
        attempt += 1


def _attempts_error(err: LaunchError, earlier: list[str], last, max_restarts: int) -> LaunchError:
    made = len(earlier) + 1
    if last.worker_failed:
        header = f"all {made} attempts failed (max_restarts={max_restarts})"
    else:
        why = "a timeout" if last.timed_out else "a failure of nbaccel's fork server"
        header = (
            f"attempt {made} of up to {max_restarts + 1} ended in {why}, which is not restarted "
            "(only a worker that raised or died is)"
        )
    lines = [f"{header}.", *(f"  attempt {i}: {c}" for i, c in enumerate(earlier, 1))]
    lines += ["", f"attempt {made}: {err}"]
    return LaunchError("\n".join(lines), err.failures, err.run)


# -- preflight -----------------------------------------------------------------------------------
def _check_function(function: Any) -> None:
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs the function itself, but got a {type(function).__name__} "
            "(did you call it?). Write notebook_launcher(train, args=(...)), "
            "not notebook_launcher(train(...))."
        )


def _check_counts(n: Any, gpus: int, num_nodes: Any, node_rank: Any, master_port: Any) -> None:
    for name, value in (("num_processes", n), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int, e.g. {name}=2")
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if gpus and n > gpus:
        raise ValueError(
            f"num_processes={n} but this machine has {gpus} visible GPU(s): one worker per GPU. "
            f"Use num_processes<={gpus}, or cpu=True to run {n} workers on the CPU."
        )
    if (
        isinstance(node_rank, bool)
        or not isinstance(node_rank, int)
        or not 0 <= node_rank < num_nodes
    ):
        raise ValueError(f"node_rank={node_rank!r} must be an int in 0..{num_nodes - 1}")
    if num_nodes > 1 and master_port is None:
        raise ValueError(
            "several nodes must agree on where to meet: pass the same master_addr (node 0's "
            "address) and master_port (a free port on node 0) on every node"
        )


def _check_restarts(
    max_restarts: Any, monitor_interval: Any, rdzv_backend: Any, num_nodes: int
) -> None:
    """torch elastic's knobs: honoured, or refused with the reason; never accepted and ignored."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int):
        raise TypeError(f"max_restarts={max_restarts!r} must be an int, e.g. max_restarts=2")
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts} must be 0 (no restarts) or more")
    if max_restarts and num_nodes > 1:
        raise ValueError(
            f"max_restarts={max_restarts} with num_nodes={num_nodes}: a restart must stop and "
            "restart the workers on every node together, and each node's notebook_launcher "
            "sees only its own. Run a script on each node with `nbaccel launch --max-restarts "
            f"{max_restarts} --num-nodes {num_nodes} ...`, whose torchrun agents restart the "
            "whole job, or keep max_restarts=0 here."
        )
    if isinstance(monitor_interval, bool) or not isinstance(monitor_interval, int | float):
        raise TypeError(
            f"monitor_interval={monitor_interval!r} must be a number of seconds, e.g. 0.1"
        )
    if not (monitor_interval > 0 and math.isfinite(monitor_interval)):
        raise ValueError(
            f"monitor_interval={monitor_interval} must be a positive, finite number of "
            "seconds, e.g. 0.1 (the default)"
        )
    if not isinstance(rdzv_backend, str):
        raise TypeError(f'rdzv_backend={rdzv_backend!r} must be a string: use "static"')
    if rdzv_backend != "static":
        raise ValueError(
            f"rdzv_backend={rdzv_backend!r}: notebook_launcher's rendezvous is static (this "
            'process hosts the store, the world size is fixed), so it takes only "static". '
            "Elastic rendezvous, where nodes may join and leave, is torchrun's: run a script "
            f"with `nbaccel launch` (torchrun underneath), or drop rdzv_backend here."
        )


def _check_no_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise NbaccelError(
            f"a torch.distributed process group is already alive in this kernel (rank "
            f"{dist.get_rank()} of {dist.get_world_size()}). Workers create their own: call "
            "torch.distributed.destroy_process_group() (or accelerator.end_training()) first."
        )


def _loopback_interface() -> str | None:
    """The network interface that holds 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def _serialize(function, args, kwargs) -> bytes:
    import cloudpickle

    def code_with_filename(code: types.CodeType):
        # cloudpickle replaces the file name of code it sends by value with "<dynamic-code>";
        # keeping the real one lets a worker's traceback point at the notebook cell.
        rebuild, fields = cloudpickle.cloudpickle._code_reduce(code)
        return rebuild, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)

    class Pickler(cloudpickle.Pickler):
        dispatch_table: ClassVar = collections.ChainMap(
            {types.CodeType: code_with_filename}, cloudpickle.Pickler.dispatch_table
        )

    buffer = io.BytesIO()
    try:
        Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((function, tuple(args), kwargs))
        return buffer.getvalue()
    except Exception as err:
        raise TypeError(
            f"cannot send {getattr(function, '__name__', function)!r} and its arguments to the "
            f"workers: {err}. Create unpicklable objects (open files, locks, CUDA tensors) "
            "inside the function instead of passing them in."
        ) from err


_launch_lock = threading.Lock()  # process-wide: one launch at a time per kernel


@contextmanager
def _launch_slot():
    if not _launch_lock.acquire(blocking=False):
        raise NbaccelError("another notebook_launcher call is still running in this process")
    try:
        yield
    finally:
        _launch_lock.release()


@contextmanager
def _rendezvous(num_nodes: int, node_rank: int, master_addr: str, master_port: int | None):
    """Host the TCPStore on node 0; yield the port the workers meet on.

    With several nodes, node 0 keeps the store until every node's workers are done (each node
    says so on its way out), as torchrun's agents do: a node whose workers finish first must
    not pull the store from under the others.
    """
    import torch.distributed as dist

    if node_rank != 0:
        try:
            yield master_port
        finally:
            _say_done(master_addr, master_port, node_rank)
        return
    host = "127.0.0.1" if num_nodes == 1 else "0.0.0.0"  # loopback unless asked for more
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, master_port or 0))
    except OSError as err:
        sock.close()
        raise NbaccelError(
            f"cannot listen on {host}:{master_port}: {err.strerror}. Another job holds that port; "
            "pick another master_port, or leave it out on one machine to get a free one."
        ) from err
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, master_listen_fd=sock.detach(), wait_for_workers=False
    )
    succeeded = False
    try:
        yield port
        succeeded = True
    finally:
        if num_nodes > 1:
            keys = [f"nbaccel/done/{k}" for k in range(1, num_nodes)]
            wait = datetime.timedelta(seconds=120 if succeeded else 5)
            try:
                store.wait(keys, wait)
            except Exception:  # a node that died never says so; it has had its time
                logger.warning("not every node reported back within %s; closing the store", wait)
        del store  # closes the listening socket: the port is free again


def _say_done(master_addr: str, master_port: int | None, node_rank: int) -> None:
    import torch.distributed as dist

    try:
        client = dist.TCPStore(
            master_addr, master_port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        client.set(f"nbaccel/done/{node_rank}", "1")
    except Exception:
        pass  # node 0 is already gone: nothing waits for us


def _run_here(function, args, kwargs, env: dict[str, str], run: Run) -> Any:
    """One process: run in this process, with the same environment and errors as workers;
    an Accelerator created inside records into ``run``."""
    from .data import to_cpu

    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    saved = {k: os.environ.get(k) for k in changed}
    os.environ.update(changed)
    token = local_run.set(run)
    try:
        return to_cpu(function(*args, **kwargs))
    except Exception as err:
        failure = RankFailure(0, os.getpid(), None, type(err).__qualname__, str(err))
        raise LaunchError(f"{failure.describe()} (traceback above)", [failure]) from err
    finally:
        local_run.reset(token)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
