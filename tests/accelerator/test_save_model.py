"""Model files by Hugging Face's names: save_model, save(safe_serialization=True), save_state's
safetensors layout and its hooks, each checked against Hugging Face Accelerate itself, run on
the same model in the same process, or against the plain model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import accelerate
import accelerate.state
import pytest
import torch
from accelerate.utils import load_checkpoint_in_model
from safetensors.torch import load_file
from torch import nn

from nbaccel import Accelerator, CheckpointError, ProjectConfiguration
from nbaccel.accelerator.model_files import shard_size


class Tied(nn.Module):
    """An output layer that shares its input layer's matrix: safetensors refuses two names
    for one tensor, so one is dropped on saving and given back on loading."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 4)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.norm(self.embed(x)))


@pytest.fixture
def theirs(monkeypatch):
    """Hugging Face Accelerate's own Accelerator, its process-wide state (and the variable it
    sets) reset afterwards."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # DeepSpeed's import, which it
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")  # may make, sets it: taken back after
    made = []

    def make(**kwargs):
        made.append(accelerate.Accelerator(cpu=True, **kwargs))
        return made[-1]

    yield make
    accelerate.state.AcceleratorState._reset_state(True)


def files(folder: Path) -> dict[str, bytes | dict]:
    """A folder's files: JSON parsed, safetensors as their tensors, the rest as bytes."""
    found = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json":
            found[path.name] = json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            found[path.name] = load_file(path)
        else:
            found[path.name] = torch.load(path, weights_only=True)
    return found


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("max_shard_size", ["10GB", 100, "0.2KB"])
@pytest.mark.parametrize("model", [Tied, lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))])
def test_save_model_writes_the_files_accelerate_writes(
    tmp_path, theirs, model, max_shard_size, safe
):
    torch.manual_seed(0)
    net = model()
    ours, accelerates = tmp_path / "ours", tmp_path / "accelerate"
    Accelerator(live=False).save_model(net, ours, max_shard_size, safe_serialization=safe)
    theirs().save_model(net, accelerates, max_shard_size, safe_serialization=safe)
    assert same(files(ours), files(accelerates))
    plain = model()
    load_checkpoint_in_model(plain, str(ours))  # Accelerate reads it back whole
    assert same(plain.state_dict(), net.state_dict())


def test_sharding_starts_a_new_file_before_a_tensor_would_overflow(tmp_path):
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))
    Accelerator(live=False).save_model(net, tmp_path, max_shard_size=100)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for shard in shards:  # 4 bytes a float, 8 for num_batches_tracked
        tensors = load_file(tmp_path / shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 100 or len(tensors) == 1
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in net.state_dict().values()
    )


def test_a_new_save_model_leaves_no_stale_file_of_the_last(tmp_path):
    accelerator, net = Accelerator(live=False), nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))
    (tmp_path / "notes.txt").write_text("mine")
    accelerator.save_model(net, tmp_path, max_shard_size=60)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) == 3
    accelerator.save_model(net, tmp_path)  # whole: shards and index would mislead a loader
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    accelerator.save_model(net, tmp_path, max_shard_size=100)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    accelerator.save_model(net, tmp_path, safe_serialization=False)  # the other format's own
    assert "pytorch_model.bin" in os.listdir(tmp_path) and "notes.txt" in os.listdir(tmp_path)


@pytest.mark.parametrize(
    "size", ["10GB", "200KB", "5MB", "10GiB", "1KiB", "3MIB", "5Gb", "3kb", 512]
)
def test_shard_sizes_are_read_as_hugging_face_reads_them(size):
    modeling = pytest.importorskip("accelerate.utils.modeling")
    assert shard_size(size) == modeling.convert_file_size_to_int(size)


def test_shard_sizes_that_mean_nothing_are_refused():
    assert shard_size("2TB") == 2 * 10**12  # beyond Hugging Face's units, read the same way
    with pytest.raises(ValueError, match="KiB, MiB, GiB or TiB"):
        shard_size("10XB")
    with pytest.raises(TypeError, match="must be bytes"):
        shard_size(True)
    with pytest.raises(ValueError, match="at least one byte"):
        shard_size(0)


