"""Where this process stands, without the training machinery: ``PartialState``. Over 400
lines because it is Accelerate's ``PartialState`` whole, one class read in one sitting: the
process facts, the barriers, the one-process decorators and the collectives' methods.

Accelerate's ``PartialState`` under the same names: the process facts (``num_processes``,
``process_index``, ``device``, ``is_main_process``, ...), barriers, ``print`` and the
decorators that run a function on one process only. The ``Accelerator`` builds on it, so every
name here is an Accelerator's too.

One difference, on purpose: Accelerate's state is a process-wide singleton, nbaccel's is an
ordinary object (two share nothing but torch's default process group). Creating one joins the
process group when the launch has several processes and none exists yet. Workers that
``notebook_launcher`` started leave it anyway when the function returns.

Two states in one process (two Accelerators in one worker) share that group, counted: each
holds it from its creation until its ``destroy_process_group()`` (the Accelerator's
``end_training``), and the last holder's call destroys it. So ending one Accelerator never pulls
the group from under another: the other's ``reduce`` and ``gather`` still reach every rank.
The count is one of the two process-wide things nbaccel keeps (DESIGN.md): ``_holders``, a weak
set of the live states using a group that nbaccel created (``_created``, with the settings it was
made with: ``InitProcessGroupKwargs``); a state that became garbage no longer holds it. The
other is ``current._live``, the weak registry through which Accelerate's ``AcceleratorState()``
finds the newest live Accelerator: two Accelerators share the group, never their state.
A group you created yourself is yours: nbaccel uses it and never destroys it.
A collective through a state after its own ``end_training``, or after its group was destroyed
behind its back (``torch.distributed.destroy_process_group()``), raises ``NbaccelError`` and
says why: without the group it would quietly return this rank's value alone, a wrong number.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import functools
import gc
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..config import LaunchConfig
from ..env import DistEnv, backend_for, choose_device
from ..errors import NbaccelError
from ..observe.meter import StepMeter, communicating
from ..observe.stacks import listen_from_environ
from . import collectives, current
from .collectives import Reduction
from .distributed_type import DistributedType  # here too: Accelerate imports it from its state


class PartialState:
    """This process's rank, device and process group, and what to do with them.

    >>> state = PartialState(cpu=True)
    >>> state.num_processes, state.process_index, state.is_main_process, state.distributed_type
    (1, 0, True, <DistributedType.NO: 'NO'>)

    Args:
        cpu: use the CPU even when a GPU is present; ``None`` takes the launch default
            (``notebook_launcher(cpu=True)``, ``nbaccel launch --cpu``), else False.
        **kwargs: ``init_process_group``'s ``backend``, ``init_method`` and ``timeout`` for the
            group this state creates (``InitProcessGroupKwargs``). A group that exists already
            keeps its settings: asking for others raises ``ValueError``; with one process there
            is no group, and a warning says so.
    """

    #: The Accelerator's step meter (``nbaccel.observe.meter``), which times the collectives
    #: below as communication; a bare PartialState times nothing.
    _meter: StepMeter | None = None
    #: Accelerate's ``PartialState._reset_state()`` and ``_shared_state`` (``current.py``).
    _reset_state = current.ResetMethod()
    _shared_state = current.SharedState()

    def __init__(self, cpu: bool | None = None, **kwargs: Any) -> None:
        if kwargs.keys() - {"backend", "init_method", "timeout"}:
            raise TypeError(
                f"PartialState got {sorted(kwargs)}; it takes cpu and init_process_group's "
                "backend, init_method and timeout"
            )
        self.env = process_env()
        listen_from_environ()  # under `nbaccel launch`: say where this rank is when asked
        if cpu is None:
            cpu = bool(LaunchConfig.from_environ().cpu)
        asked = os.environ.get("ACCELERATE_TORCH_DEVICE")  # Accelerate's override, honoured
        self.device = torch.device(asked) if asked else choose_device(self.env.local_rank, cpu=cpu)
        self._triggered = False  # set_trigger since the last check_trigger
        self._group: weakref.ref | None = None  # the default group this state uses
        self._ended = False  # destroy_process_group() was called
        if not self.env.is_distributed:
            if kwargs:
                warnings.warn(
                    f"InitProcessGroupKwargs {kwargs}: one process has no process group, so it "
                    "has nothing to configure.",
                    stacklevel=3,
                )
            return
        backend = kwargs.pop("backend", backend_for(self.device))
        if backend != backend_for(self.device):
            raise ValueError(
                f"backend={backend!r}: nbaccel runs {backend_for(self.device)!r} on "
                f"{self.device.type} (gloo on CPUs, NCCL on GPUs); drop the backend argument."
            )
        if not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(
                backend, rank=self.env.rank, world_size=self.env.world_size, **kwargs
            )
            _created[dist.group.WORLD] = kwargs
            atexit.unregister(_free_before_exit)  # once, however many joined
            atexit.register(_free_before_exit)
        elif kwargs and _created.get(dist.group.WORLD) != kwargs:
            raise ValueError(
                f"InitProcessGroupKwargs {kwargs}: the process group exists already (made by an "
                "earlier Accelerator, or by you) with other settings, and a group's timeout and "
                "init_method are fixed when it is made. Give the handler to the first "
                "Accelerator, or destroy the group first."
            )
        self._group = weakref.ref(dist.group.WORLD)
        if dist.group.WORLD in _created:  # nbaccel's group (not one you made): hold it
            _holders.add(self)

    # -- the facts (PyTorch's names, and Accelerate's) ------------------------------------------
    @property
    def process_index(self) -> int:
        return self.env.rank

    rank = process_index

    @property
    def local_process_index(self) -> int:
        return self.env.local_rank

    @property
    def num_processes(self) -> int:
        return self.env.world_size

    @property
    def use_distributed(self) -> bool:
        return self.env.is_distributed

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0  # logs and saves

    @property
    def is_local_main_process(self) -> bool:
        return self.env.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.env.rank == self.env.world_size - 1

    @property
    def distributed_type(self) -> DistributedType:
        if not self.use_distributed:
            return DistributedType.NO
        return (
            DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU
        )

    @property
    def backend(self) -> str | None:
        """``"gloo"`` or ``"nccl"`` with several processes; None for one."""
        return backend_for(self.device) if self.use_distributed else None

    # -- together --------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """A barrier: every rank waits here until all have arrived."""
        if self.use_distributed:
            with self._collective("wait_for_everyone (a barrier)"):
                dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (say, to download or cache data); the others follow."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Each machine's local rank 0 runs the block first; the others follow."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, me: bool) -> Iterator[None]:
        if not me:
            self.wait_for_everyone()
        yield
        if me:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this rank's contiguous share of a list, tuple, tensor or dict of them.

        Shares differ by at most one item, the first ranks taking the extra ones;
        ``apply_padding`` repeats the last item so they are equal (handy before ``gather``).
        """
        if isinstance(inputs, Mapping):
            lengths = {len(v) for v in inputs.values()}
            if len(lengths) > 1:
                raise ValueError(
                    f"split_between_processes splits every value of a dict alike, so they must "
                    f"have one length; got lengths {sorted(lengths)}"
                )
        yield _split(inputs, self.process_index, self.num_processes, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    # -- one process only (decorators: the function returns None on the others) ----------------
    def on_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        return self._only(function, self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        return self._only(function, self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only(function, self.is_last_process)

    def on_process(
        self, function: Callable[..., Any] | None = None, process_index: int | None = None
    ) -> Any:
        """``@state.on_process(process_index=1)``: run on that process only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only(function, self.process_index == _index(process_index, "process"))

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        """``@state.on_local_process(local_process_index=0)``: that local rank of each node."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        index = _index(local_process_index, "local_process")
        return self._only(function, self.local_process_index == index)

    def _only(self, function: Callable[..., Any] | None, here: bool) -> Any:
        if function is None:  # used with parentheses: @state.on_main_process()
            return functools.partial(self._only, here=here)
        if not callable(function):
            raise TypeError(f"{function!r} is not a function: decorate one, @state.on_...")

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if here or not self.use_distributed else None

        return run

    # -- collectives (nbaccel.accelerator.collectives, on the default process group)
    # -----------------------
    def gather(self, tensor: Any) -> Any:
        """Concatenate each tensor across ranks along dim 0, in rank order (0-d tensors stack).

        Every rank must pass tensors of the same shape (else every rank raises a
        ``DistributedOperationException``, also a ``ValueError``, naming each rank's shapes).
        """
        with self._collective("gather"):
            return collectives.gather(tensor)

    def reduce(self, tensor: Any, reduction: Reduction = "sum", scale: float = 1.0) -> Any:
        """Sum (the default here, as in Accelerate's Accelerator), average, max or min each tensor
        across ranks; every rank gets the result."""
        with self._collective("reduce"):
            return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad each tensor along ``dim`` to the largest size on any rank, so it can be gathered."""
        with self._collective("pad_across_processes"):
            return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    def _collective(self, name: str) -> contextlib.AbstractContextManager:
        """Time the collective ``name`` as communication, once this state's group is known to
        be alive: without it, torch's collectives would quietly return this rank's value."""
        if self.use_distributed and (self._ended or not _alive(self._group)):
            raise NbaccelError(self._group_gone(name))
        return communicating(self._meter, name)

    def _group_gone(self, name: str) -> str:
        if self._ended:
            return (
                f"{name} after this {type(self).__name__}'s end_training() (destroy_process_group"
                "()): it has left the process group, which the last one to leave destroys, and "
                "without it the result would be this rank's value alone. Call end_training() "
                "once, after the last collective, or create a new Accelerator to go on."
            )
        return (
            f"{name}: the process group this {type(self).__name__} used was destroyed by "
            "torch.distributed.destroy_process_group() while it was still in use, so the "
            "result would be this rank's value alone. nbaccel's Accelerators share the group "
            "and the last one's end_training() destroys it: leave that to them, or destroy it "
            "only after the last collective."
        )

    # -- one rank stops everyone (early stopping, a NaN loss) -----------------------------------
    def set_trigger(self) -> None:
        """Raise this rank's flag; the next ``check_trigger`` on every rank sees it."""
        self._triggered = True

    def check_trigger(self) -> bool:
        """True on every rank when any rank called ``set_trigger`` since the last check (the
        flags are then lowered). A collective: every rank must call it at the same point."""
        flag = torch.tensor(float(self._triggered), device=self.device)
        with self._collective("check_trigger"):
            flag = collectives._reduce(flag, "max")  # one float on every rank: no shape check
        self._triggered = False
        return bool(flag.item())

    # -- the end ---------------------------------------------------------------------------------
    def destroy_process_group(self) -> None:
        """Stop using the process group; destroy it if nbaccel created it and no other live
        state still holds it (safe to call twice)."""
        with self._leaving_group() as last:
            if last and dist.is_initialized():
                dist.destroy_process_group()

    @contextlib.contextmanager
    def _leaving_group(self) -> Iterator[bool]:
        """Yield whether this state is the last holder of a live group nbaccel created, the
        one whose leaving destroys it; then it holds the group no longer, whatever happened."""
        group = self._group() if self._group is not None else None
        holders = _holding(group)
        if self in holders and len(holders) > 1:
            # An Accelerator dropped in a reference cycle lives until collected: collect it now,
            holders.clear()  # while its group lives (this list's references would keep it)
            gc.collect()
            holders = _holding(group)
        try:
            yield holders == [self]
        finally:
            _holders.discard(self)
            self._ended = True

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its hold on the process group (a weak reference, this process's)."""
        return {**self.__dict__, "_group": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy uses this process's default group, if any, but does not hold it: only the
        state that joined it counts towards destroying it."""
        self.__dict__.update(state)
        if dist.is_available() and dist.is_initialized() and not self._ended:
            self._group = weakref.ref(dist.group.WORLD)

    def __getattr__(self, name: str) -> Any:  # only what ordinary lookup did not find
        raise current.missing(self, name)

    def __repr__(self) -> str:
        if "_reset_by" in self.__dict__:
            return f"<{type(self).__name__}, reset by {self.__dict__['_reset_by']}._reset_state()>"
        return (
            f"{type(self).__name__}(distributed_type={self.distributed_type.value}, "
            f"process_index={self.process_index}, num_processes={self.num_processes}, "
            f"device={self.device})"
        )


#: The live states that hold a default process group nbaccel created (see the module's
#: docstring), and the groups it created, with the init_process_group settings each was given:
#: weak, so garbage holds nothing and leaks nothing.
_holders: weakref.WeakSet[PartialState] = weakref.WeakSet()
_created: weakref.WeakKeyDictionary[dist.ProcessGroup, dict] = weakref.WeakKeyDictionary()


def process_env() -> DistEnv:
    """The launcher's variables; or, when they name no processes but a process group of several
    exists already (one you made, or Accelerate's ``debug_launcher``), that group's ranks."""
    env = DistEnv.from_environ()
    if env.is_distributed or not (dist.is_available() and dist.is_initialized()):
        return env
    size, rank = dist.get_world_size(), dist.get_rank()
    if size == 1:
        return env
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    return dataclasses.replace(
        env, rank=rank, local_rank=local_rank, world_size=size, local_world_size=local_size
    )


def _alive(group: weakref.ref | None) -> bool:
    """Whether ``group`` (a weak reference) is still torch's default process group."""
    current = dist.group.WORLD if dist.is_initialized() else None
    return group is not None and current is not None and group() is current


def _holding(group: Any) -> list[PartialState]:
    """The live states that hold ``group``, an alive default group."""
    if group is None or not dist.is_initialized() or group is not dist.group.WORLD:
        return []
    return [s for s in list(_holders) if s._group is not None and s._group() is group]


def _free_before_exit() -> None:
    """Free what reference cycles still hold (an Accelerator and its prepared objects: a DDP
    model keeps its gloo group alive) while the interpreter is whole. Left to the interpreter's
    own teardown, a gloo group freed there can abort the process after training succeeded
    ("terminate called without an active exception").

    The groups nbaccel created are kept, not freed: a DDP model freed here frees its group's
    last owner in its Reducer's destructor, which joins gloo's threads while holding Python's
    lock, and now and then waits there for ever or aborts the process (the hazard
    ``launch/kept_groups.py`` describes for the launcher's workers). One reference more, never
    dropped, leaves the group to the process's end, like a worker's ``os._exit``; it was
    destroyed for torch already (``end_training``) or is about to die with the process."""
    for group in list(_created):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    gc.collect()


def _index(index: Any, what: str) -> int:
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{what}_index={index!r} must be an int, e.g. @on_{what}({what}_index=0)")
    return index


def _split(inputs: Any, rank: int, world_size: int, pad: bool) -> Any:
    if isinstance(inputs, Mapping):
        return type(inputs)({k: _split(v, rank, world_size, pad) for k, v in inputs.items()})
    n = len(inputs)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    share = inputs[start : start + base + (rank < extra)]
    if pad and extra and rank >= extra and n:
        tail = inputs[n - 1 : n]
        share = torch.cat([share, tail]) if isinstance(share, torch.Tensor) else share + tail
    return share
