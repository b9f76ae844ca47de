"""The strategy table, a fourth back end added by its module and one row, and the window."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nbaccel.accelerator.strategies as strategies
from nbaccel import Accelerator, DeepSpeedPlugin, FSDPPlugin
from nbaccel.accelerator.accumulation import (
    AccumulationWindow,
    GradientAccumulationPlugin,
    MicroBatch,
)
from nbaccel.accelerator.data.loader import LoopState, _Pass
from nbaccel.accelerator.strategies import DDP, FSDP, DeepSpeed, Strategy, choose
from nbaccel.config import LaunchConfig
from nbaccel.observe.rank_recorder import Recorder

NONE = {"fsdp_plugin": None, "deepspeed_plugin": None}


def test_the_table_picks_one_strategy_per_plugin():
    launch = LaunchConfig()
    assert choose(NONE, launch, distributed=False)[1:] == (None, Strategy)
    assert choose(NONE, launch, distributed=True)[1:] == (None, DDP)
    fsdp = FSDPPlugin()
    assert choose({**NONE, "fsdp_plugin": fsdp}, launch, distributed=True)[1:] == (fsdp, FSDP)
    plugins, plugin, kind = choose(NONE, LaunchConfig(zero_stage=1), distributed=False)
    assert kind is DeepSpeed and plugin == DeepSpeedPlugin(zero_stage=1)
    assert plugins == {"fsdp_plugin": None, "deepspeed_plugin": plugin}  # the launch's, kept


def test_the_table_refuses_two_plugins_and_a_wrong_type():
    with pytest.raises(ValueError, match="choose one way to shard"):
        choose({**NONE, "fsdp_plugin": FSDPPlugin()}, LaunchConfig(zero_stage=2), False)
    with pytest.raises(TypeError, match=r"deepspeed_plugin=\{\} must be an nbaccel\.Deep"):
        choose({**NONE, "deepspeed_plugin": {}}, LaunchConfig(), False)


@dataclasses.dataclass(frozen=True)
class HalfStepPlugin:
    """A made-up back end: it trains as one process does, but halves each loss first."""


class HalfStep(Strategy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backwards = 0

    def backward(self, loss, sync, **kwargs):
        self.backwards += 1
        super().backward(loss / 2, sync, **kwargs)


def test_a_fourth_back_end_needs_its_module_and_one_row_only(monkeypatch):
    """Registered in the table alone (asked for by every launch, here), it trains an
    unchanged Accelerator loop: the weights equal plain PyTorch's on the halved loss."""
    row = ("half_step_plugin", HalfStep, lambda launch: HalfStepPlugin())
    monkeypatch.setitem(strategies.BACK_ENDS, HalfStepPlugin, row)
    torch.manual_seed(0)
    model, data = torch.nn.Linear(3, 1), torch.randn(4, 8, 3)
    plain = torch.nn.Linear(3, 1)
    plain.load_state_dict(model.state_dict())
    accelerator = Accelerator(cpu=True, live=False)
    assert isinstance(accelerator.strategy, HalfStep)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    for batch in data:
        accelerator.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        (plain(batch).square().mean() / 2).backward()
        reference.step()
        reference.zero_grad()
    assert accelerator.strategy.backwards == len(data)
    for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-7)
    accelerator.end_training()


def test_the_window_syncs_every_nth_micro_batch_and_at_the_data_end():
    ticks = []
    recorder = Recorder(live=False, clock=lambda: 1.0, rss=lambda: None)
    recorder.tick = lambda: ticks.append(recorder.optimizer_steps)  # due at every count
    plugin = GradientAccumulationPlugin(num_steps=3)
    window, loop = AccumulationWindow(3, plugin, recorder), LoopState([_Pass(None)])
    block = MicroBatch(window, loop, Strategy.no_sync, ())
    synced = []
    for end in [False, False, False, False, True, False]:  # the 5th ends an epoch
        loop.active[-1].end = end
        with block:
            synced.append(window.sync_gradients)
    assert synced == [False, False, True, False, True, False]
    window.holds_gradients = True  # backward's mark (test_accumulation_matches_the_big_batch)
    assert window.skips_sync  # mid-window: kept, not reduced
    optimizer = object()
    window.track(optimizer)  # as Accelerate: its scheduler may step before its first step
    assert window.has_stepped(optimizer) is True and window.has_stepped(object()) is True
    window.track(optimizer, stepped=False)  # Accelerate's optimizer._is_overflow = True
    assert window.has_stepped(optimizer) is False
    window.stepped(optimizer, changed=True)
    assert not window.holds_gradients and window.has_stepped(optimizer)
    assert recorder.samples == 0 and ticks == [1]  # the live view counts real steps, and ticks
    window.stepped(optimizer, changed=False)  # fp16 skipped it: no step to count
    assert recorder.optimizer_steps == 1 and ticks == [1, 1]
    recorder.close()
    each = AccumulationWindow(2, GradientAccumulationPlugin(num_steps=2, sync_each_batch=True))
    with MicroBatch(each, LoopState(), Strategy.no_sync, ()):
        pass
    assert not each.sync_gradients and not each.skips_sync  # reduced now, stepped later
