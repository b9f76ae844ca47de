"""``FullyShardedDataParallelPlugin`` and ``DeepSpeedPlugin(hf_ds_config=...)``: HF Accelerate's
names and arguments, so a loop's plugin line ports with its import changed."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

import nbaccel
import nbaccel.utils
from nbaccel import DeepSpeedPlugin, FSDPPlugin, FullyShardedDataParallelPlugin


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):
        return self.inner(x)


def model() -> nn.Module:
    # 4*4+4 = 20, then two Blocks of 8*8+8 = 72, then 8*2+2 = 18 parameters
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(Block(8), Block(8)), nn.Linear(8, 2))


def names(units: list[nn.Module]) -> list[str]:
    return [f"{type(u).__name__}{sum(p.numel() for p in u.parameters())}" for u in units]


def test_one_class_under_both_names_and_both_modules():
    assert FSDPPlugin is FullyShardedDataParallelPlugin
    assert nbaccel.utils.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin
    assert nbaccel.utils.DeepSpeedPlugin is DeepSpeedPlugin


def test_every_argument_of_hf_accelerates_plugin_is_accepted_by_name():
    hf = pytest.importorskip("accelerate.utils")
    theirs = {f.name for f in dataclasses.fields(hf.FullyShardedDataParallelPlugin)}
    ours = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    assert theirs <= ours, f"HF's arguments missing here: {sorted(theirs - ours)}"
    # HF's defaults construct it, and so does the line a loop for HF writes
    FullyShardedDataParallelPlugin(**{f: None for f in theirs - {"limit_all_gathers"}})
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)
    assert plugin.reshard_after_forward is False


def test_units_by_default_by_class_by_size_and_by_torchs_policies():
    assert names(FullyShardedDataParallelPlugin().units(model())) == [
        "Linear20",
        "Sequential144",
        "Linear18",
    ]
    by_class = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    assert names(by_class.units(model())) == ["Block72", "Block72"]
    torch_class = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert names(FullyShardedDataParallelPlugin(auto_wrap_policy=torch_class).units(model())) == [
        "Block72",
        "Block72",
    ]
    # innermost first; a parent counts only what its chosen children left out
    by_size = FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap", min_num_params=60)
    assert names(by_size.units(model())) == ["Linear72", "Linear72"]
    torch_size = functools.partial(size_based_auto_wrap_policy, min_num_params=60)
    assert names(FullyShardedDataParallelPlugin(auto_wrap_policy=torch_size).units(model())) == [
        "Linear72",
        "Linear72",
    ]
    by_size = FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap", min_num_params=19)
    assert names(by_size.units(model())) == ["Linear72", "Linear72", "Linear20"]
    assert FullyShardedDataParallelPlugin(auto_wrap_policy="no_wrap").units(model()) == []


@pytest.mark.parametrize(
    "arguments, says",
    [
        ({"fsdp_version": 1}, "FSDP2"),
        ({"sharding_strategy": "NO_SHARD"}, "DDP"),
        ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False}, "one of the two"),
        ({"reshard_after_forward": "yes"}, "True or False"),
        ({"activation_checkpointing": True}, "torch.utils.checkpoint"),
        ({"mixed_precision_policy": "bf16"}, "Accelerator(mixed_precision='bf16')"),
        ({"state_dict_type": "SHARDED_STATE_DICT"}, "FULL_STATE_DICT"),
        ({"auto_wrap_policy": "transformer_based_wrap"}, "transformer_cls_names_to_wrap"),
        ({"auto_wrap_policy": "by_magic"}, "one of"),
    ],
)
def test_what_nbaccel_cannot_do_is_refused_saying_what_to_do(arguments, says):
    with pytest.raises(ValueError, match=None) as error:
        FullyShardedDataParallelPlugin(**arguments)
    assert says in str(error.value)


def test_sharding_strategy_is_fsdp2s_reshard_switch():
    assert FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD").reshard_after_forward
    plugin = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP")
    assert plugin.reshard_after_forward is False


def test_hf_ds_config_is_the_config_by_hf_accelerates_name(tmp_path):
    settings = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}
    assert DeepSpeedPlugin(hf_ds_config=settings).config == settings

    class Holder:  # what transformers' HfDeepSpeedConfig looks like: the dict in .config
        config = settings

    assert DeepSpeedPlugin(hf_ds_config=Holder()).config == settings
    path = tmp_path / "ds.json"
    assert DeepSpeedPlugin(hf_ds_config=str(path)).config == str(path)
    with pytest.raises(ValueError, match="once"):
        DeepSpeedPlugin(config=settings, hf_ds_config=settings)
