"""Several ranks on CUDA (one GPU each, NCCL), each against plain PyTorch in one process on the
same global batch: DDP, FSDP2 in bf16, DeepSpeed ZeRO 2/3 in fp16, and save/load_state.

Tolerances (largest absolute weight difference after 16-32 SGD steps with momentum, weights of
order 0.1-1):
* float32 DDP: two half-batch gradients averaged against one full batch, sums in another order:
  ``DDP_TOLERANCE`` (1e-5), as on gloo (``tests/accelerator/test_multiprocess.py``).
* bf16 (8 significant bits, about 4e-3 relative): FSDP2 computes in bf16 and reduces in float32;
  the reference is float32. Measured on the CPU for this loop: 4.6e-3 (FSDP2, 2 ranks, gloo),
  7.9e-3 (ZeRO 2 in bf16, 2 ranks), 4.7e-3 (one process under torch's autocast).
  ``BF16_TOLERANCE`` is about 4x the largest.
* fp16 (11 significant bits): DeepSpeed keeps float32 master weights and computes in fp16, with
  a fixed loss scale here (a dynamic one skips its first steps while it finds its scale, which
  the reference does not do). Measured on one H200 (2026-12-04, DeepSpeed 0.19.8, micro-batch
  16, one a step, 32 steps): ZeRO 2 and 3 both 1.2e-3 from float32, torch's fp16 autocast
  0.8e-3 and 0.9e-3, no step skipped. ``FP16_TOLERANCE`` is about 4x the largest. The loop
  keeps its micro-batch of 16 on one GPU (16 a rank on one, 8 on two): with 8 samples and 64
  steps it amplifies rounding (ZeRO 2 in fp16 2.8e-2 on the H200; torch's bf16 autocast 0.12
  from float32 on the CPU).
Each low-precision test also checks that training moved the weights by far more than its
tolerance, so that a run which learned nothing cannot pass.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nbaccel import Accelerator, DeepSpeedPlugin

from ..accelerator.strategies.test_fsdp import SHARD_ALL, save_then_load, sharded_accelerator
from ..accelerator.test_multiprocess import DDP_TOLERANCE, resume
from ..distributed import run_ranks
from .common import GPU, TWO_GPUS, exact_float32, fit, gap, initial_weights

pytestmark = GPU

BF16_TOLERANCE = 3e-2
FP16_TOLERANCE = 5e-3
NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None


def against_one_process(accelerator: Accelerator, steps: int, batch_size: int = 8) -> dict:
    """Train through ``accelerator`` (``batch_size`` samples per rank per micro-batch), then as
    plain PyTorch in one process on the same GPU with the global batch."""
    exact_float32()
    got = fit(accelerator, batch_size=batch_size)
    world = accelerator.num_processes
    expected = fit(None, batch_size=batch_size * world * steps, device=accelerator.device)
    out = {
        "backend": accelerator.backend,
        "device": str(accelerator.device),
        "gap": gap(got, expected),
        "moved": gap(initial_weights(), expected),
    }
    accelerator.end_training()
    return out


def ddp_on_nccl(steps: int) -> dict:
    return against_one_process(Accelerator(gradient_accumulation_steps=steps, live=False), steps)


@TWO_GPUS
@pytest.mark.parametrize("steps", [1, 2])
def test_ddp_on_nccl_matches_one_process_on_the_global_batch(steps):
    results = run_ranks(ddp_on_nccl, steps)
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]
    for r in results:
        assert r["backend"] == "nccl"
        assert r["gap"] < DDP_TOLERANCE, f"weights differ by {r['gap']:.2e}"


def fsdp_in_bf16() -> dict:
    return against_one_process(sharded_accelerator("fsdp", 1, mixed_precision="bf16"), 1)


@TWO_GPUS
def test_fsdp2_in_bf16_on_cuda_matches_one_process():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    for r in run_ranks(fsdp_in_bf16):
        assert r["backend"] == "nccl"
        assert r["gap"] < BF16_TOLERANCE, f"weights differ by {r['gap']:.2e}"
        assert r["moved"] > 5 * BF16_TOLERANCE, r


def zero_in_fp16(stage: int, steps: int) -> dict:
    config = {**SHARD_ALL, "fp16": {"loss_scale": 1024.0}}  # a fixed scale: no skipped steps
    plugin = DeepSpeedPlugin(zero_stage=stage, config=config)
    options = {"gradient_accumulation_steps": steps, "live": False}
    accelerator = Accelerator(mixed_precision="fp16", deepspeed_plugin=plugin, **options)
    # a micro-batch of 16 on one GPU as on two: the loop the tolerance was set for
    return against_one_process(accelerator, steps, batch_size=16 // accelerator.num_processes)


@pytest.mark.skipif(NO_DEEPSPEED, reason="needs deepspeed, not installed here")
@pytest.mark.parametrize("stage, steps", [(2, 1), (3, 2)])
def test_zero_in_fp16_on_cuda_matches_one_process(stage, steps):
    world = min(2, torch.cuda.device_count())  # DeepSpeed runs on one GPU too
    for r in run_ranks(zero_in_fp16, stage, steps, world_size=world, timeout=240):
        assert r["backend"] == ("nccl" if world > 1 else None)
        assert r["gap"] < FP16_TOLERANCE, f"ZeRO {stage}: weights differ by {r['gap']:.2e}"
        assert r["moved"] > 5 * FP16_TOLERANCE, r


@TWO_GPUS
def test_save_state_then_load_state_on_two_gpus_continues_bit_identically(tmp_path):
    assert run_ranks(resume, str(tmp_path / "ckpt")) == [True, True]


def fsdp_save_then_load(folder: str) -> tuple[float, float]:
    restored, continued, _ = save_then_load(folder, "fsdp")
    return restored, continued


@TWO_GPUS
def test_fsdp_save_state_then_load_state_on_two_gpus(tmp_path):
    for restored, continued in run_ranks(fsdp_save_then_load, str(tmp_path / "ckpt")):
        assert restored == 0.0
        assert continued == 0.0, f"training after load_state differs by {continued:.2e}"