def test_save_model_refuses_a_file_and_meta_weights(tmp_path):
    accelerator = Accelerator(live=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="saves into a folder"):
        accelerator.save_model(nn.Linear(2, 2), tmp_path / "file")
    with torch.device("meta"):
        empty = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="meta device"):
        accelerator.save_model(empty, tmp_path / "out")


def test_save_with_safe_serialization_is_a_safetensors_file(tmp_path, theirs):
    net = Tied()
    Accelerator(live=False).save(net.state_dict(), tmp_path / "ours", safe_serialization=True)
    theirs().save(net.state_dict(), tmp_path / "theirs", safe_serialization=True)
    assert same(load_file(tmp_path / "ours"), load_file(tmp_path / "theirs"))
    with pytest.raises(TypeError, match="dict of tensors"):
        Accelerator(live=False).save([1, 2], tmp_path / "list", safe_serialization=True)
    with pytest.raises(TypeError, match="safe_serialization=False"):
        Accelerator(live=False).save({"n": 3}, tmp_path / "n", safe_serialization=True)
    assert sorted(os.listdir(tmp_path)) == ["ours", "theirs"]  # nothing half-written


def prepared(seed: int, *models: nn.Module, **kwargs):
    torch.manual_seed(seed)
    accelerator = Accelerator(live=False, **kwargs)
    prepared_models = accelerator.prepare(*models)
    return accelerator, prepared_models


@pytest.mark.parametrize("safe", [True, False])
def test_save_state_names_model_files_as_accelerate_and_loads_tied_weights(tmp_path, safe):
    accelerator, (tied, plain) = prepared(0, Tied(), nn.Linear(2, 3))
    accelerator.save_state(tmp_path / "ckpt", safe_serialization=safe)
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    expected = (
        {"model.safetensors", "model_1.safetensors"} if safe else {"model_0.pt", "model_1.pt"}
    )
    assert expected <= names
    other, (tied2, plain2) = prepared(1, Tied(), nn.Linear(2, 3))
    other.load_state(tmp_path / "ckpt")
    assert same(tied2.state_dict(), tied.state_dict()) and same(
        plain2.state_dict(), plain.state_dict()
    )
    assert tied2.head.weight is tied2.embed.weight  # still tied after loading


def test_save_state_model_file_matches_accelerates(tmp_path, theirs):
    torch.manual_seed(0)
    net = Tied()
    Accelerator(live=False).prepare(net)
    ours = Accelerator(live=False)
    ours.prepare(net)
    ours.save_state(tmp_path / "ours")
    accelerator = theirs()
    accelerator.prepare(net)
    accelerator.save_state(tmp_path / "theirs")
    model_file = "model.safetensors"
    assert same(
        load_file(tmp_path / "ours" / model_file), load_file(tmp_path / "theirs" / model_file)
    )


def test_a_truncated_safetensors_file_is_named(tmp_path):
    accelerator, model = prepared(0, nn.Linear(3, 2))
    accelerator.save_state(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:20])
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        accelerator.load_state(tmp_path / "ckpt")
    assert torch.equal(model.weight, before)


def test_hooks_see_what_accelerate_gives_them_and_change_what_is_saved(tmp_path):
    accelerator, (first, second) = prepared(0, nn.Linear(2, 2), nn.Linear(3, 3))
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", [type(m).__name__ for m in models], len(weights)))
        Path(output_dir, "config.json").write_text('{"kept": 1}')
        weights.pop(1)  # the second model is saved by this hook's own means, say

    def load_hook(models, input_dir):
        calls.append(("load", json.loads(Path(input_dir, "config.json").read_text())))
        models.pop(1)

    handles = [
        accelerator.register_save_state_pre_hook(save_hook),
        accelerator.register_load_state_pre_hook(load_hook),
    ]
    folder = accelerator.save_state(tmp_path / "ckpt")
    assert folder == str(tmp_path / "ckpt")
    names = os.listdir(folder)
    assert "config.json" in names and "model.safetensors" in names
    assert "model_1.safetensors" not in names
    saved_first = first.weight.detach().clone()
    with torch.no_grad():
        first.weight.zero_()
        second.weight.zero_()
    accelerator.load_state(folder)
    assert torch.equal(first.weight, saved_first)
    assert not second.weight.any()  # the load hook kept it out
    assert calls == [("save", ["Linear", "Linear"], 2), ("load", {"kept": 1})]
    for handle in handles:
        handle.remove()
    accelerator.save_state(tmp_path / "again")
    assert "model_1.safetensors" in os.listdir(tmp_path / "again") and len(calls) == 2
    with pytest.raises(TypeError, match="takes a function"):
        accelerator.register_save_state_pre_hook("not a function")


