"""The Accelerator's surface by Accelerate's names: its constructor's keywords, ``prepare`` and
its one-object forms, ``free_memory``, the assignable settings, ``unwrap_model`` and the
states' ``_reset_state``. Where Accelerate can answer the same question on the same data, its
answer is the oracle."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.data import DataLoader

from nbaccel import Accelerator, GradientState, PartialState
from nbaccel.accelerator import current
from nbaccel.accelerator.current import AcceleratorState
from nbaccel.accelerator.data.sharding import DataLoaderConfiguration
from nbaccel.accelerator.optim import AcceleratedOptimizer, AcceleratedScheduler


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """An empty registry of live Accelerators for each test (see test_current_state.py)."""
    monkeypatch.setattr(current, "_live", weakref.WeakValueDictionary())


def make(**kwargs) -> Accelerator:
    return Accelerator(cpu=True, live=False, **kwargs)


def components():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1 - n / 10)
    return model, optimizer, scheduler


# -- prepare ----------------------------------------------------------------------------------
def test_prepare_passes_through_what_it_does_not_prepare_and_marks_what_it_does():
    accelerator = make()
    model, optimizer, scheduler = components()
    loader, extra = DataLoader(range(4), batch_size=2), [1, 2, 3]
    prepared = accelerator.prepare(model, optimizer, None, scheduler, loader, extra, 7)
    model, optimizer, none, scheduler, loader, same, seven = prepared
    assert none is None and same is extra and seven == 7
    assert not hasattr(extra, "_is_accelerate_prepared")
    for obj in (model, optimizer, scheduler, loader):
        assert obj._is_accelerate_prepared is True
    assert accelerator.prepare(None) is None


def test_preparing_again_returns_the_same_objects_and_keeps_each_once():
    accelerator = make()
    model, optimizer, scheduler = components()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    again = accelerator.prepare(model, optimizer, scheduler)
    assert all(a is b for a, b in zip(again, (model, optimizer, scheduler), strict=True))
    assert accelerator.prepare_model(model) is model
    held = accelerator._models, accelerator._optimizers, accelerator._schedulers
    assert [len(h) for h in held] == [1, 1, 1]


def test_the_one_object_forms_prepare_as_prepare_does():
    accelerator = make(gradient_accumulation_steps=2)
    model, optimizer, scheduler = components()
    model = accelerator.prepare_model(model, device_placement=True)
    optimizer = accelerator.prepare_optimizer(optimizer)
    scheduler = accelerator.prepare_scheduler(scheduler)
    assert isinstance(optimizer, AcceleratedOptimizer)
    assert isinstance(scheduler, AcceleratedScheduler)
    assert accelerator._models == [model] and accelerator._optimizers == [optimizer]
    with accelerator.accumulate(model):  # the first micro-batch of two: no step, no schedule
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [0.1]
    frozen = accelerator.prepare_model(torch.nn.Linear(2, 1), evaluation_mode=True)
    assert frozen._is_accelerate_prepared and frozen in accelerator._models


def test_device_placement_is_checked():
    accelerator = make(device_placement=False)  # on the CPU it changes nothing: taken
    assert accelerator.device_placement is False
    model, optimizer, _ = components()
    with pytest.raises(ValueError, match="should be a list with 2 elements"):
        accelerator.prepare(model, optimizer, device_placement=[True])
    model, optimizer = accelerator.prepare(model, optimizer, device_placement=[False, None])
    assert model._is_accelerate_prepared
    with pytest.raises(TypeError, match="must be True or False"):
        accelerator.prepare_model(torch.nn.Linear(1, 1), device_placement="yes")


def test_device_placement_false_off_the_cpu_is_refused():
    from nbaccel.accelerator import keywords

    with pytest.raises(NotImplementedError, match="places models"):
        keywords.check_placement(False, torch.device("cuda", 0), "prepare_model()")


def test_a_quantized_model_offloaded_to_the_cpu_is_refused_with_a_value_error():
    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit, model.hf_device_map = True, {"": "cpu"}
    with pytest.raises(ValueError, match="CPU or disk offload"):
        make().prepare_model(model)


# -- free_memory ------------------------------------------------------------------------------
def test_free_memory_forgets_the_prepared_objects_and_returns_nones():
    accelerator = make()
    model, optimizer, scheduler = components()
    loader = DataLoader(range(4), batch_size=2)
    prepared = accelerator.prepare(model, optimizer, scheduler, loader)
    accelerator.step = 3
    watched = weakref.ref(prepared[0])
    assert accelerator.free_memory(*prepared) == [None] * 4
    held = (accelerator._models, accelerator._optimizers)
    assert held == ([], []) and accelerator._schedulers == accelerator._dataloaders == []
    assert accelerator.step == 0
    del prepared, model, optimizer, scheduler
    gc.collect()  # a prepared forward refers to its model: a cycle
    assert watched() is None  # the Accelerator held it no more
    assert accelerator.clear() == []


# -- settings Accelerate lets a loop assign ----------------------------------------------------
def test_assigned_accumulation_steps_train_as_the_constructors():
    def train(accelerator: Accelerator) -> torch.Tensor:
        model, optimizer, _ = components()
        model, optimizer = accelerator.prepare(model, optimizer)
        for x in torch.arange(8.0).reshape(4, 1, 2):
            with accelerator.accumulate(model):
                accelerator.backward(model(x).pow(2).sum())
                optimizer.step()
                optimizer.zero_grad()
        return model.weight.detach().clone()

    assigned = make()
    assigned.gradient_accumulation_steps = 2
    state = GradientState()
    assert state.num_steps == 2 and state.plugin_kwargs == {"num_steps": 2}
    assert torch.equal(train(assigned), train(make(gradient_accumulation_steps=2)))
    assert not torch.equal(train(make()), train(make(gradient_accumulation_steps=2)))
    with pytest.raises(ValueError, match="positive int"):
        assigned.gradient_accumulation_steps = 0


def test_sync_gradients_can_be_assigned():
    accelerator = make()
    accelerator.sync_gradients = False
    assert (
        GradientState().sync_gradients is False
        and accelerator.gradient_state.sync_gradients is False
    )


# -- unwrap_model ------------------------------------------------------------------------------
def test_unwrap_model_keeps_or_removes_torch_compile_as_accelerate():
    accelerator = make()
    model = torch.nn.Linear(2, 1)
    outer = torch.compile(torch.nn.DataParallel(model))
    assert accelerator.unwrap_model(outer, keep_torch_compile=False) is model
    kept = accelerator.unwrap_model(outer)  # keep_torch_compile=True, Accelerate's default
    assert kept is outer and kept._orig_mod is model
    assert accelerator.unwrap_model(model) is model


# -- the constructor's keywords ----------------------------------------------------------------
def test_split_batches_is_honoured_and_warned_about():
    with pytest.warns(FutureWarning, match="DataLoaderConfiguration"):
        accelerator = make(split_batches=True)
    assert accelerator.split_batches and accelerator.dataloader_config.split_batches
    loader = accelerator.prepare(DataLoader(range(8), batch_size=4))
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one process: whole
    config = DataLoaderConfiguration(split_batches=False)
    with pytest.raises(ValueError, match="disagree"):
        make(split_batches=True, dataloader_config=config)


@pytest.mark.parametrize("name", ["dispatch_batches", "even_batches", "use_seedable_sampler"])
def test_keywords_accelerate_removed_name_their_new_home(name):
    with pytest.raises(TypeError, match=rf"dataloader_config=DataLoaderConfiguration\({name}="):
        make(**{name: True})
    with pytest.raises(TypeError, match="unexpected keyword argument 'typo'"):
        make(typo=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"megatron_lm_plugin": object()}, NotImplementedError, "DDP, FSDP2 or DeepSpeed"),
        ({"torch_tp_plugin": object()}, NotImplementedError, "tensor"),
        ({"parallelism_config": object()}, NotImplementedError, "tensor"),
        ({"dynamo_backend": "inductor"}, NotImplementedError, "torch.compile"),
        ({"rng_types": ["torch", "generator"]}, NotImplementedError, "set_seed"),
        ({"dynamo_backend": "no", "dynamo_plugin": object()}, ValueError, "both"),
        ({"deepspeed_plugins": {"a": 1, "b": 2}}, NotImplementedError, "one DeepSpeed engine"),
        ({"deepspeed_plugins": {"a": 1}, "deepspeed_plugin": 2}, ValueError, "both"),
    ],
)
def test_what_nbaccel_does_not_drive_is_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        make(**kwargs)


def test_the_default_values_of_those_keywords_are_taken():
    accelerator = make(dynamo_backend="NO", rng_types=["generator"], device_placement=True)
    assert accelerator.rng_types == ["generator"]


# -- the scheduler, as Accelerate's ------------------------------------------------------------
def test_a_scheduler_steps_before_the_first_optimizer_step_and_holds_on_an_overflow():
    model, optimizer, scheduler = components()
    _, optimizer, scheduler = make().prepare(model, optimizer, scheduler)
    scheduler.step()  # Accelerate's rule: it steps unless the last optimizer step was skipped
    assert scheduler.get_last_lr() == [0.1 * 0.9]
    optimizer._is_overflow = True  # Accelerate's tests' way of saying the step was skipped
    assert optimizer.step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr() == [0.1 * 0.9]


# -- resetting the states ----------------------------------------------------------------------
def test_a_reset_partial_state_answers_no_facts():
    state = PartialState(cpu=True)
    with pytest.raises(AttributeError, match="'PartialState' object has no attribute 'other'"):
        _ = state.other
    state._reset_state()
    with pytest.raises(AttributeError, match=r"`PartialState` object has no attribute `num_proc"):
        _ = state.num_processes
    with pytest.raises(AttributeError, match=r"PartialState._reset_state\(\)"):
        _ = state.device
    state.other = "mine"
    assert state.other == "mine" and "reset" in repr(state)


def test_a_state_reset_forgets_the_accelerators_and_their_facts():
    accelerator = make()
    assert PartialState._shared_state["num_processes"] == 1
    with pytest.raises(AttributeError, match="'AcceleratorState' object has no attribute 'x'"):
        _ = accelerator.state.x
    accelerator.state.x = "kept with the Accelerator"
    assert accelerator.state.x == AcceleratorState().x == "kept with the Accelerator"
    AcceleratorState._reset_state(True)
    assert PartialState._shared_state == {} == AcceleratorState._shared_state
    with pytest.raises(AttributeError, match="`AcceleratorState` object has no attribute"):
        _ = accelerator.num_processes
    with pytest.raises(AttributeError, match=r"AcceleratorState._reset_state\(\)"):
        accelerator.prepare_model(torch.nn.Linear(1, 1))
    assert accelerator.state.x == "kept with the Accelerator"
    assert "reset" in repr(accelerator)
    accelerator.end_training()
    fresh = make()
    assert PartialState._shared_state["device"] == fresh.device


def test_partial_states_class_reset_forgets_the_accelerators_but_not_their_facts():
    accelerator = make()
    PartialState._reset_state()
    assert PartialState._shared_state == {}
    with pytest.raises(ValueError, match="none is live"):
        AcceleratorState()
    assert accelerator.num_processes == 1  # as Accelerate: AcceleratorState kept its own copy


def test_accelerates_device_variable_is_honoured(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:3")
    assert str(make().state.device) == "cpu:3"


def test_a_process_group_made_without_the_launchers_variables_gives_the_ranks(monkeypatch):
    """Accelerate's ``debug_launcher`` makes a group of two from a file store and sets no RANK:
    the group's ranks are then this process's place (faked here: no second process)."""
    from nbaccel.accelerator import state

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert state.process_env().world_size == 1  # no group: one process
    monkeypatch.setattr(state.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(state.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(state.dist, "get_rank", lambda: 1)
    env = state.process_env()
    assert (env.rank, env.local_rank, env.world_size, env.is_distributed) == (1, 1, 2, True)


def test_gradient_states_shared_state_is_never_empty():
    assert GradientState._shared_state == {
        "sync_gradients": True,
        "end_of_dataloader": False,
        "remainder": -1,
        "num_steps": 1,
    }  # Accelerate's defaults: no Accelerator is live
    accelerator = make(gradient_accumulation_steps=3)
    assert GradientState._shared_state["num_steps"] == accelerator.gradient_accumulation_steps
