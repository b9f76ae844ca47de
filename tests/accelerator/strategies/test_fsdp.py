"""FSDP2 through the Accelerator on 2 CPU ranks (gloo), against plain PyTorch in one process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nbaccel import Accelerator, FSDPPlugin, set_seed

from ...distributed import run_ranks
from ..test_multiprocess import DDP_TOLERANCE, make_model, train

pytestmark = pytest.mark.multiprocess


# DeepSpeed keeps parameters under 1e5 elements whole on every rank in ZeRO 3 (its default
# stage3_param_persistence_threshold); the test model is tiny, so shard every parameter.
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def sharded_accelerator(strategy: str, steps: int = 1, mixed_precision="no") -> Accelerator:
    """``"fsdp"``, ``"fsdp-keep"`` (no resharding after forward), ``"fsdp-hf"`` (HF
    Accelerate's plugin name and arguments, every Linear its own unit) or ``"zero1"``..
    ``"zero3"``: a name, so that it crosses to spawned ranks."""
    from nbaccel import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    options = {"gradient_accumulation_steps": steps, "mixed_precision": mixed_precision}
    if strategy == "fsdp-hf":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Linear"],
            sharding_strategy="SHARD_GRAD_OP",
        )
        return Accelerator(fsdp_plugin=plugin, live=False, **options)
    if strategy.startswith("fsdp"):
        plugin = FSDPPlugin(reshard_after_forward=strategy == "fsdp")
        return Accelerator(fsdp_plugin=plugin, live=False, **options)
    plugin = DeepSpeedPlugin(zero_stage=int(strategy[-1]), config=SHARD_ALL)
    return Accelerator(deepspeed_plugin=plugin, live=False, **options)


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds: FSDP2's DTensor shards, ZeRO 3's partitions."""
    module = getattr(model, "module", model)  # a DeepSpeed engine holds the user's model
    local = [getattr(p, "ds_tensor", p) for p in module.parameters()]
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in local)


def sharded_against_one_process(strategy: str, steps: int, folder: str) -> dict:
    accelerator = sharded_accelerator(strategy, steps)
    train(accelerator, batch_size=8)
    model = accelerator._models[0]
    local = local_numel(model)
    full = accelerator.get_state_dict(model)
    # the lessons' save line writes the whole model, loadable into a plain module
    accelerator.save(accelerator.unwrap_model(model).state_dict(), f"{folder}/model.pt")
    accelerator.wait_for_everyone()
    saved = make_model()
    saved.load_state_dict(torch.load(f"{folder}/model.pt", weights_only=True))
    expected = train(None, batch_size=8 * 2 * steps)
    accelerator.end_training()
    return {
        "gap": max((full[k] - expected[k]).abs().max().item() for k in expected),
        "saved_gap": max((v - full[k]).abs().max().item() for k, v in saved.state_dict().items()),
        "local": local,
        "total": sum(v.numel() for v in expected.values()),
    }


@pytest.mark.parametrize("strategy, steps", [("fsdp", 1), ("fsdp-keep", 2), ("fsdp-hf", 1)])
def test_fsdp_matches_one_process_and_saves_a_plain_state_dict(tmp_path, strategy, steps):
    results = run_ranks(sharded_against_one_process, strategy, steps, str(tmp_path))
    for r in results:
        assert r["gap"] < DDP_TOLERANCE, f"weights differ by {r['gap']:.2e}"
        assert r["saved_gap"] == 0.0
    # each rank holds about half of the parameters, and together all of them
    assert sum(r["local"] for r in results) == results[0]["total"]
    assert max(r["local"] for r in results) <= 0.6 * results[0]["total"]


def sharded_in_bf16(strategy: str) -> tuple[float, float, str, str]:
    """First and last loss of 30 bf16 steps, the output dtype and the saved weights' dtype."""
    accelerator = sharded_accelerator(strategy, mixed_precision="bf16")
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(64, 8)
    y = (x[:, :1] * x[:, 1:2]).sin()
    losses = []
    for _ in range(30):
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    saved = accelerator.get_state_dict(model)
    accelerator.end_training()
    return losses[0], losses[-1], str(out.dtype), str(next(iter(saved.values())).dtype)


