"""``AcceleratorState`` and ``GradientState``: views of an Accelerator, never shared state."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch.utils.data import DataLoader

from nbaccel import Accelerator, DistributedType, GradientAccumulationPlugin
from nbaccel.accelerator import current
from nbaccel.accelerator.current import AcceleratorState, GradientState


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """An empty registry for each test: Accelerators other tests left to the collector are
    not found here (and this test's are not found later)."""
    monkeypatch.setattr(current, "_live", weakref.WeakValueDictionary())


def make(**kwargs) -> Accelerator:
    return Accelerator(cpu=True, live=False, **kwargs)


def test_with_no_accelerator_the_state_refuses_and_gradient_state_has_the_defaults():
    with pytest.raises(ValueError, match="none is live: create one first"):
        AcceleratorState()
    gradients = GradientState()
    assert gradients.sync_gradients and not gradients.in_dataloader
    assert (gradients.end_of_dataloader, gradients.remainder, gradients.num_steps) == (False, -1, 1)
    assert gradients.active_dataloader is None and gradients.plugin_kwargs == {}


def test_the_view_reads_its_accelerators_fields():
    accelerator = make(mixed_precision="bf16")
    for state in (AcceleratorState(), accelerator.state):
        assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
        assert state.device == accelerator.device and state.mixed_precision == "bf16"
        assert state.distributed_type == DistributedType.NO and state.is_main_process
        assert state.deepspeed_plugin is None and state.fsdp_plugin is None
        assert state.initialized and state.dynamo_plugin is None
        assert "Mixed precision type: bf16" in repr(state)
    assert AcceleratorState(mixed_precision="bf16", cpu=True).num_processes == 1
    with pytest.raises(ValueError, match="pass mixed_precision='fp16' to Accelerator"):
        AcceleratorState(mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"pass fsdp_plugin=\.\.\. to Accelerator"):
        AcceleratorState(fsdp_plugin=object())
    with pytest.raises(TypeError, match="GradientState takes"):
        GradientState(plugin=None)
    with pytest.raises(AttributeError, match="cannot be assigned"):
        accelerator.state.num_processes = 4


def test_two_accelerators_each_view_its_own_and_the_newest_is_found():
    older = make(gradient_accumulation_steps=2)
    newer = make(mixed_precision="bf16")
    assert AcceleratorState().mixed_precision == "bf16"
    assert older.state.mixed_precision == "no" and older.gradient_state.num_steps == 2
    assert GradientState().num_steps == 1
    newer.end_training()  # ended: no longer found
    assert AcceleratorState().mixed_precision == "no"
    assert GradientState().plugin_kwargs == {"num_steps": 2}
    del newer
    third = make(mixed_precision="bf16")
    del third
    gc.collect()  # garbage: no longer found
    assert AcceleratorState().mixed_precision == "no"


def test_a_kept_view_keeps_viewing_its_accelerator():
    state = make(mixed_precision="bf16").state
    make()
    assert state.mixed_precision == "bf16"


def test_assigning_distributed_type_changes_what_the_accelerator_reports():
    accelerator = make()
    original = accelerator.state.distributed_type
    accelerator.state.distributed_type = DistributedType.FSDP
    assert accelerator.distributed_type == DistributedType.FSDP
    warned = pytest.warns(UserWarning, match="only supported for multi-GPU")
    with warned, accelerator.join_uneven_inputs([object()]):
        pass
    accelerator.state.distributed_type = original
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with accelerator.join_uneven_inputs([object()]):  # one process: nothing to join
            pass
    with pytest.raises(ValueError, match="is not a valid DistributedType"):
        accelerator.state.distributed_type = "SIDEWAYS"


def test_reset_state_forgets_the_accelerators():
    old = make()
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match="none is live"):
        AcceleratorState()
    with pytest.raises(AttributeError, match=r"AcceleratorState._reset_state\(\)"):
        old.prepare(torch.nn.Linear(1, 1))
    with pytest.raises(AttributeError, match="`AcceleratorState` object has no attribute"):
        _ = old.num_processes  # as Accelerate's: the state it read its facts from is gone
    old.end_training()  # its end still runs
    new = make()
    assert AcceleratorState().device == new.device
    new.prepare(torch.nn.Linear(1, 1))
    GradientState._reset_state()  # holds nothing: nothing to do


def test_gradient_state_follows_accumulation_and_the_loops():
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=True)
    accelerator = make(gradient_accumulation_plugin=plugin)
    gradients = accelerator.gradient_state
    outer = accelerator.prepare(DataLoader(range(6), batch_size=2))
    inner = accelerator.prepare(DataLoader(range(4), batch_size=2))
    seen = []
    for i, _ in enumerate(outer):
        with accelerator.accumulate():
            seen.append((gradients.sync_gradients, gradients.end_of_dataloader))
            assert gradients.in_dataloader and gradients.remainder == -1
            assert gradients.active_dataloader is outer
            if i == 0:
                ends = []
                for _ in inner:
                    ends.append(gradients.end_of_dataloader)
                    assert gradients.active_dataloader is inner
                assert ends == [False, True]
    assert seen == [(False, False), (True, False), (True, True)]
    assert not gradients.in_dataloader and gradients.active_dataloader is None
    assert (gradients.num_steps, gradients.adjust_scheduler, gradients.sync_with_dataloader) == (
        2,
        True,
        True,
    )
    assert gradients.plugin_kwargs == {"num_steps": 2}
    assert "Sync Gradients: True" in repr(gradients)
    with pytest.raises(ValueError, match="cannot set the plugin"):
        GradientState(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))


def test_active_dataloader_is_the_loader_being_iterated():
    accelerator = make()
    loader = accelerator.prepare(DataLoader(range(4), batch_size=2))
    assert [accelerator.gradient_state.active_dataloader is loader for _ in loader] == [True] * 2
