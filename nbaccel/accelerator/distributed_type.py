"""``DistributedType``: how the processes of a run train together, by Accelerate's names.

Its own module so that what only needs the name (the state windows, the strategies' table)
imports it without the process group's machinery; ``state.py`` re-exports it, where
Accelerate's code looks for it.
"""

from __future__ import annotations

import enum


class DistributedType(str, enum.Enum):
    """How the processes train together, by Accelerate's names (compares equal to the string).

    nbaccel reports the first five. The others are Accelerate's for devices and engines nbaccel
    does not drive; they exist so that code comparing against them
    (``if accelerator.distributed_type == DistributedType.XLA:``) runs here unchanged.
    """

    NO = "NO"  # one process
    MULTI_CPU = "MULTI_CPU"  # DDP over gloo
    MULTI_GPU = "MULTI_GPU"  # DDP over NCCL
    FSDP = "FSDP"  # sharded by FSDP2 (several processes)
    DEEPSPEED = "DEEPSPEED"  # a DeepSpeed engine (any number of processes)
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
