"""DeepSpeed's step on GPUs, against Hugging Face Accelerate itself: fp16, where the engine's
loss scaler skips steps on overflow, and NCCL.

The CPU tier (``tests/accelerator/strategies/test_deepspeed_step.py``) runs the same loop
against Accelerate in float32 on gloo; fp16 under DeepSpeed needs CUDA. Both libraries drive
the same engine with the same kernels, so the records should agree to fp16's rounding of the
loss at most; ``FP16_TOLERANCE`` is that allowance, not a measured gap. Both stages passed on one
H200 (2026-12-04, DeepSpeed 0.19.8); the gap itself was not printed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ..accelerator.strategies.test_deepspeed_step import compare, loop
from ..distributed import run_ranks
from .common import GPU

pytestmark = [
    *GPU,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed, not installed here"
    ),
]

FP16_TOLERANCE = 1e-3


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_loop_sees_what_accelerate_shows_on_gpus(stage):
    ranks = min(2, torch.cuda.device_count())
    theirs = run_ranks(loop, "accelerate", stage, "fp16", ranks, world_size=ranks)
    mine = run_ranks(loop, "nbaccel", stage, "fp16", ranks, world_size=ranks)
    compare(mine, theirs, FP16_TOLERANCE)  # skipped steps included: step_was_skipped agrees
