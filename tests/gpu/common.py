"""What the GPU tier shares: its marks, and a training loop that runs on any device, through an
Accelerator or as plain PyTorch in one process (the oracle)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nbaccel import set_seed

from ..accelerator.test_multiprocess import make_data, make_model

#: Every module of the tier: ``-m gpu`` selects it; without CUDA it is skipped, saying why.
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
#: NCCL wants one device per rank (the Accelerator takes cuda:LOCAL_RANK).
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def exact_float32() -> None:
    """No TF32 in matmuls or convolutions: the oracle comparisons are float32 against float32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def fit(
    accelerator,
    batch_size: int,
    device: torch.device | str = "cpu",
    mode: str = "no",
    epochs: int = 2,
) -> dict[str, torch.Tensor]:
    """Train ``make_model`` on ``make_data``; return its full weights, on the CPU.

    ``accelerator=None``: plain PyTorch in one process on ``device``, under torch's own
    autocast (and GradScaler for ``mode="fp16"``), the loss taken in float32 outside autocast,
    as the Accelerator's prepared forward returns float32 outputs.
    """
    set_seed(0)  # the same initial weights and the same shuffles for every caller
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(make_data(), batch_size=batch_size, shuffle=True)
    if accelerator is not None:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for _ in range(epochs):
            for x, y in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
        weights = accelerator.get_state_dict(model)  # whole, on every rank (a collective)
        return {k: v.detach().float().cpu().clone() for k, v in weights.items()}

    device = torch.device(device)
    model.to(device)
    dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            autocast = (
                torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
            )
            with autocast:
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert list(a) == list(b), (list(a), list(b))  # no "module." prefix either
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def initial_weights() -> dict[str, torch.Tensor]:
    set_seed(0)
    return {k: v.detach().clone() for k, v in make_model().state_dict().items()}
