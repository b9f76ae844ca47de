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

("first 3.5": one that starts the server. Started at a kernel's import, as below, the first
launch after a 10 s pause took 0.045 s: ``benchmarks/results/first-launch-cpu.md``.)

So ``start_method="forkserver"`` (the default) keeps one server per kernel and forks workers from
it. In a Jupyter kernel that server is started when this module is first imported
(``from nbaccel import notebook_launcher``; for ``import nbaccel``, after its cell): what nbaccel
starts at import time, on purpose (``client.prestart``). It costs one core while its interpreter
imports torch (seconds, as you write the next cells), then only its memory (below); it waits in
``select`` until a launch, and ends with the kernel. After the cell, the kernel's own thread loads
the view's matplotlib (0.4 s of one core, 35 MiB) and, if no cell did, the store's
``torch.distributed`` (1 s): never a thread beside the cells, whose imports it would race
(``client.py``). Outside a kernel nothing starts. ``NBACCEL_PRESTART=0`` or ``nbaccel config
--no-prestart`` turns them all off: the first launch then starts the server. A server that died
between launches is said, and replaced by the next launch. ``"spawn"`` starts a fresh server for
this launch alone and shuts it down after, for scripts that want nothing left running. Either way
the function travels by value (cloudpickle), so functions and classes defined in notebook cells
work, and CUDA state in the kernel does not matter: no worker is a fork of the kernel. The price is
the server's own torch import: kernel, server and 2 idle workers hold 429 MiB (PSS) against 186 for
a bare fork; after 20 training steps and a garbage collection (which copies a forked parent's
objects, unless frozen: the server's are) 436 against 438 (``benchmarks/launch.py``).

Options: the arguments, the ``nbaccel config`` file and the machine resolve into one
``LaunchConfig`` (``config.py``), as for ``nbaccel launch``; workers read it back. Rendezvous:
this process hosts torch's TCPStore, on loopback unless ``num_nodes > 1`` (``rendezvous.py``).

Failure: the first real error wins. Every rank's exception travels back as plain data; when any
rank fails, the others get SIGTERM, then SIGKILL after a short grace, and one ``LaunchError``
names the failing rank and shows its traceback (not that of a rank that only lost a peer).

Restarts (``max_restarts``) follow torch elastic's agent: a failed worker group is not patched
up one rank at a time; every worker is stopped, then the whole group meets again and starts
afresh. Here each attempt gets a store of its own (and a new port, unless ``master_port`` fixes
it), so nothing a dead attempt wrote to the store can mislead the next one. Workers read the
attempt number from ``TORCHELASTIC_RESTART_COUNT``, as under torchrun, to resume from a
checkpoint instead of starting over.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from .. import errors
from ..config import LaunchConfig, check_seconds, load_config
from ..env import device_label
from ..errors import NbaccelError, RankFailure
from ..observe.channel import local_run
from ..observe.hang import check_stall_warning
from ..observe.hf.common import empty_hint
from ..observe.live.view import LiveView
from ..observe.rank_recorder import close_all
from ..observe.records import Run
from .arguments import check_call, check_notebook_launch, check_options
from .client import prestart
from .protocol import ExceptionData, pack_call
from .rendezvous import meeting, worker_envs
from .slurm import SlurmCluster
from .supervisor import Attempt, LaunchSpec

if TYPE_CHECKING:
    from ..errors import LaunchError


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
    rdzv_backend: Literal["static", "c10d"] = "static",
    stall_warning: float | None = 60.0,
    cluster: SlurmCluster | None = None,
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
        timeout: seconds; past it the launch stops and names the ranks that had not finished,
            with where each one was: its stack, the collective it waited in, and a desync
            (ranks in different collectives, or one that had returned) named as such. The stop
            button (an interrupt) prints the same before it stops the workers.
        stall_warning: seconds without a step, sample or log from a rank that has not
            finished (once any rank recorded one), after which the cell says where every
            rank is, while the launch goes on; once per stall. ``None``: never.
        return_all: return every local rank's value, in rank order.
        cpu: make the workers' Accelerator use the CPU even where GPUs are visible.
        fsdp: make the workers' ``Accelerator()`` shard with FSDP2 (``FSDPPlugin()``) instead
            of replicating the model with DDP. Default: the ``nbaccel config`` value.
        deepspeed, zero_stage: make the workers' ``Accelerator()`` train through a DeepSpeed
            engine, ``DeepSpeedPlugin(zero_stage=...)``. ``zero_stage`` (0-3) implies
            ``deepspeed=True``; ``deepspeed=True`` alone takes the config's stage, else 2.
        live: draw the live view while the workers train (``observe/live``): a panel in a
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
        cluster: a ``SlurmCluster``: submit to SLURM instead, ``num_nodes`` nodes with
            ``num_processes`` processes each (``slurm.py``); the same value back, one error
            naming the failing rank and its node, output with rank prefixes, the job's queue
            state while it waits, and the stop button (``scancel``).
        rdzv_backend: ``"static"``: the launching process hosts the store the workers meet
            at, with a fixed world size. ``"c10d"`` is taken as Hugging Face Accelerate's
            ``notebook_launcher`` uses it (a fixed number of nodes meeting at ``master_addr``)
            and means the same here. A rendezvous where nodes join and leave (elastic
            ``min:max`` nodes, ``"etcd"``) is torchrun's: use ``nbaccel launch``.

    Raises:
        LaunchError: a worker raised, died, or timed out (also torch's ``ChildFailedError``,
            so code written for torchrun or Accelerate that catches it works unchanged); the
            message holds its traceback
            (with ``max_restarts``, the last attempt's, after a line per earlier attempt).
            Also a returned value that cannot be rebuilt in this process (a prepared model):
            the error names the rank and the value's type, says what to return instead, and
            keeps the values that did come back in ``.results`` ({rank: value}). Only the
            values the call returns can fail it: rank 0's, unless ``return_all``.
    """
    check_call(function, args, kwargs)  # each argument checked before any worker starts
    timeout = check_seconds(
        "timeout", timeout, "600", none="wait as long as it takes", default=False
    )
    check_options(return_all=return_all, output=output, live=live, run=run)
    check_options(cpu=cpu, fsdp=fsdp, deepspeed=deepspeed, master_addr=master_addr)
    stall_warning = check_stall_warning(stall_warning)
    asked = {  # what every launch is asked; on a cluster, also where the nodes are
        "num_processes": num_processes,
        "mixed_precision": mixed_precision,
        "cpu": cpu,
        "fsdp": fsdp,
        "deepspeed": deepspeed,
        "zero_stage": zero_stage,
    }
    if cluster is not None:  # the nodes meet where SLURM puts them: no address to give
        config = LaunchConfig.from_arguments(**asked, defaults=load_config())
        on = (num_nodes, cluster, return_all, timeout, _view(live, function), run)
        return _run_on_cluster(function, args, kwargs, config, *on)
    config = LaunchConfig.from_arguments(
        **asked,
        num_nodes=num_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
        defaults=load_config(),
    )
    check_notebook_launch(config, start_method, monitor_interval, rdzv_backend)
    run = run if run is not None else Run()
    run.world_size = config.world_size
    run.device = device_label("cuda" if config.gpus else "cpu")  # what the workers pick
    kwargs = dict(kwargs or {})  # any mapping; a plain dict travels
    with _launch_slot():
        if config.world_size == 1 and start_method is None and not max_restarts:
            values = [_run_here(function, args, kwargs, config, run)]  # in this process
        else:
            watch = {"start_method": start_method or "forkserver", "timeout": timeout}
            watch |= {"output": output, "monitor_interval": monitor_interval}
            watch |= {"stall_warning": stall_warning, "return_all": return_all}
            view = _view(live, function)
            values = _run_workers(pack_call(function, args, kwargs), config, watch, view, run)
    return values if return_all else values[0]


def _run_on_cluster(
    function, args, kwargs, config, nodes, cluster, return_all, timeout, live, run
) -> Any:
    from .slurm import launch

    if not isinstance(cluster, SlurmCluster):
        raise NbaccelError(f"cluster={cluster!r}: give a SlurmCluster(partition=..., time=...)")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise NbaccelError(f"num_nodes={nodes!r}: give the number of nodes, an int >= 1")
    environ = {k: v for k, v in config.to_environ({}).items() if k != "OMP_NUM_THREADS"}
    payload = pack_call(function, args, dict(kwargs or {}))
    run = run if run is not None else Run()
    run.world_size = nodes * config.num_processes
    run.device = device_label("cuda" if cluster.gpus_per_node else "cpu")
    view = live if isinstance(live, LiveView) else LiveView() if live else None
    run.started = time.time()  # the launch's clock, as a local launch's (``Run.timing``)
    try:
        on = (config.num_processes, nodes, cluster, return_all, timeout, run, view)
        values = launch(payload, environ, *on)
    finally:
        run.finished = time.time()
        if view is not None:
            view.close(run)
    return values if return_all else values[0]


def _view(live: bool | LiveView, function: Callable) -> LiveView | None:
    """The launch's view (None: ``live=False``), naming ``function``'s integration if empty."""
    if not live:
        return None
    view = live if isinstance(live, LiveView) else LiveView()
    view.empty_hint = empty_hint(function)
    return view


def _run_workers(payload: bytes, config: LaunchConfig, watch: dict, live, run: Run) -> list[Any]:
    """Start the workers, and again after a failure while ``config.max_restarts`` allow."""
    view = live if isinstance(live, LiveView) else LiveView() if live else None

    def start(port: int, attempt: int) -> Attempt:
        envs = worker_envs(config, port, attempt)
        spec = LaunchSpec(envs, payload, int(envs[0]["OMP_NUM_THREADS"]), **watch)
        return Attempt(spec, run=run, view=view)

    try:
        return _attempts(config, start, run)
    finally:
        if view is not None:
            view.close(run)


def _attempts(config: LaunchConfig, start, run: Run) -> list[Any]:
    """Launch until an attempt succeeds, fails in a way no restart cures, or none are left."""
    max_restarts = config.max_restarts
    attempt, attempts, earlier = 0, max_restarts + 1, []
    while True:
        if attempt:  # the Run starts over with the workers: records from step 0 again
            run.reset()
        with meeting(config) as port:  # a new store for every attempt: nothing stale in it
            run.started = time.time()
            this = start(port, attempt)
            try:
                return this.execute()
            except errors.LaunchError as err:
                if not max_restarts:
                    raise
                if not this.worker_failed or attempt == max_restarts:
                    raise _attempts_error(err, earlier, this, max_restarts) from None
                earlier.append(err.root_cause.describe() if err.root_cause else str(err))
                print(
                    f"nbaccel: attempt {attempt + 1} of {attempts} failed: {earlier[-1]}. "
                    f"Restarting all {len(this.spec.envs)} workers, attempt {attempt + 2} of "
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
        why = (
            "a timeout"
            if last.timed_out
            else "a failure of nbaccel's fork server"
            if last.server_died
            else "a value that cannot come back to this process"
        )
        header = (
            f"attempt {made} of up to {max_restarts + 1} ended in {why}, which is not restarted "
            "(only a worker that raised or died is)"
        )
    lines = [f"{header}.", *(f"  attempt {i}: {c}" for i, c in enumerate(earlier, 1))]
    lines += ["", f"attempt {made}: {err}"]
    return errors.LaunchError("\n".join(lines), err.failures, err.run, results=err.results)


# Process-wide on purpose: every launch of this process reads the one shared fork server's
# socket (``client.shared_server``), and a one-process launch sets torchrun's variables in this
# process's os.environ; two launches at once (from threads) would take each other's exit
# reports and variables, so a second one is refused, not queued.
_launch_lock = threading.Lock()


@contextmanager
def _launch_slot():
    if not _launch_lock.acquire(blocking=False):
        raise NbaccelError("another notebook_launcher call is still running in this process")
    try:
        yield
    finally:
        _launch_lock.release()


def _run_here(function, args, kwargs, config: LaunchConfig, run: Run) -> Any:
    """One process: run here, with a worker's environment and errors, recording into ``run``."""
    with meeting(config) as port:
        run.started = time.time()
        value = _call_here(function, args, kwargs, worker_envs(config, port, 0)[0], run)
        run.results, run.finished = {0: value}, time.time()
    return value


def _call_here(function, args, kwargs, env: dict[str, str], run: Run) -> Any:
    from ..tensors import to_cpu

    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    saved = {k: os.environ.get(k) for k in changed}
    os.environ.update(changed)
    token = local_run.set(run)
    try:
        return to_cpu(function(*args, **kwargs))
    except SystemExit as exit_:  # sys.exit(...), as a worker's: 0 or None a plain end
        if exit_.code in (None, 0):
            return None
        code, message = (exit_.code, "") if isinstance(exit_.code, int) else (1, str(exit_.code))
        failure = RankFailure(0, os.getpid(), code, "SystemExit", message)
        raise errors.LaunchError(f"{failure.describe()} (traceback above)", [failure]) from exit_
    except Exception as err:
        message = ExceptionData.of(err).message  # whatever its __str__ does
        failure = RankFailure(0, os.getpid(), None, type(err).__qualname__, message)
        raise errors.LaunchError(f"{failure.describe()} (traceback above)", [failure]) from err
    finally:
        close_all()  # what a function without end_training() left: its last numbers and drawing
        local_run.reset(token)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


prestart()  # in a Jupyter kernel only: the module docstring says what, when and at what cost
