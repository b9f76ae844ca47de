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
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..config import MixedPrecision, check_mode

if TYPE_CHECKING:
    import torch

_DTYPES = {"no": None, "fp16": "float16", "bf16": "bfloat16"}  # torch's names; torch loads late


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
        import torch  # here, so that checking a mode (the CLI, config files) needs no torch

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
        import torch

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