def test_register_for_checkpointing_names_each_object_it_cannot_keep():
    accelerator = Accelerator(live=False)
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError) as raised:
        accelerator.register_for_checkpointing(net, torch.ones(2), object())
    message = str(raised.value)
    assert "Item at index 1, a torch.Tensor" in message
    assert "Item at index 2, a builtins.object" in message and "index 0" not in message
    assert accelerator._registered == []  # nothing kept from a refused call


def test_get_state_dict_unwrap_false_keeps_the_wrappers_prefix():
    accelerator, net = Accelerator(live=False), nn.Linear(2, 2)
    wrapped = nn.DataParallel(net)
    assert list(accelerator.get_state_dict(wrapped, unwrap=False)) == [
        "module.weight",
        "module.bias",
    ]
    assert same(accelerator.get_state_dict(wrapped), net.state_dict())


def test_project_dir_given_to_the_accelerator_serves_automatic_naming(tmp_path):
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=1)
    accelerator = Accelerator(project_dir=str(tmp_path), project_config=config, live=False)
    accelerator.prepare(nn.Linear(2, 2))
    assert accelerator.project_dir == str(tmp_path) and accelerator.save_iteration == 0
    first = accelerator.save_state()
    second = accelerator.save_state()
    assert first.endswith("checkpoint_0") and second.endswith("checkpoint_1")
    assert (
        os.listdir(tmp_path / "checkpoints") == ["checkpoint_1"] and accelerator.save_iteration == 2
    )
    accelerator.load_state()  # the newest
    given = ProjectConfiguration(project_dir=str(tmp_path / "own"))
    assert Accelerator(
        project_dir=str(tmp_path), project_config=given, live=False
    ).project_dir == str(
        tmp_path / "own"
    )  # as Accelerate: the configuration's own folder comes first


def test_load_state_takes_accelerates_map_locations_and_refuses_the_rest(tmp_path):
    accelerator, _ = prepared(0, nn.Linear(2, 2))
    accelerator.save_state(tmp_path / "ckpt")
    accelerator.load_state(tmp_path / "ckpt", map_location="cpu")
    accelerator.load_state(tmp_path / "ckpt", map_location="on_device")
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed"):
        accelerator.load_state(tmp_path / "ckpt", map_location="invalid")
    with pytest.raises(TypeError, match="strict"):
        accelerator.load_state(tmp_path / "ckpt", strict=False)
    with pytest.raises(TypeError, match="weights_only=True"):
        accelerator.load_state(tmp_path / "ckpt", load_kwargs={"weights_only": False})
    with pytest.raises(TypeError, match="DeepSpeed's save_checkpoint"):
        accelerator.save_state(tmp_path / "other", tag="x")


def test_overlapping_views_of_one_tensor_are_saved_as_safetensors(tmp_path):
    class Views(nn.Module):  # a buffer that is a slice of a parameter: not one tensor twice
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.arange(6.0))
            self.register_buffer("head", self.weight.data[:3], persistent=True)

    accelerator, model = prepared(0, Views())
    accelerator.save_state(tmp_path / "ckpt")
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert same(saved, {"weight": torch.arange(6.0), "head": torch.arange(3.0)})
    accelerator.load_state(tmp_path / "ckpt")
    assert same(model.state_dict(), saved)


def test_a_checkpoint_written_before_model_files_were_named_still_loads(tmp_path):
    accelerator, model = prepared(0, nn.Linear(3, 2))
    accelerator.save_state(tmp_path / "ckpt", safe_serialization=False)
    manifest_path = tmp_path / "ckpt" / "nbaccel_state.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["model_files"]
    manifest_path.write_text(json.dumps({**manifest, "format": 2}))  # as format 2 wrote it
    other, other_model = prepared(1, nn.Linear(3, 2))
    other.load_state(tmp_path / "ckpt")
    assert same(other_model.state_dict(), model.state_dict())
