"""DeepSpeed ZeRO through the Accelerator on 2 CPU ranks (gloo), against plain PyTorch in one
process; and the plugin's settings, checked before any engine starts. `make` installs the
deepspeed extra: without it these tests fail with the install hint, they do not skip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from nbaccel import Accelerator, CheckpointError, DeepSpeedPlugin, notebook_launcher, set_seed
from nbaccel.accelerator.strategies import ds_config
from nbaccel.accelerator.strategies.ds_config import build_config
from nbaccel.config import LaunchConfig, resolve_sharding

from ...distributed import run_ranks
from ..test_multiprocess import DDP_TOLERANCE, make_model
from .test_fsdp import save_then_load, sharded_against_one_process, sharded_in_bf16

CPU = torch.device("cpu")


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage, steps", [(1, 1), (2, 2), (3, 2)])
def test_zero_matches_one_process_and_saves_a_plain_state_dict(tmp_path, stage, steps):
    results = run_ranks(sharded_against_one_process, f"zero{stage}", steps, str(tmp_path))
    for r in results:
        assert r["gap"] < DDP_TOLERANCE, f"ZeRO {stage}: weights differ by {r['gap']:.2e}"
        assert r["saved_gap"] == 0.0
    if stage == 3:  # each rank holds half of every parameter
        assert max(r["local"] for r in results) <= 0.6 * results[0]["total"]
    else:
        assert results[0]["local"] == results[0]["total"]


def zero_clips_like_torch(max_norm: float) -> tuple[float, float]:
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=max_norm)
    accelerator = Accelerator(deepspeed_plugin=plugin, live=False)
    set_seed(0)
    model, reference = make_model(), make_model()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    y = x.sum(dim=1, keepdim=True) * 10  # large gradients: clipping bites
    mine = slice(8 * accelerator.rank, 8 * accelerator.rank + 8)
    norm_gap = 0.0
    for _ in range(3):
        accelerator.backward(nn.functional.mse_loss(model(x[mine]), y[mine]))  # and the step
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)  # the step's norm
        optimizer.step()
        optimizer.zero_grad()
        plain.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        plain_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        plain.step()
        assert isinstance(norm, float) and norm > max_norm  # as Accelerate returns it
        norm_gap = max(norm_gap, abs(norm - plain_norm.item()))
    # collectives keep working beside the engine
    gathered = accelerator.gather_for_metrics(torch.tensor([accelerator.rank]))
    assert gathered.tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"DeepSpeedPlugin\(gradient_clipping=2\.0\)"):
        accelerator.clip_grad_norm_(model.parameters(), 2.0)  # not what the engine was given
    full = accelerator.get_state_dict(model)
    accelerator.end_training()
    gap = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return gap, norm_gap


@pytest.mark.multiprocess
def test_gradient_clipping_given_once_matches_torch_clipping():
    for gap, norm_gap in run_ranks(zero_clips_like_torch, 0.5):
        assert gap < DDP_TOLERANCE, f"clipped weights differ by {gap:.2e}"
        assert norm_gap < DDP_TOLERANCE, f"returned norms differ by {norm_gap:.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trains_in_bf16(stage):
    for first, last, out, saved in run_ranks(sharded_in_bf16, f"zero{stage}"):
        assert last < first / 2, (first, last)
        assert out == saved == "torch.float32"


def zero3_in_bf16_with_autocast_off_in_the_engine() -> tuple[float, float, str, str, int]:
    """``sharded_in_bf16`` under ZeRO 3, the engine turning off an autocast entered outside it
    around its module, as DeepSpeed 0.19 does with CUDA's (``torch_autocast`` unset): the GPU's
    path, on the CPU. Last, how many forwards went through the stand-in."""
    import contextlib

    from deepspeed.runtime import engine

    assert hasattr(engine, "autocast_if_enabled"), "DeepSpeed's forward no longer calls it"
    entered = []

    @contextlib.contextmanager
    def autocast_off(_engine):
        entered.append(True)
        with torch.autocast("cpu", enabled=False):
            yield

    engine.autocast_if_enabled = autocast_off
    return (*sharded_in_bf16("zero3"), len(entered))


@pytest.mark.multiprocess
def test_zero_trains_in_bf16_where_the_engine_turns_autocast_off():
    # the first GPU run with DeepSpeed failed here: float32 inputs met bf16 weights
    for first, last, out, saved, entered in run_ranks(
        zero3_in_bf16_with_autocast_off_in_the_engine
    ):
        assert entered == 30  # every forward of the loop met the stand-in
        assert last < first / 2, (first, last)
        assert out == saved == "torch.float32"


@pytest.mark.multiprocess
def test_zero_save_state_then_load_state_continues_identically(tmp_path):
    folder = tmp_path / "ckpt"
    for restored, continued, _ in run_ranks(save_then_load, str(folder), "zero3"):
        assert restored == 0.0
        assert continued == 0.0, f"training after load_state differs by {continued:.2e}"
    assert (folder / "deepspeed").is_dir() and (folder / "nbaccel_state.json").is_file()
    assert not list(tmp_path.glob(".ckpt*"))  # no staging folder left behind
    # a DeepSpeed checkpoint is refused by name by a DDP run, before anything loads
    plain = Accelerator(live=False)
    plain.prepare(make_model(), torch.optim.AdamW(make_model().parameters()))
    with pytest.raises(CheckpointError, match="saved by a run with DeepSpeed"):
        plain.load_state(folder)
    plain.end_training()


# Two runs in this one process: the second also checks that end_training released the
# process group through DeepSpeed, which otherwise keeps the destroyed group and fails.
@pytest.mark.parametrize("stage, offload", [(2, None), (3, "cpu")])
@pytest.mark.process
def test_one_process_trains_through_deepspeed_and_leaves_nothing_behind(stage, offload):
    plugin = DeepSpeedPlugin(zero_stage=stage, offload_optimizer_device=offload)
    accelerator = Accelerator(deepspeed_plugin=plugin, live=False)
    set_seed(0)
    model, reference = make_model(), make_model()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.3)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    assert accelerator.prepare(model, optimizer) == (model, optimizer)  # prepared stays as is
    assert len(accelerator._models) == 1  # and is not prepared (wrapped, counted) again
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    plain_schedule = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(4):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        schedule.step()  # the learning rate reaches the engine's optimizer
        plain.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
        plain_schedule.step()
    assert not accelerator.optimizer_step_was_skipped
    with pytest.raises(ValueError, match=r"accelerator.backward\(loss\) steps the engine"):
        optimizer.step(lambda: 0.0)
    full = accelerator.get_state_dict(model)
    accelerator.end_training()
    assert max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()) < 1e-6
    assert not torch.distributed.is_initialized()
    # LOCAL_RANK and DS_ACCELERATOR are set for DeepSpeed and removed again (the autouse
    # fixture in conftest.py checks the whole environment after every test)
    assert "LOCAL_RANK" not in os.environ and "DS_ACCELERATOR" not in os.environ


def test_model_and_optimizer_must_be_prepared_together():
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=1), live=False)
    model = make_model()
    try:
        with pytest.raises(ValueError, match=r"prepared in the same call.*1 trainable model"):
            accelerator.prepare(model)
        with pytest.raises(ValueError, match="0 trainable model"):
            accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        accelerator.end_training()


def config(**kwargs) -> dict:
    options = {"mixed_precision": "no", "precision_given": False, "accumulation": 1}
    return build_config(
        DeepSpeedPlugin(**kwargs.pop("plugin", {})), **{**options, **kwargs}, device=CPU
    )


def test_settings_reach_the_engine_and_deepspeed_defaults_do_not_change_results():
    cfg, mode, steps = config(plugin={"zero_stage": 3}, mixed_precision="bf16", accumulation=4)
    assert (mode, steps) == ("bf16", 4)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed would clip at 1.0 when unset
    assert cfg["zero_allow_untested_optimizer"] is True  # a torch.optim optimizer is fine
    default, _, _ = config()
    assert default["zero_optimization"]["stage"] == 2
    # a setting given only in the config is taken from there
    given = {"gradient_accumulation_steps": 2, "bf16": {"enabled": True}}
    cfg, mode, steps = config(plugin={"config": given})
    assert (mode, steps) == ("bf16", 2)
    offload, _, _ = config(plugin={"zero_stage": 2, "offload_optimizer_device": "cpu"})
    assert offload["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert offload["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"plugin": {"zero_stage": 1, "config": {"zero_optimization": {"stage": 3}}}},
            r"zero_stage=1 contradicts .*stage=3",
        ),
        (
            {"plugin": {"config": {"gradient_accumulation_steps": 4}}, "accumulation": 2},
            "gradient_accumulation_steps=2 contradicts the DeepSpeed config's 4",
        ),
        (
            {"plugin": {"config": {"bf16": {"enabled": True}}}, "precision_given": True},
            r"mixed_precision='no' contradicts .* enables bf16",
        ),
        (
            {"plugin": {"gradient_clipping": 1.0, "config": {"gradient_clipping": 0.5}}},
            "gradient_clipping=1.0 contradicts",
        ),
        ({"mixed_precision": "fp16"}, "needs a GPU .* use mixed_precision='bf16'"),
        ({"plugin": {"zero_stage": 0, "offload_optimizer_device": "cpu"}}, "needs zero_stage 1"),
    ],
)
def test_contradictions_are_errors_not_silent_overrides(kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs)


def test_bad_plugin_values_and_config_files_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="must be 0, 1, 2 or 3"):
        DeepSpeedPlugin(zero_stage=4)
    with pytest.raises(ValueError, match="must be 'none' or 'cpu'"):
        DeepSpeedPlugin(offload_optimizer_device="nvme")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        config(plugin={"config": tmp_path / "missing.json"})
    broken = tmp_path / "ds.json"
    broken.write_text("{'stage': 3")
    with pytest.raises(ValueError, match="is not valid JSON"):
        config(plugin={"config": broken})
    broken.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert config(plugin={"config": broken})[0]["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match="choose one way to shard"):
        Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(), fsdp_plugin=__import__("nbaccel").FSDPPlugin()
        )


def test_without_deepspeed_installed_the_error_says_how_to_install(monkeypatch):
    from nbaccel.accelerator.strategies import ds_config

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what a missing package looks like
    with pytest.raises(ImportError, match=r"nbaccel\[deepspeed\]"):
        ds_config.import_deepspeed(CPU)


def test_launch_options_resolve_against_the_config_file():
    none, stage1, fsdp = LaunchConfig(), LaunchConfig(zero_stage=1), LaunchConfig(fsdp=True)
    assert resolve_sharding(none, None, None, None) == (False, None)
    assert resolve_sharding(none, None, True, None) == (False, 2)  # DeepSpeed's usual stage
    assert resolve_sharding(stage1, None, True, None) == (False, 1)
    assert resolve_sharding(stage1, None, None, 3) == (False, 3)
    assert resolve_sharding(stage1, None, False, None) == (False, None)
    assert resolve_sharding(stage1, True, None, None) == (True, None)  # FSDP turns ZeRO off
    assert resolve_sharding(fsdp, None, None, 2) == (False, 2)
    with pytest.raises(ValueError, match="choose one way to shard"):
        resolve_sharding(none, True, None, 2)
    with pytest.raises(ValueError, match="choose one way to shard"):
        LaunchConfig(fsdp=True, zero_stage=2)


def stage_from_the_launch() -> int | None:
    accelerator = Accelerator(live=False)  # no plugin given: the launch asked for DeepSpeed
    model = make_model()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stage = model.zero_optimization_stage() if accelerator.deepspeed_plugin else None
    accelerator.end_training()
    return stage


@pytest.mark.multiprocess
def test_notebook_launcher_and_nbaccel_launch_ask_for_deepspeed(tmp_path, monkeypatch):
    monkeypatch.setenv("NBACCEL_CONFIG", str(tmp_path / "none.json"))
    values = notebook_launcher(
        stage_from_the_launch, num_processes=2, zero_stage=3, return_all=True, timeout=180
    )
    assert values == [3, 3]
    path = tmp_path / "train.py"
    path.write_text(
        "import torch\nfrom nbaccel import Accelerator\n"
        "a = Accelerator(live=False)\nm = torch.nn.Linear(4, 4)\n"
        "m, o = a.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "print(f'rank {a.rank} stage {m.zero_optimization_stage()}')\na.end_training()\n"
    )
    command = [sys.executable, "-m", "nbaccel.cli", "launch", "--cpu", "-n", "2", "--deepspeed"]
    done = subprocess.run(
        [*command, "--zero-stage", "1", str(path)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 stage 1" in done.stdout and "rank 1 stage 1" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL, DeepSpeed's fp16)")
def test_fp16_loss_scaling_on_gpu_with_nccl():
    def fp16_on_gpus() -> tuple[float, float, str]:
        plugin = DeepSpeedPlugin(zero_stage=2)
        accelerator = Accelerator(mixed_precision="fp16", deepspeed_plugin=plugin, live=False)
        torch.manual_seed(0)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        x = torch.randn(64, 8, device=accelerator.device)
        y = (x[:, :1] * x[:, 1:2]).sin()
        losses = []
        for _ in range(40):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        backend = torch.distributed.get_backend()
        accelerator.end_training()
        return losses[0], losses[-1], backend

    results = notebook_launcher(
        fp16_on_gpus, num_processes=min(2, torch.cuda.device_count()), return_all=True, timeout=300
    )
    for first, last, backend in results:
        assert last < first / 2, (first, last)
        assert backend == ("nccl" if len(results) > 1 else backend)


def test_deepspeeds_start_up_finds_the_tools_of_this_environment(monkeypatch, tmp_path):
    """DeepSpeed runs ``ninja`` from PATH to load its op; a kernel registered from a venv does
    not have the venv's bin (where pip put ninja) on PATH."""
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with ds_config.quiet_start():  # what the Accelerator runs deepspeed.initialize in
        found = shutil.which("ninja")
    assert found == os.path.join(os.path.dirname(sys.executable), "ninja")
    assert os.environ["PATH"] == str(tmp_path) and shutil.which("ninja") is None


def test_deepspeeds_start_up_keeps_the_ninja_already_on_path(monkeypatch, tmp_path):
    """Two ninja versions rebuild the cached op whenever the other built it last, so the one
    every other process here runs (the first on PATH) is kept first."""
    theirs = tmp_path / "ninja"
    theirs.write_text("#!/bin/sh\n")
    theirs.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with ds_config.quiet_start():
        assert shutil.which("ninja") == str(theirs)


def test_an_abandoned_op_build_lock_is_named_before_deepspeed_waits_on_it(
    monkeypatch, tmp_path, capsys
):
    """torch's build lock holds no pid, so a build killed midway leaves it and DeepSpeed then
    waits forever: an old lock is named, with what to do; a fresh one (a build under way) is not.
    The lock's age is set, not waited for."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    ds_config.warn_stale_build_lock()
    assert capsys.readouterr().err == ""
    hour_ago = os.stat(lock).st_mtime - 3600
    os.utime(lock, (hour_ago, hour_ago))
    ds_config.warn_stale_build_lock()
    said = capsys.readouterr().err
    assert f"DeepSpeed's op build lock {lock} is 6" in said and " min old: a build" in said
    assert "delete that file and run this again" in said