def test_fsdp_trains_in_bf16():
    for first, last, out, saved in run_ranks(sharded_in_bf16, "fsdp"):
        assert last < first / 2, (first, last)
        assert out == saved == "torch.float32"  # float32 outputs; float32 sharded weights


def test_fp16_with_fsdp_is_refused_with_a_way_out():
    with pytest.raises(ValueError, match="use mixed_precision='bf16'"):
        Accelerator(mixed_precision="fp16", fsdp_plugin=FSDPPlugin())
    with pytest.raises(TypeError, match=r"must be an nbaccel\.FullyShardedDataParallelPlugin"):
        Accelerator(fsdp_plugin={"zero_stage": 3})


def sharded_by_the_launch() -> tuple[bool, int]:
    from nbaccel.accelerator.strategies.fsdp import is_sharded

    accelerator = Accelerator(live=False)  # no plugin given: the launch asked for FSDP
    model = accelerator.prepare(make_model())
    sharded = is_sharded(model)
    local = sum((p.to_local() if sharded else p).numel() for p in model.parameters())
    accelerator.end_training()
    return sharded, local


def test_notebook_launcher_and_nbaccel_launch_ask_for_fsdp(tmp_path):
    import os
    import subprocess
    import sys

    from nbaccel import notebook_launcher

    values = notebook_launcher(
        sharded_by_the_launch, num_processes=2, fsdp=True, return_all=True, timeout=120
    )
    assert [v[0] for v in values] == [True, True] and sum(v[1] for v in values) == 321
    assert notebook_launcher(sharded_by_the_launch, num_processes=2, timeout=120)[0] is False

    path = tmp_path / "train.py"
    path.write_text(
        "import torch\nfrom nbaccel import Accelerator\n"
        "from nbaccel.accelerator.strategies.fsdp import is_sharded\n"
        "a = Accelerator(live=False)\nm = a.prepare(torch.nn.Linear(4, 4))\n"
        "print(f'rank {a.rank} sharded {is_sharded(m)}')\na.end_training()\n"
    )
    env = {**os.environ, "NBACCEL_CONFIG": str(tmp_path / "none.json")}
    command = [sys.executable, "-m", "nbaccel.cli", "launch", "--cpu", "-n", "2", "--fsdp"]
    done = subprocess.run(
        [*command, str(path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 sharded True" in done.stdout and "rank 1 sharded True" in done.stdout


def save_then_load(folder: str, strategy: str) -> tuple[float, float, dict]:
    """Train, save_state, train on, load_state, train again: ``(saved vs restored weights,
    first continuation vs second, the saved weights)``, gaps 0.0 when resuming is exact.
    ``strategy``: see ``sharded_accelerator``."""
    accelerator = sharded_accelerator(strategy)
    set_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # state that must come back
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.rank)
    x = torch.randn(32, 8, generator=g)
    y = x[:, :1].sin()

    def steps(n: int) -> dict:
        for _ in range(n):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return accelerator.get_state_dict(model)

    saved = steps(3)
    accelerator.save_state(folder)
    continued = steps(3)
    accelerator.load_state(folder)  # back to the saved weights and Adam moments
    restored = accelerator.get_state_dict(model)
    again = steps(3)
    accelerator.end_training()

    def gap(a: dict, b: dict) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    return gap(saved, restored), gap(continued, again), saved


def test_fsdp_save_state_then_load_state_continues_identically(tmp_path):
    folder = tmp_path / "ckpt"
    results = run_ranks(save_then_load, str(folder), "fsdp")
    for restored, continued, _ in results:
        assert restored == 0.0
        assert continued == 0.0, f"training after load_state differs by {continued:.2e}"
    plain = make_model()  # the checkpoint's model file is whole and plain
    plain.load_state_dict(load_file(folder / "model.safetensors"))  # save_state's default
    saved = results[0][2]
    assert all(torch.equal(v, saved[k]) for k, v in plain.state_dict().items())


def test_the_config_file_can_ask_for_fsdp(tmp_path, monkeypatch):
    import json

    from nbaccel import notebook_launcher

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_processes": 2, "cpu": True, "fsdp": True}))
    monkeypatch.setenv("NBACCEL_CONFIG", str(config))
    assert notebook_launcher(sharded_by_the_launch, timeout=120)[0] is True
    assert notebook_launcher(sharded_by_the_launch, fsdp=False, timeout=120)[0] is False
