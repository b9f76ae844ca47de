"""Small measuring tools the lessons share: accuracy, parameter bytes, all-reduce counts,
each rank's bytes of model state under DDP, FSDP2 and DeepSpeed, and a check for an optional
package that a section needs."""

from __future__ import annotations

import importlib.util
import sys

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


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of model state, as the ZeRO paper counts it, for a prepared model.

    Works under DDP, FSDP2 and DeepSpeed (any stage) by walking the tensors that the model, its
    gradients and the optimizer (with DeepSpeed's wrapper) hold, each storage counted once:

    * ``parameters``: the weights this rank keeps (a shard under FSDP2 and ZeRO 3);
    * ``gradients``: this rank's gradients (a shard under FSDP2 and ZeRO 2-3; ZeRO 1 keeps only
      its partition once the window's gradients are reduced);
    * ``optimizer``: optimizer state plus DeepSpeed's float32 master weights;
    * ``other``: any other tensor DeepSpeed's optimizer wrapper holds directly.

    Call it after ``backward`` and before ``optimizer.step()`` on a step after the first, when
    gradients and optimizer state both exist. DDP's own gradient buckets live in C++ and are
    not counted (with ``gradient_as_bucket_view=False``, PyTorch's default, they are another
    copy of the gradients).
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
    environment, whatever PATH says; the lesson then runs the rest and adapts its checks.

    >>> needs("torch", "nothing")
    True
    """
    if importlib.util.find_spec(module) is not None:
        return True
    print(
        f"Skipped: {skipped}, which needs {package or module}, not installed here. To run it: "
        f"!{sys.executable} -m pip install {package or module}, then restart the kernel."
    )
    return False
