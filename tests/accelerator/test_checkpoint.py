"""Saves that cannot half-happen, and checkpoints that load whole or not at all."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch import nn

from nbaccel import Accelerator, CheckpointError
from nbaccel.accelerator.checkpoint import atomic_save


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("interrupted halfway through the save")


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_an_interrupted_save_leaves_the_previous_file(tmp_path):
    path = tmp_path / "model.pt"
    atomic_save({"w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="interrupted halfway"):
        atomic_save({"w": torch.zeros(10_000), "bad": Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary file left


def test_save_into_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"the folder .*nowhere does not exist"):
        Accelerator().save({}, tmp_path / "nowhere" / "model.pt")


def prepared(seed=0, mixed_precision="no"):
    torch.manual_seed(seed)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.backward(model(torch.ones(1, 3)).sum())
    optimizer.step()
    scheduler.step()
    return accelerator, model


def test_round_trip_restores_weights_rng_and_step(tmp_path):
    accelerator, model = prepared()
    accelerator.step = 7
    accelerator.save_state(tmp_path / "ckpt")
    draw = torch.rand(3)
    other, other_model = prepared(seed=1)
    other.load_state(tmp_path / "ckpt")
    assert torch.equal(other_model.weight, model.weight) and other.step == 7
    assert torch.equal(torch.rand(3), draw)  # the RNG continues where the save left it
    assert other._optimizers[0].state_dict()["state"][0]["step"] == 1
    assert other._schedulers[0].last_epoch == 1


def test_an_interrupted_save_state_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    accelerator, _ = prepared()
    accelerator.save_state(tmp_path / "ckpt")
    before = snapshot(tmp_path / "ckpt")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("nbaccel.accelerator.checkpoint._swap_in", crash)
    with pytest.raises(KeyboardInterrupt):
        accelerator.save_state(tmp_path / "ckpt")
    assert snapshot(tmp_path / "ckpt") == before
    monkeypatch.undo()
    prepared(seed=3)[0].load_state(tmp_path / "ckpt")


def loading_fails(folder: Path, match: str):
    accelerator, model = prepared(seed=5)
    weights = model.weight.detach().clone()
    before = snapshot(folder) if folder.exists() else None
    with pytest.raises(CheckpointError, match=match):
        accelerator.load_state(folder)
    assert torch.equal(model.weight, weights)  # nothing applied
    assert (snapshot(folder) if folder.exists() else None) == before  # nothing written


def test_load_state_of_a_missing_folder(tmp_path):
    loading_fails(tmp_path / "nope", r"no checkpoint at .*nope: the folder does not exist")


def test_load_state_of_a_folder_without_manifest(tmp_path):
    (tmp_path / "ckpt").mkdir()
    loading_fails(tmp_path / "ckpt", r"nbaccel_state.json is missing")


def test_load_state_of_a_partial_checkpoint(tmp_path):
    prepared()[0].save_state(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "optimizer_0.pt").unlink()
    loading_fails(tmp_path / "ckpt", r"is incomplete: missing optimizer_0.pt")


def test_load_state_of_a_corrupt_file(tmp_path):
    prepared()[0].save_state(tmp_path / "ckpt", safe_serialization=False)  # model_0.pt
    path = tmp_path / "ckpt" / "model_0.pt"
    path.write_bytes(path.read_bytes()[:100])
    loading_fails(tmp_path / "ckpt", r"model_0.pt is corrupt or truncated")


def test_load_state_into_a_different_model(tmp_path):
    torch.manual_seed(0)
    accelerator = Accelerator()
    accelerator.prepare(nn.Linear(3, 4))
    accelerator.save_state(tmp_path / "ckpt")
    other = Accelerator()
    other.prepare(nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"weight: saved \(4, 3\), model has \(2, 3\)"):
        other.load_state(tmp_path / "ckpt")


def test_load_state_with_other_objects_prepared(tmp_path):
    prepared()[0].save_state(tmp_path / "ckpt")
    accelerator = Accelerator()
    accelerator.prepare(nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"holds 1 optimizers, but 0 were prepared"):
        accelerator.load_state(tmp_path / "ckpt")


def test_load_state_needs_the_same_mixed_precision(tmp_path):
    prepared(mixed_precision="fp16")[0].save_state(tmp_path / "ckpt")
    loading_fails(
        tmp_path / "ckpt", r"saved with an fp16 GradScaler, but this Accelerator has none"
    )
