"""Small measuring tools the lessons share: accuracy, parameter bytes, all-reduce counts."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


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
