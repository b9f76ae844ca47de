"""One mixed-precision policy: which dtype autocast uses, and whether a GradScaler guards fp16.

=======  ==============  ==========  ==================================================
mode     autocast dtype  GradScaler  why
=======  ==============  ==========  ==================================================
"no"     (off)           no          plain float32
"bf16"   bfloat16        no          float32's range, so gradients do not underflow
"fp16"   float16         yes         5 exponent bits: small gradients flush to zero
                                     unless the loss is scaled up first
=======  ==============  ==========  ==================================================

The same table holds on CPU and CUDA: torch autocasts on both, and ``torch.amp.GradScaler``
works on both. ``GradScalerKwargs`` and ``AutocastKwargs`` (``handlers.py``) reach the scaler
and ``torch.autocast`` as ``scaler_kwargs`` and ``autocast_kwargs``.

The whole policy is here, and the strategies call it: the autocast context (``autocast``, for
``accelerator.autocast()``), the prepared model's forward under autocast with float32 outputs
(``autocast_forward``, ``AutocastForward``) and its removal (``without_autocast``), the
scaled backward, and the rules of unscaling and stepping (``unscale_`` once per step,
``step`` reporting a skipped step). DeepSpeed scales fp16 losses itself (``scale=False``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..config import MixedPrecision, check_mode
from ..observe.meter import TimedForward
from ..tensors import map_tensors

_DTYPES = {"no": None, "fp16": "float16", "bf16": "bfloat16"}  # torch's names


class Precision:
    """Autocast context plus loss scaling for one device and one mode."""

    def __init__(
        self,
        mode: MixedPrecision,
        device: torch.device,
        scale: bool = True,
        scaler_kwargs: dict | None = None,
        autocast_kwargs: dict | None = None,
    ) -> None:
        self.mode = check_mode(mode)
        self.device = device
        self.dtype = None if _DTYPES[self.mode] is None else getattr(torch, _DTYPES[self.mode])
        if self.mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"mixed_precision='bf16' needs a GPU with bfloat16 support; {device} has none. "
                "Use mixed_precision='fp16' on this GPU."
            )
        # scale=False: a back end (DeepSpeed) scales fp16 losses itself
        scaling = self.mode == "fp16" and scale
        self.scaler = torch.amp.GradScaler(device.type, **scaler_kwargs or {}) if scaling else None
        self.autocast_kwargs = dict(autocast_kwargs or {})  # enabled, cache_enabled
        self._unscaled: set[int] = set()  # optimizers unscaled since their last step

    def autocast(self, autocast_kwargs: dict | None = None) -> contextlib.AbstractContextManager:
        """Run the forward pass in the low-precision dtype where torch deems it safe
        (``autocast_kwargs``: this block's own instead of the Accelerator's)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        kwargs = self.autocast_kwargs if autocast_kwargs is None else autocast_kwargs
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_(self, *optimizers: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true size before they are clipped or inspected."""
        for optimizer in optimizers if self.scaler is not None else ():
            if id(optimizer) not in self._unscaled:  # GradScaler refuses a second unscale_
                self.scaler.unscale_(optimizer)
                self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, closure=None) -> bool:
        """Step the optimizer; return False when fp16 found inf/NaN gradients and skipped it."""
        if self.scaler is None:
            optimizer.step(closure) if closure is not None else optimizer.step()
            return True
        self._unscaled.discard(id(optimizer))
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer, closure) if closure is not None else self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler halves its scale exactly when it skipped the step for inf/NaN gradients.
        return self.scaler.get_scale() >= scale

    def autocast_forward(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with its forward run under autocast and its outputs float32
        (``AutocastForward``), when this mode autocasts; as it is otherwise."""
        if self.dtype is not None:
            model.forward = AutocastForward(model.forward, self)
        return model


def without_autocast(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without the autocast ``Precision.autocast_forward`` put on its forward: a timed
    forward stays timed (``unwrap_model(keep_fp32_wrapper=False)``)."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, TimedForward) and isinstance(forward.forward, AutocastForward):
        model.forward = forward.around(forward.forward.forward)  # still timed, no longer autocast
    elif isinstance(forward, AutocastForward):
        del model.__dict__["forward"]
    return model


class AutocastForward:
    """A model's forward run under autocast, its floating outputs returned as float32.

    It turns autocast on and off with torch's own switches (``torch.set_autocast_enabled`` and
    the rest, thread-local as the context manager's), in the order ``torch.autocast`` uses
    them, instead of building the context manager, whose Python (``__init__``, ``__enter__``,
    ``__exit__``) runs on every forward: that saved a bf16 step about 9-10 us on a 2-core CPU,
    0.5-0.8% (``benchmarks/results/overhead-xeon-cpu.md``, ``overhead-lesson-xeon-cpu.md``).
    With ``AutocastKwargs``, or where a torch function mode is on (``torch.export``'s tracing,
    which the context manager tells), it takes ``torch.autocast`` itself.
    """

    def __init__(self, forward: Any, precision: Precision) -> None:
        self.forward = forward
        # precision.autocast()'s arguments, read once: a call and an import statement less on
        # every forward
        self._where = (precision.device.type, precision.dtype)
        self._kwargs = precision.autocast_kwargs
        # torch.autocast checks the device and dtype (it refuses, or warns and turns itself
        # off, where they cannot be used): once, here, for the switches' way
        probe = torch.autocast(*self._where, **self._kwargs)
        on = getattr(probe, "_enabled", False) is True  # (a private name: if gone, the manager)
        self._switches = on and not self._kwargs and _function_modes is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._switches and not _function_modes():
            device, dtype = self._where
            was_on, was_dtype = _is_on(device), _dtype_of(device)
            _turn(device, True)
            _set_dtype(device, dtype)
            _nest()
            try:
                out = self.forward(*args, **kwargs)
            finally:
                if _unnest() == 0:  # the outermost autocast: its cast weights are dropped
                    torch.clear_autocast_cache()
                _turn(device, was_on)
                _set_dtype(device, was_dtype)
        else:
            with torch.autocast(*self._where, **self._kwargs):
                out = self.forward(*args, **kwargs)
        if type(out) is torch.Tensor:  # the common output: _float32 without map_tensors
            return out.float() if out.is_floating_point() else out
        return map_tensors(out, _float32)


# torch's autocast switches (C functions), looked up once; whether a function mode is on is
# private to torch: where a version lacks it, the context manager is used
_is_on, _dtype_of = torch.is_autocast_enabled, torch.get_autocast_dtype
_turn, _set_dtype = torch.set_autocast_enabled, torch.set_autocast_dtype
_nest, _unnest = torch.autocast_increment_nesting, torch.autocast_decrement_nesting
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t
