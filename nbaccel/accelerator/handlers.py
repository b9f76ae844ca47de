"""``Accelerator(kwargs_handlers=[...])``: Accelerate's dataclasses that tune torch's objects.

=================================  ===================================================  ========
handler                            what it reaches                                      when
=================================  ===================================================  ========
``DistributedDataParallelKwargs``  ``DistributedDataParallel(...)``'s arguments; its    prepare
                                   communication hook (fp16/bf16 compression, PowerSGD)
``GradScalerKwargs``               ``torch.amp.GradScaler(...)`` (fp16 only)            __init__
``InitProcessGroupKwargs``         ``torch.distributed.init_process_group(...)``        __init__
``AutocastKwargs``                 ``torch.autocast(...)`` (prepared forward, autocast)  always
=================================  ===================================================  ========

As in Accelerate, a handler asks for its fields that differ from the defaults (``to_kwargs``),
and each kind may be given once (a second raises ``ValueError``).

What nbaccel does with a handler it cannot apply, where Accelerate would drop it in silence:

* It cannot honour it (a process group that already exists, made with other settings, cannot
  take a new ``timeout`` or ``backend``; DeepSpeed scales fp16 losses with its own settings;
  FSDP's forward runs no autocast): ``ValueError``, saying where the setting goes instead.
* The run has nothing for it to configure (``DistributedDataParallelKwargs`` with one process
  or under FSDP/DeepSpeed: no DDP; ``GradScalerKwargs`` without fp16: no scaler;
  ``AutocastKwargs`` with ``mixed_precision="no"``: no autocast): a warning says so, because
  the same script commonly runs on one process, or in full precision, while it is debugged.

A communication hook is registered when ``prepare`` wraps the model in DDP, through the
prepared model's ``register_comm_hook``, so the step meter still hears of each bucket ready
(``strategies/ddp.py`` wraps the hook; DDP itself takes one).
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal


class KwargsHandler:
    """What every handler shares: ``to_kwargs()``, its fields that differ from the defaults."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        defaults = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if defaults[k] != v}


class DDPCommunicationHookType(str, enum.Enum):
    """A DDP communication hook by Accelerate's name (compares equal to the string)."""

    NO = "no"
    FP16 = "fp16"  # send gradients as float16, sum, cast back
    BF16 = "bf16"  # the same in bfloat16 (float32's range, fewer bits)
    POWER_SGD = "power_sgd"  # low-rank approximation of each gradient matrix (lossy)
    BATCHED_POWER_SGD = "batched_power_sgd"  # the same over each whole bucket

    def __str__(self) -> str:
        return self.value


