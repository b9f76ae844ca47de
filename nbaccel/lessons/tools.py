"""Small measuring tools the lessons share: accuracy, parameter bytes, all-reduce counts,
each rank's bytes of model state under DDP, FSDP2 and DeepSpeed, the CPU time of work run in
threads or processes, and a check for an optional package that a section needs."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.data import Dataset

from nbaccel.errors import NbaccelError


@torch.no_grad()
def accuracy(model: torch.nn.Module, dataset: Dataset, batch_size: int = 512) -> float:
    """Fraction of ``(input, label)`` pairs the model classifies right, computed on the CPU."""
    was_training = model.training
    model.eval()
    right = total = 0
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    for inputs, labels in loader:
        predicted = model(inputs.to(device)).argmax(dim=1).cpu()
        right += (predicted == labels).sum().item()
        total += len(labels)
    model.train(was_training)
    return right / total


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes that one all-reduce of all gradients moves per rank: what DDP synchronises."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of model state, as the ZeRO paper counts it, for a prepared model.

    Works under DDP, FSDP2 and DeepSpeed (any stage) by walking the tensors that the model, its
    gradients and the optimizer (with DeepSpeed's wrapper) hold, each storage counted once:

    * ``parameters``: the weights this rank keeps (a shard under FSDP2 and ZeRO 3);
    * ``gradients``: this rank's gradients (a shard under FSDP2 and ZeRO 3; ZeRO 1 keeps them
      whole through a window, only its partition once they are reduced at the window's end;
      ZeRO 2 keeps, after each micro-batch, every gradient tensor that reaches into its
      partition, whole: above 2 bytes x its partition's elements by at most the tensors that
      straddle the partition's two edges);
    * ``optimizer``: optimizer state plus DeepSpeed's float32 master weights;
    * ``other``: any other tensor DeepSpeed's optimizer wrapper holds directly.

    Call it after ``backward`` and before ``optimizer.step()`` on a step after the first, when
    gradients and optimizer state both exist. Under DeepSpeed, ``backward`` on a window's last
    micro-batch has already run the engine's step, which frees ZeRO 1-2's gradients: they
    count 0 there. To measure them, accumulate (``gradient_accumulation_steps`` > 1) and call
    it after the ``backward`` of a micro-batch before a window's last (lesson 6 does). Under
    FSDP2, call it on a window's last micro-batch: inside ``no_sync`` FSDP2 accumulates
    unsharded gradients in buffers of its own, which this does not see. DDP's own gradient
    buckets live in C++ and are not counted (with ``gradient_as_bucket_view=False``, PyTorch's
    default, they are another copy of the gradients).
    """
    seen: set[int] = set()
    sizes = {"parameters": 0, "gradients": 0, "optimizer": 0, "other": 0}

    def add(kind: str, obj: object, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", obj)  # a DTensor's shard
            storage = local.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                sizes[kind] += storage.nbytes()
            if obj.grad is not None:
                add("gradients", obj.grad)
        elif depth < 3 and isinstance(obj, list | tuple):
            for item in obj:
                add(kind, item, depth + 1)
        elif depth < 3 and isinstance(obj, dict):
            for item in obj.values():
                add(kind, item, depth + 1)

    module = getattr(model, "module", model)
    for p in module.parameters():
        add("parameters", getattr(p, "ds_tensor", None))  # ZeRO 3: p itself is a placeholder
        add("parameters", p)
    wrapper = getattr(model, "optimizer", None)  # a DeepSpeed engine's ZeRO optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # nbaccel's wrapper holds the torch one
    for state in inner.state.values():
        add("optimizer", state)
    if wrapper is not None and wrapper is not inner:
        for name, value in vars(wrapper).items():
            kind = "gradients" if "grad" in name else "optimizer" if "fp32" in name else "other"
            add("parameters" if "fp16_partitioned" in name else kind, value)
    return sizes


class AllReduceCounter:
    """Counts the all-reduces a DDP model launches, and the bytes they carry.

    ``counter = AllReduceCounter(ddp_model)`` installs a communication hook that counts each
    gradient bucket, then runs PyTorch's ordinary all-reduce. Works on any backend.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"AllReduceCounter needs the DDP-wrapped model (got {type(model).__name__}); "
                "with one process there is nothing to all-reduce"
            )
        self.calls = 0
        self.bytes = 0

        def hook(process_group, bucket):
            self.calls += 1
            self.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(process_group, bucket)

        model.register_comm_hook(None, hook)


def machine() -> str:
    """What a measurement ran on, to print beside it: ``"CPU: <model>, 2 cores"`` or the GPUs.

    Figures from a CPU are CPU figures; a lesson labels every table with this line.
    """
    import os
    import platform

    from nbaccel.env import usable_cores

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"GPU: {', '.join(names)} (torch {torch.__version__})"
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), model)
    return f"CPU: {model}, {usable_cores()} cores (torch {torch.__version__})"


def needs(module: str, skipped: str, package: str | None = None) -> bool:
    """True when ``module`` is installed here. Otherwise print one line that says what is
    skipped and how to install ``package`` (default: the module's name) into this kernel's own
    environment, whatever PATH says (IPython's ``%pip`` runs this kernel's pip; a printed path to
    the interpreter would name the machine that ran the lesson); the lesson then runs the rest
    and adapts its checks.

    >>> needs("torch", "nothing")
    True
    """
    if importlib.util.find_spec(module) is not None:
        return True
    print(
        f"Skipped: {skipped}, which needs {package or module}, not installed here. To run it: "
        f"%pip install {package or module}, then restart the kernel."
    )
    return False


@contextlib.contextmanager
def cpu_broadcast() -> Iterator[None]:
    """Inside this block, ``torch.nn.parallel.replicate(module, [0, 1, ...])`` works on a CPU
    module: torch's own ``replicate`` runs, with only its one CUDA-only step replaced.

    ``replicate`` (what ``nn.DataParallel`` calls at every forward) does three things:

    1. broadcasts the parameters to every device (``Broadcast``, an autograd function built on
       ``torch.cuda.comm.broadcast_coalesced``): the first device keeps the module's own tensors,
       each other device gets a copy, and the backward sums the copies' gradients;
    2. broadcasts the buffers the same way (detached, unless a buffer requires grad);
    3. makes a *shallow* copy of every submodule for each replica
       (``Module._replicate_for_data_parallel``: a new object sharing the original's attributes,
       with its own dicts of children, parameters and buffers) and sets the broadcast tensors on
       them as plain attributes.

    ``Broadcast`` refuses CPU tensors, so in this block steps 1 and 2 are done by ``clone()``
    (a differentiable copy, whose backward also sums) for every replica but the first, which
    keeps the module's tensors as on a GPU. Step 3 and the wiring are torch's code, unchanged.
    What a GPU adds, copying the bytes over PCIe or NVLink, is not in it.
    """
    from unittest import mock

    replicate_module = sys.modules["torch.nn.parallel.replicate"]

    def broadcast(tensors, devices, detach=False):
        def copy(tensor: torch.Tensor, first: bool) -> torch.Tensor:
            tensor = tensor.detach() if detach else tensor
            return tensor.view_as(tensor) if first else tensor.clone()

        return [[copy(t, first=j == 0) for t in tensors] for j in range(len(devices))]

    with mock.patch.object(replicate_module, "_broadcast_coalesced_reshape", broadcast):
        yield


def ring_all_reduce_steps(chunks: list[list], add=None) -> tuple[list[list[list]], list[list]]:
    """Lesson 2's ring all-reduce, simulated in one process, step by step.

    ``chunks[r][c]`` is rank r's chunk c (N ranks, N chunks each: tensors, numbers, or anything
    ``add`` combines; default ``+``). At reduce-scatter step s, rank r sends its chunk
    (r - s) mod N to rank r + 1, which adds it into its own; at all-gather step s, rank r sends
    chunk (r + 1 - s) mod N, which the receiver copies. Returns ``(states, sends)``: the ranks'
    chunks at the start and after each of the 2(N - 1) steps, and for each step the
    ``(sender, receiver, chunk)`` triples.
    """
    import operator

    add = add or operator.add
    n = len(chunks)
    states, sends = [[list(row) for row in chunks]], []
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            state = [list(row) for row in states[-1]]
            offset = 0 if phase == "reduce-scatter" else 1
            moves = [(r, (r + 1) % n, (r + offset - step) % n) for r in range(n)]
            for src, dst, c in moves:  # every rank sends at once: read the state before the step
                sent = states[-1][src][c]
                state[dst][c] = add(states[-1][dst][c], sent) if offset == 0 else sent
            states.append(state)
            sends.append(moves)
    return states, sends


def python_work(steps: int) -> int:
    """``steps`` turns of a loop of integer arithmetic: pure Python, which holds the GIL all
    along (no call in it releases the lock, unlike torch's operators). Returns the sum of
    ``i * i`` for ``i < steps``, modulo 1,000,003, so that a caller can check the work was done.

    >>> python_work(4)  # 0 + 1 + 4 + 9
    14
    """
    total = 0
    for i in range(steps):
        total = (total + i * i) % 1_000_003
    return total


@dataclass(frozen=True)
class WorkerTimes:
    """What ``time_workers`` measured: per worker, its id (a thread's ident or a process's
    pid), its result and the CPU seconds it used for the work; and the wall seconds from the
    first worker's start to the last one's end."""

    kind: Literal["threads", "processes"]
    ids: tuple[int, ...]
    results: tuple
    cpu_seconds: tuple[float, ...]
    wall_seconds: float

    @property
    def cores_busy(self) -> float:
        """CPU seconds per wall second: how many cores the workers kept busy, on average."""
        return sum(self.cpu_seconds) / self.wall_seconds


START_TIMEOUT = 120  # seconds a worker waits for the others to start (a spawn imports torch)


def _timed(fn: Callable, args: tuple, clock: Callable, ident: Callable, barrier) -> tuple:
    """Run fn(*args) once every worker is ready; its CPU time by ``clock``, and when it ran."""
    barrier.wait(timeout=START_TIMEOUT)
    start, cpu = time.monotonic(), clock()  # monotonic is system-wide: one clock for all
    result = fn(*args)
    return ident(), result, clock() - cpu, start, time.monotonic()


def _process_worker(index: int, fn: Callable, args: tuple, barrier, results) -> None:
    import traceback

    try:
        results.put((index, True, _timed(fn, args, time.process_time, os.getpid, barrier)))
    except BaseException:
        results.put((index, False, traceback.format_exc()))


def time_workers(
    fn: Callable,
    *args,
    workers: int = 2,
    kind: Literal["threads", "processes"] = "threads",
) -> WorkerTimes:
    """Run ``fn(*args)`` in ``workers`` threads of this process, or in as many processes, all
    at once, and measure the CPU time each used for it and the wall time they took together.

    A worker starts its clocks when all are ready (start-up is not counted). A thread reads
    ``time.thread_time()``, its own CPU time; a process reads ``time.process_time()``, all its
    threads. Processes are *spawned* (a fresh interpreter each, as on macOS and Windows), so
    ``fn`` must be importable by name: a function defined in a notebook is not, and is refused.
    A thread's exception propagates; a process's raises ``NbaccelError`` with its traceback.

    >>> times = time_workers(python_work, 1000)
    >>> times.results == (python_work(1000),) * 2 and len(set(times.ids)) == 2
    True
    """
    if kind not in ("threads", "processes"):
        raise ValueError(f"kind must be 'threads' or 'processes', not {kind!r}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    if kind == "threads":
        from concurrent.futures import ThreadPoolExecutor

        barrier = threading.Barrier(workers)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [
                pool.submit(_timed, fn, args, time.thread_time, threading.get_ident, barrier)
                for _ in range(workers)
            ]
            outcomes = [future.result() for future in futures]
    else:
        outcomes = _in_processes(fn, args, workers)
    ids, results, cpu, starts, ends = zip(*outcomes, strict=True)
    return WorkerTimes(kind, ids, results, cpu, max(ends) - min(starts))


def _in_processes(fn: Callable, args: tuple, workers: int) -> list[tuple]:
    import multiprocessing
    import pickle
    from queue import Empty

    name = getattr(fn, "__qualname__", repr(fn))
    try:
        if getattr(fn, "__module__", None) == "__main__":  # a notebook's, or a script's
            raise pickle.PicklingError(f"{name} is defined in __main__")
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(
            f"a spawned process imports {name} by name, and cannot ({err}): define it in a "
            "module, e.g. nbaccel.lessons.tools.python_work, and pass that"
        ) from err
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(workers), context.Queue()
    processes = [
        context.Process(target=_process_worker, args=(i, fn, args, barrier, results), daemon=True)
        for i in range(workers)
    ]
    done: dict[int, tuple] = {}
    try:
        for process in processes:
            process.start()
        while len(done) < workers:
            # gone before the wait began: whatever it sent is already in the queue
            gone = [i for i, p in enumerate(processes) if p.exitcode is not None and i not in done]
            try:
                index, ok, outcome = results.get(timeout=1)
            except Empty:
                if gone:
                    p = processes[gone[0]]
                    raise NbaccelError(
                        f"worker process {gone[0]} (pid {p.pid}) exited with code {p.exitcode} "
                        "without a result"
                    ) from None
                continue
            if not ok:
                raise NbaccelError(f"worker process {index} failed:\n{outcome}")
            done[index] = outcome
    finally:
        for process in processes:
            if process.pid is None:  # never started
                continue
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join()
        results.close()
    return [done[i] for i in range(workers)]
