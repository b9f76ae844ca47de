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


def accelerate_deepspeed(stage: int):
    """Accelerate's Accelerator with DeepSpeed on this CPU rank.

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
    return accelerate.Accelerator(
        gradient_accumulation_steps=STEPS,
        deepspeed_plugin=plugin,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )


def loop(library: str, stage: int) -> list[dict]:
    """A loop written for Accelerate, with what it sees at each point."""
    from deepspeed.utils import safe_get_full_fp32_param

    if library == "accelerate":
        accelerator = accelerate_deepspeed(stage)
    else:
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=CLIP)
        accelerator = Accelerator(
            gradient_accumulation_steps=STEPS, deepspeed_plugin=plugin, live=False
        )
    assert str(accelerator.distributed_type) == "DistributedType.DEEPSPEED"
    assert accelerator.num_processes == 2
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
        return safe_get_full_fp32_param(param) if stage == 3 else param.detach()

    def seen(point: str, **more) -> None:
        records.append(
            {
                "point": point,
                "sync": accelerator.sync_gradients,
                "weights": [whole(p).clone() for p in params],
                "grads": [None if p.grad is None else p.grad.clone() for p in params],
                "lr": optimizer.param_groups[0]["lr"],
                "skipped": accelerator.optimizer_step_was_skipped,
                **more,
            }
        )

    for x, y in loader:
        with accelerator.accumulate(model):
            seen("before backward")
            accelerator.backward(nn.functional.mse_loss(model(x), y))
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


@pytest.mark.multiprocess
# Stage 1 keeps the gradients in ``param.grad``, where the loop reads them; stage 3 shards the
# parameters too (stage 2, between the two, is checked against one process in test_deepspeed).
@pytest.mark.parametrize("stage", [1, 3])
def test_every_point_of_the_loop_sees_what_accelerate_shows(stage):
    theirs = run_ranks(loop, "accelerate", stage)
    mine = run_ranks(loop, "nbaccel", stage)
    for rank in range(2):
        for a, b in zip(mine[rank], theirs[rank], strict=True):
            where = f"rank {rank}, ZeRO {stage}, {a['point']}"
            assert (a["point"], a["sync"]) == (b["point"], b["sync"]), where
            assert gap(a["weights"], b["weights"]) <= TOLERANCE, f"{where}: weights differ"
            assert gap(a["grads"], b["grads"]) <= TOLERANCE, f"{where}: gradients differ"
            assert a["lr"] == b["lr"] and a["skipped"] == b["skipped"] is False, where
            if "norm" in b:
                assert a["norm"] == pytest.approx(b["norm"], abs=TOLERANCE), where

    # What those points are: the window's last backward has stepped and zeroed; step does nothing
    records = mine[0]
    for before, after in itertools.pairwise(records):
        moved = gap(before["weights"], after["weights"]) > 0
        assert moved == (after["point"] == "backward" and after["sync"]), after["point"]
        if after["point"] == "backward" and after["sync"]:
            assert all(not isinstance(g, torch.Tensor) or not g.any() for g in after["grads"])
    norms = [r["norm"] for r in records if "norm" in r]
    assert len(norms) == 3 and all(n > CLIP for n in norms)  # clipping bit at every step
