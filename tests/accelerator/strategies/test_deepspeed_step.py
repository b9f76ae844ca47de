"""DeepSpeed's step where Accelerate puts it: inside ``accelerator.backward``.

The oracle is Accelerate itself on 2 CPU ranks: the same loop, seed and data run once through
``accelerate.Accelerator`` and once through nbaccel's, and every point of the loop (after
``backward``, ``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()`` and
``zero_grad()``) shows the same weights, the same gradients, the same returned norm and the
same learning rate. Two things make Accelerate's DeepSpeed path run on CPU; neither changes
its numbers (see ``accelerate_deepspeed``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nbaccel import Accelerator, DeepSpeedPlugin, set_seed

from ...distributed import run_ranks
from ..test_multiprocess import make_data, make_model

CLIP = 0.05  # small: the engine clips at every step, so clipping is part of what is compared
STEPS = 2  # micro-batches per window
#: float32 on the same engine: the two libraries should agree to rounding, and do exactly here
TOLERANCE = 1e-6


def accelerate_deepspeed(stage: int, mixed_precision: str = "no"):
    """Accelerate's Accelerator with DeepSpeed on this rank.

    * Its ``DeepSpeedPlugin`` asks for the installed transformers' version even when it will
      not use transformers (``zero3_init_flag`` off); transformers is not a dependency here,
      so that step, which only tells transformers about the config, is skipped.
    * Without a GPU Accelerate finds no backend for DeepSpeed and counts one process;
      ``InitProcessGroupKwargs(backend="gloo")`` gives it gloo, and it counts both ranks.
    """
    import accelerate
    from accelerate.utils import DeepSpeedPlugin as AcceleratePlugin
    from accelerate.utils import InitProcessGroupKwargs

    AcceleratePlugin.set_deepspeed_weakref = lambda self: None
    plugin = AcceleratePlugin(
        zero_stage=stage, gradient_accumulation_steps=STEPS, gradient_clipping=CLIP
    )
    on_cpu = not torch.cuda.is_available()
    return accelerate.Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=STEPS,
        deepspeed_plugin=plugin,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if on_cpu else None,
    )


def loop(library: str, stage: int, mixed_precision: str = "no", ranks: int = 2) -> list[dict]:
    """A loop written for Accelerate, with what it sees at each point (tensors on the CPU)."""
    from deepspeed.utils import safe_get_full_fp32_param

    if library == "accelerate":
        accelerator = accelerate_deepspeed(stage, mixed_precision)
    else:
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=CLIP)
        accelerator = Accelerator(
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=STEPS,
            deepspeed_plugin=plugin,
            live=False,
        )
    assert str(accelerator.distributed_type) == "DistributedType.DEEPSPEED"
    assert accelerator.num_processes == ranks
    set_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(make_data(48), batch_size=4)  # 6 batches a rank: 3 windows
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    params = list(model.parameters())
    records: list[dict] = []

    def whole(param: torch.Tensor) -> torch.Tensor:
        # ZeRO 3 holds a shard: gather it (a collective, on every rank, in both libraries)
        return safe_get_full_fp32_param(param) if stage == 3 else param.detach().float()

    def seen(point: str, **more) -> None:
        records.append(
            {
                "point": point,
                "sync": accelerator.sync_gradients,
                "weights": [whole(p).cpu().clone() for p in params],
                "grads": [None if p.grad is None else p.grad.cpu().clone() for p in params],
                "lr": optimizer.param_groups[0]["lr"],
                "skipped": accelerator.optimizer_step_was_skipped,
                **more,
            }
        )

    for x, y in loader:
        with accelerator.accumulate(model):
            seen("before backward")
            # Accelerate's engine takes inputs in its weights' dtype (fp16) and returns it
            out = model(x.to(params[0].dtype)).float()
            accelerator.backward(nn.functional.mse_loss(out, y))
            seen("backward")
            if accelerator.sync_gradients:
                seen("clip", norm=accelerator.clip_grad_norm_(model.parameters(), CLIP))
            optimizer.step()
            seen("optimizer.step")
            scheduler.step()
            seen("scheduler.step")
            optimizer.zero_grad()
            seen("zero_grad")
    return records


def gap(mine: list, theirs: list) -> float:
    """The largest difference between two lists of tensors (or Nones); inf where only one is
    None."""
    worst = 0.0
    for a, b in zip(mine, theirs, strict=True):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            return float("inf")
    return worst


def compare(mine: list[list[dict]], theirs: list[list[dict]], tolerance: float) -> None:
    """Every rank's records agree, point by point, to ``tolerance``."""
    for rank, (my_records, their_records) in enumerate(zip(mine, theirs, strict=True)):
        for a, b in zip(my_records, their_records, strict=True):
            where = f"rank {rank}, {a['point']}"
            assert (a["point"], a["sync"]) == (b["point"], b["sync"]), where
            assert gap(a["weights"], b["weights"]) <= tolerance, f"{where}: weights differ"
            assert gap(a["grads"], b["grads"]) <= tolerance, f"{where}: gradients differ"
            assert (a["lr"], a["skipped"]) == (b["lr"], b["skipped"]), where
            if "norm" in b:
                assert a["norm"] == pytest.approx(b["norm"], rel=tolerance, abs=tolerance), where


@pytest.mark.multiprocess
# Stage 1 keeps the gradients in ``param.grad``, where the loop reads them; stage 3 shards the
# parameters too (stage 2, between the two, is checked against one process in test_deepspeed).
@pytest.mark.parametrize("stage", [1, 3])
def test_every_point_of_the_loop_sees_what_accelerate_shows(stage):
    theirs = run_ranks(loop, "accelerate", stage)
    mine = run_ranks(loop, "nbaccel", stage)
    compare(mine, theirs, TOLERANCE)
    assert not any(r["skipped"] for r in mine[0])  # float32 skips no step

    # What those points are: the window's last backward has stepped and zeroed; step does nothing
    records = mine[0]
    for before, after in itertools.pairwise(records):
        moved = gap(before["weights"], after["weights"]) > 0
        assert moved == (after["point"] == "backward" and after["sync"]), after["point"]
        if after["point"] == "backward" and after["sync"]:
            assert all(not isinstance(g, torch.Tensor) or not g.any() for g in after["grads"])
    norms = [r["norm"] for r in records if "norm" in r]
    assert len(norms) == 3 and all(n > CLIP for n in norms)  # clipping bit at every step