@dataclass
class AutocastKwargs(KwargsHandler):
    """``torch.autocast``'s ``enabled`` and ``cache_enabled`` for the mixed-precision forward
    and ``accelerator.autocast()``; ``enabled=False`` runs them in float32."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """``DistributedDataParallel``'s arguments, and a communication hook for its all-reduce.

    ``comm_hook``: ``"fp16"``/``"bf16"`` compress each bucket (torch's
    ``fp16_compress_hook``/``bf16_compress_hook``), ``"power_sgd"``/``"batched_power_sgd"``
    approximate it (``powerSGD_hook``; ``comm_state_option`` goes to ``PowerSGDState``, e.g.
    ``{"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}``). ``comm_wrapper``
    (``"fp16"``/``"bf16"``) compresses what a PowerSGD hook sends.

    >>> DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
    {'find_unused_parameters': True}
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: Literal[
        DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16
    ] = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook", list(DDPCommunicationHookType))
        wrappers = [DDPCommunicationHookType.NO, *_WRAPPERS]
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper", wrappers)
        if self.comm_state_option and self.comm_hook not in _POWER_SGD:
            raise ValueError(
                f"comm_state_option={self.comm_state_option!r} configures PowerSGD's state; "
                f"comm_hook={self.comm_hook.value!r} has none. Use comm_hook='power_sgd'."
            )
        if self.comm_wrapper != "no" and self.comm_hook == "no":
            raise ValueError(
                f"comm_wrapper={self.comm_wrapper.value!r} wraps a comm_hook, and there is "
                "none: give comm_hook='power_sgd' too, or comm_hook='fp16' alone."
            )

    def to_dict(self) -> dict[str, Any]:
        """The arguments of ``DistributedDataParallel`` (the hook's fields left out)."""
        ddp = super().to_dict()
        for name in ("comm_hook", "comm_wrapper", "comm_state_option"):
            ddp.pop(name)
        return ddp

    def comm_hook_for(self, process_group: Any) -> tuple[Any, Any] | None:
        """``(state, hook)`` for ``register_comm_hook``, or None when no hook is asked for."""
        if self.comm_hook == "no":
            return None
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
            "power_sgd": powerSGD_hook.powerSGD_hook,
            "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
        }
        hook = hooks[self.comm_hook.value]
        if self.comm_hook == "batched_power_sgd" and not _batched_power_sgd_works():
            raise ValueError(
                "comm_hook='batched_power_sgd': this torch's batched_powerSGD_hook fails on "
                "every bucket (its _orthogonalize takes only a batch of matrices, and the hook "
                f"gives it one; torch {_torch_version()}). Use comm_hook='power_sgd', which "
                "approximates each gradient matrix alone."
            )
        if self.comm_wrapper != "no":
            wrap = {"fp16": default_hooks.fp16_compress_wrapper}
            wrap["bf16"] = default_hooks.bf16_compress_wrapper
            hook = wrap[self.comm_wrapper.value](hook)
        if self.comm_hook in _POWER_SGD:
            return powerSGD_hook.PowerSGDState(process_group, **self.comm_state_option), hook
        return process_group, hook


@dataclass
class GradScalerKwargs(KwargsHandler):
    """``torch.amp.GradScaler``'s arguments, for ``mixed_precision="fp16"``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """``torch.distributed.init_process_group``'s ``backend``, ``init_method`` and ``timeout``.

    As in Accelerate, ``backend="nccl"`` is the default (so it asks for nothing: nbaccel picks
    gloo on CPUs, NCCL on GPUs) and ``timeout=None`` becomes 10 minutes for NCCL, 30 for any
    other backend. The first Accelerator of a launch creates the group; a later one with other
    settings raises, since a group's settings are fixed.
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is None:
            self.timeout = timedelta(seconds=600 if self.backend == "nccl" else 1800)


_POWER_SGD = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
_WRAPPERS = (DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16)
#: handler class -> the Handlers field that holds it
_KINDS = {
    DistributedDataParallelKwargs: "ddp",
    GradScalerKwargs: "scaler",
    InitProcessGroupKwargs: "init",
    AutocastKwargs: "autocast",
}


def _batched_power_sgd_works() -> bool:
    """Whether torch's batched PowerSGD can orthogonalize its single matrix (torch 2.13 cannot)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True


def _torch_version() -> str:
    import torch

    return torch.__version__


def _hook_type(value: Any, name: str, allowed: list) -> DDPCommunicationHookType:
    try:
        kind = DDPCommunicationHookType(getattr(value, "value", value))
    except ValueError:
        kind = None
    if kind not in allowed:
        names = ", ".join(repr(a.value) for a in allowed)
        raise ValueError(f"{name}={value!r} must be one of {names}")
    return kind


@dataclass(frozen=True)
class Handlers:
    """The Accelerator's handlers, one of each kind or None (``Accelerator.ddp_handler`` ...)."""

    ddp: DistributedDataParallelKwargs | None = None
    scaler: GradScalerKwargs | None = None
    init: InitProcessGroupKwargs | None = None
    autocast: AutocastKwargs | None = None

    @classmethod
    def sorted(cls, handlers: Iterable[Any] | None) -> Handlers:
        """Each handler under its kind; a second of one kind, or a stranger, raises."""
        found: dict[str, Any] = {}
        for handler in handlers or ():
            kind = _KINDS.get(type(handler)) or _KINDS.get(_accelerates(handler))
            if kind is None:
                raise TypeError(
                    f"kwargs_handlers takes {', '.join(c.__name__ for c in _KINDS)} "
                    f"(nbaccel.utils); got {handler!r}"
                )
            if kind in found:
                raise ValueError(
                    f"kwargs_handlers has two {type(handler).__name__}: give one of each kind."
                )
            found[kind] = _ours(handler)
        return cls(**found)

    def asked(self, kind: str) -> dict[str, Any]:
        handler = getattr(self, kind)
        return {} if handler is None else handler.to_kwargs()

    def check(self, distributed_type: str, ddp: bool, mode: str, scales: bool) -> None:
        """Refuse what cannot be honoured, warn about what has nothing to configure."""
        distributed_type = getattr(distributed_type, "value", distributed_type)
        if self.asked("scaler") and mode == "fp16" and not scales:
            raise ValueError(
                f"GradScalerKwargs: under {distributed_type} the engine scales fp16 losses "
                "itself; set its loss scaling in the DeepSpeed config (fp16.initial_scale_power, "
                "loss_scale_window, hysteresis) and drop the handler."
            )
        if self.asked("autocast") and distributed_type == "FSDP":
            raise ValueError(
                "AutocastKwargs: under FSDP the forward runs without autocast (FSDPPlugin's "
                "mixed-precision policy casts the parameters instead), so the handler would "
                "reach only accelerator.autocast() blocks: pass it there, "
                "accelerator.autocast(autocast_handler=...), and drop it from kwargs_handlers."
            )
        idle = [
            (
                "DistributedDataParallelKwargs",
                self.asked("ddp") or self._hooks(),
                not ddp,
                f"this run does not use DDP ({distributed_type})",
            ),
            (
                "GradScalerKwargs",
                self.asked("scaler"),
                mode != "fp16",
                f"mixed_precision={mode!r} uses no GradScaler (fp16 only)",
            ),
            (
                "AutocastKwargs",
                {**self.asked("autocast")}.keys() - {"enabled"},
                mode == "no",
                "mixed_precision='no' runs no autocast",
            ),
        ]
        for name, asked, unused, why in idle:
            if asked and unused:
                warnings.warn(f"{name}: {why}, so it has nothing to configure.", stacklevel=3)

    def _hooks(self) -> bool:
        return self.ddp is not None and self.ddp.comm_hook != "no"


def _accelerates(handler: Any) -> type | None:
    """Our class of the same name when ``handler`` is Accelerate's own dataclass."""
    if not type(handler).__module__.startswith("accelerate."):
        return None
    return next((c for c in _KINDS if c.__name__ == type(handler).__name__), None)


def _ours(handler: Any) -> Any:
    ours = next(c for c in _KINDS if c.__name__ == type(handler).__name__)
    if type(handler) is ours:
        return handler
    fields = {f.name: getattr(handler, f.name) for f in dataclasses.fields(ours)}
    return ours(**fields)
