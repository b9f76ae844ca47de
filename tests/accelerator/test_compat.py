"""Code moves between nbaccel and Hugging Face Accelerate without changing its numbers.

Each test is an oracle against Accelerate itself (pinned in the test extra), run on the same
data in the same process, or against plain PyTorch in one process. The 2-rank cases run in one
launch (starting ranks is the expensive part): ``two_ranks`` computes every case on both ranks,
each case recording its own error, and each test below reads one case.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io

import accelerate
import accelerate.utils
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
import nbaccel.utils
from nbaccel import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    PartialState,
)

from ..distributed import run_each, run_ranks, values_of

LR_TOLERANCE = 1e-12  # the same float64 arithmetic, step for step
DDP_TOLERANCE = 1e-5  # see tests/accelerator/test_multiprocess.py


# -- names and signatures, one process --------------------------------------------------------
FUNCTIONS = [
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "pad_across_processes",
    "synchronize_rng_states",
    "set_seed",
    "send_to_device",
]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_utils_functions_take_accelerates_parameters(name):
    """Every parameter Accelerate's function has, by name and default, in the same order."""
    theirs = inspect.signature(getattr(accelerate.utils, name)).parameters
    ours = inspect.signature(getattr(nbaccel.utils, name)).parameters
    common = [p for p in theirs if p in ours]
    assert common == list(theirs)[: len(common)], (name, list(theirs), list(ours))
    assert set(theirs) <= set(ours), (name, set(theirs) - set(ours))
    for p in common:
        assert ours[p].default == theirs[p].default, (name, p)


# Accelerate's parameters that nbaccel does not take yet (the README's table says so)
NOT_YET = {
    "prepare": {"device_placement"},
    "unwrap_model": {"keep_torch_compile"},
    "save": {"f", "safe_serialization"},
    "save_state": {"safe_serialization", "save_model_func_kwargs"},
    "load_state": {"load_kwargs", "load_model_func_kwargs"},
    "get_state_dict": {"unwrap"},
}
METHODS = [
    *("prepare", "backward", "accumulate", "no_sync", "autocast", "clip_grad_norm_"),
    *("clip_grad_value_", "unwrap_model", "save", "save_state", "load_state", "get_state_dict"),
    *("end_training", "gather", "gather_for_metrics", "reduce", "pad_across_processes"),
    *("wait_for_everyone", "main_process_first", "local_main_process_first"),
    *("split_between_processes", "print", "set_trigger", "check_trigger", "on_process"),
    *("on_local_process", "on_main_process", "on_local_main_process", "on_last_process"),
]


@pytest.mark.parametrize("name", METHODS)
def test_accelerator_methods_take_accelerates_parameters(name):
    theirs = inspect.signature(getattr(accelerate.Accelerator, name)).parameters
    ours = inspect.signature(getattr(Accelerator, name)).parameters
    kinds = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    named = [p for p, v in theirs.items() if v.kind not in kinds and p not in NOT_YET.get(name, ())]
    mine = [p for p, v in ours.items() if v.kind not in kinds]
    assert mine[: len(named)] == named, (name, named, mine)
    for p in named[1:]:
        assert ours[p].default == theirs[p].default, (name, p)
    starred = [v.kind for v in theirs.values() if v.kind == inspect.Parameter.VAR_POSITIONAL]
    assert starred == [v.kind for v in ours.values() if v.kind in starred], name


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (DataLoaderConfiguration, accelerate.DataLoaderConfiguration),
        (GradientAccumulationPlugin, accelerate.utils.GradientAccumulationPlugin),
    ],
)
def test_configuration_classes_have_accelerates_fields_and_defaults(ours, theirs):
    mine = {f: v.default for f, v in inspect.signature(ours).parameters.items()}
    accelerates = {f: v.default for f, v in inspect.signature(theirs).parameters.items()}
    assert mine == accelerates


def test_distributed_type_names_are_accelerates():
    assert {m.name for m in DistributedType} == {m.name for m in accelerate.DistributedType}
    for member in DistributedType:
        assert member == getattr(accelerate.DistributedType, member.name)
        assert member == member.value  # compares equal to its string, as Accelerate's does


PROCESS_NAMES = [
    "num_processes",
    "process_index",
    "local_process_index",
    "device",
    "distributed_type",
    "is_main_process",
    "is_local_main_process",
    "is_last_process",
    "use_distributed",
    "wait_for_everyone",
    "split_between_processes",
    "main_process_first",
    "local_main_process_first",
    "on_main_process",
    "on_local_main_process",
    "on_last_process",
    "on_process",
    "on_local_process",
    "print",
]


def test_partial_state_has_accelerates_process_names():
    names = PROCESS_NAMES
    state = PartialState(cpu=True)
    accelerator = Accelerator(cpu=True, live=False)
    for name in names:  # case_state checks that Accelerate's PartialState has them too
        assert hasattr(state, name) and hasattr(accelerator, name), name
    for name in ("set_trigger", "check_trigger", "trigger_sync_in_backward", "join_uneven_inputs"):
        assert hasattr(accelerate.Accelerator, name) and hasattr(accelerator, name), name
    assert (state.num_processes, state.process_index, state.is_last_process) == (1, 0, True)
    assert state.distributed_type == accelerator.distributed_type == DistributedType.NO
    assert accelerator.state.num_processes == 1  # Accelerate's AcceleratorState names


def test_one_process_runs_every_decorated_function():
    state = PartialState(cpu=True)
    ran = []
    state.on_main_process(lambda: ran.append("main"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_process(process_index=3)(lambda: ran.append("3"))()  # as Accelerate: not distributed
    assert ran == ["main", "last", "3"]


def test_refusals_say_what_to_do():
    with pytest.raises(ValueError, match="scale only on TPUs"):
        nbaccel.utils.reduce(torch.ones(2), scale=2.0)
    with pytest.raises(ValueError, match="must be one of"):
        nbaccel.utils.reduce(torch.ones(2), reduction="none")
    with pytest.raises(ValueError, match="XLA"):
        nbaccel.utils.synchronize_rng_states(["xla"])
    with pytest.raises(ValueError, match="positive int"):
        GradientAccumulationPlugin(num_steps=0)
    with pytest.raises(ValueError, match="not both"):
        Accelerator(
            cpu=True,
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        )
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(3))
    assert accelerator.gradient_accumulation_steps == 3


def test_send_to_device_skips_keys_as_accelerate_does():
    batch = {"x": torch.ones(2), "meta": {"ids": torch.arange(2)}, "rows": [torch.zeros(1)]}
    for skip in (None, "meta", ["meta", "rows"]):
        ours = nbaccel.utils.send_to_device(batch, "meta", skip_keys=skip)
        theirs = accelerate.utils.send_to_device(batch, "meta", skip_keys=skip)
        devices = [
            [t.device.type for t in (b["x"], b["meta"]["ids"], b["rows"][0])]
            for b in (ours, theirs)
        ]
        assert devices[0] == devices[1], skip
    assert devices[0] == ["meta", "cpu", "cpu"]


# -- the LR scheduler's schedule -----------------------------------------------------------------
N_BATCHES = 10  # batches of 4 in one epoch of the unsharded loader


def schedule_data(n: int = 4 * N_BATCHES) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def lr_per_epoch(library, kind: str, epochs: int = 2, n: int = 4 * N_BATCHES, **options):
    """The learning rate after each epoch of a loop that steps its scheduler every batch.

    ``library`` is None (plain PyTorch, one process, the unsharded loader), nbaccel's or
    Accelerate's Accelerator class.
    """
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(schedule_data(n), batch_size=4)
    if kind == "onecycle":  # as the docs write it: the length of the unsharded loader
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1.0, epochs=epochs, steps_per_epoch=len(loader)
        )
    else:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    per_epoch = options.pop("per_epoch", False)
    if library is not None:
        accelerator = library(cpu=True, **options)
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
    lrs = []
    for _ in range(epochs):
        for x, y in loader:
            context = accelerator.accumulate(model) if library else contextlib.nullcontext()
            with context:
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss) if library else loss.backward()
                optimizer.step()
                if not per_epoch:
                    scheduler.step()
                optimizer.zero_grad()
        if per_epoch:
            scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def test_one_process_schedule_is_plain_pytorchs():
    for kind in ("onecycle", "step"):
        plain = lr_per_epoch(None, kind)
        assert lr_per_epoch(Accelerator, kind, live=False) == pytest.approx(plain, abs=0)
        assert lr_per_epoch(accelerate.Accelerator, kind) == pytest.approx(plain, abs=0)


def schedules() -> dict:
    """On each rank: the schedules of plain PyTorch, nbaccel and Accelerate."""
    nb_split = {"dataloader_config": DataLoaderConfiguration(split_batches=True)}
    hf_split = {"dataloader_config": accelerate.DataLoaderConfiguration(split_batches=True)}
    out = {}
    for kind in ("onecycle", "step"):
        out[kind] = {
            "plain": lr_per_epoch(None, kind),
            "nbaccel": lr_per_epoch(Accelerator, kind, live=False),
            "accelerate": lr_per_epoch(accelerate.Accelerator, kind),
        }
    uneven = {"n": 4 * N_BATCHES + 4 * 3}  # 13 batches: the last global batch is topped up
    out["uneven onecycle"] = {
        "plain": lr_per_epoch(None, "onecycle", **uneven),
        "nbaccel": lr_per_epoch(Accelerator, "onecycle", live=False, **uneven),
        "accelerate": lr_per_epoch(accelerate.Accelerator, "onecycle", **uneven),
    }
    out["accumulation"] = {
        "nbaccel": lr_per_epoch(Accelerator, "step", live=False, gradient_accumulation_steps=2),
        "accelerate": lr_per_epoch(accelerate.Accelerator, "step", gradient_accumulation_steps=2),
    }
    out["split_batches"] = {
        "nbaccel": lr_per_epoch(Accelerator, "step", live=False, **nb_split),
        "accelerate": lr_per_epoch(accelerate.Accelerator, "step", **hf_split),
    }
    per_epoch = {"step_scheduler_with_optimizer": False, "per_epoch": True}
    out["per epoch"] = {
        "plain": lr_per_epoch(None, "step", epochs=4, per_epoch=True),
        "nbaccel": lr_per_epoch(Accelerator, "step", epochs=4, live=False, **per_epoch),
        "accelerate": lr_per_epoch(accelerate.Accelerator, "step", epochs=4, **per_epoch),
    }
    return out


# -- every 2-rank case, in one launch ----------------------------------------------------------
def case_gather_mismatch():
    accelerator = Accelerator(cpu=True, live=False)
    rank = accelerator.process_index
    out = {}
    for name, call in {
        "gather": lambda: accelerator.gather(torch.arange(2.0 + rank)),
        "utils.gather": lambda: nbaccel.utils.gather({"x": torch.arange(2.0 + rank)}),
        "dtype": lambda: nbaccel.utils.gather(torch.zeros(2, dtype=[torch.float, torch.int][rank])),
        "pad ndim": lambda: accelerator.pad_across_processes(torch.zeros([2] * (1 + rank))),
        "pad dim": lambda: nbaccel.utils.pad_across_processes(torch.zeros(2, 2), dim=2),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    out["after"] = accelerator.gather(torch.tensor([rank])).tolist()  # the group still works
    return out


def case_collectives():
    """nbaccel.utils beside accelerate.utils on the same inputs."""
    rank = PartialState(cpu=True).process_index
    data = {"a": torch.arange(3.0) + 10 * rank, "b": [torch.tensor(rank), torch.ones(2, 2)]}
    out = {}
    for lib in ("nbaccel", "accelerate"):
        u = nbaccel.utils if lib == "nbaccel" else accelerate.utils
        ragged = torch.ones(1 + rank, 2) * (rank + 1)
        out[lib] = {
            "gather": u.gather(data),
            "gather_object": u.gather_object([rank, f"r{rank}"]),
            "broadcast": u.broadcast({"t": torch.full((2,), float(rank))}, from_process=1),
            "broadcast_object_list": u.broadcast_object_list([rank, {"r": rank}], from_process=1),
            "reduce sum": u.reduce(data["a"], "sum"),
            "reduce mean": u.reduce(data["a"]),
            "reduce max": u.reduce(torch.tensor([rank, -rank]), "max"),
            "pad": u.pad_across_processes(ragged, dim=0, pad_index=-1),
            "pad first": u.pad_across_processes(ragged.T, dim=1, pad_index=7, pad_first=True),
        }
    out["reduce min"] = nbaccel.utils.reduce(torch.tensor([rank, -rank]), "min")
    try:
        nbaccel.utils.gather_object(rank)
    except TypeError as err:
        out["gather_object of a non-list"] = str(err)
    return out


def case_rng():
    rank = PartialState(cpu=True).process_index
    torch.manual_seed(100 + rank)
    g = torch.Generator().manual_seed(200 + rank)
    before = [torch.rand(2), torch.rand(2, generator=g)]
    nbaccel.utils.synchronize_rng_states(["torch", "generator"], generator=g)
    return {"before": before, "after": [torch.rand(2), torch.rand(2, generator=g)]}


def case_state():
    """PartialState beside Accelerate's, and the decorators, triggers and prints."""
    ours, theirs = PartialState(cpu=True), accelerate.PartialState(cpu=True)
    facts = [
        "num_processes",
        "process_index",
        "local_process_index",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "use_distributed",
    ]
    out = {"facts": [[getattr(s, f) for f in facts] for s in (ours, theirs)]}
    out["missing in accelerate"] = [n for n in PROCESS_NAMES if not hasattr(theirs, n)]
    out["type"] = [ours.distributed_type.value, theirs.distributed_type.value]

    def inputs():  # fresh each time: Accelerate splits a dict in place
        return [list("abcde"), torch.arange(5), {"x": list("abc"), "y": torch.arange(3)}]

    out["split"] = [[], []]
    for split, s in zip(out["split"], (ours, theirs), strict=True):
        for pad in (False, True):
            for i in inputs():
                with s.split_between_processes(i, apply_padding=pad) as share:
                    split.append(share)
    for s, lib in ((ours, "nbaccel"), (theirs, "accelerate")):
        ran = out[f"ran {lib}"] = []
        s.on_main_process(functools.partial(ran.append, "main"))()
        s.on_local_main_process(functools.partial(ran.append, "local main"))()
        s.on_last_process(functools.partial(ran.append, "last"))()
        s.on_process(process_index=1)(functools.partial(ran.append, "process 1"))()
        s.on_local_process(local_process_index=0)(functools.partial(ran.append, "local 0"))()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ours.print("hello")
    out["printed"] = printed.getvalue()
    accelerator = Accelerator(cpu=True, live=False)
    out["accelerator type"] = accelerator.distributed_type.value
    if accelerator.process_index == 1:
        accelerator.set_trigger()
    out["triggers"] = [accelerator.check_trigger(), accelerator.check_trigger()]
    return out


def case_trigger_sync_in_backward():
    """Inside no_sync, the backward under trigger_sync_in_backward still all-reduces."""
    accelerator = Accelerator(cpu=True, live=False)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(4, 1))
    x = torch.randn(8, 4)  # the same on both ranks; each takes its half
    mine = x[4 * accelerator.process_index :][:4]
    grads = {}
    for name, trigger in (("no_sync", False), ("triggered", True)):
        model.zero_grad()
        sync = accelerator.trigger_sync_in_backward(model) if trigger else contextlib.nullcontext()
        with accelerator.no_sync(model), sync:  # entered in this order
            model(mine).pow(2).mean().backward()
        grads[name] = model.module.weight.grad.clone()
    plain = nn.Linear(4, 1)
    plain.load_state_dict(accelerator.unwrap_model(model).state_dict())
    plain(x).pow(2).mean().backward()
    grads["plain"] = plain.weight.grad
    return grads


def case_sync_each_batch():
    """Accumulation that all-reduces every micro-batch: same weights, synced mid-window."""
    out = {}
    for each in (False, True):
        plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=each)
        accelerator = Accelerator(cpu=True, live=False, gradient_accumulation_plugin=plugin)
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(schedule_data(), batch_size=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        mid_window = []
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                if not accelerator.sync_gradients:
                    mid_window.append(model.module.weight.grad.clone())
                optimizer.step()
                optimizer.zero_grad()
        out[each] = {"weights": model.module.weight.detach().clone(), "mid": mid_window}
    return out


def case_loader_config():
    """A prepared loader's batches under a DataLoaderConfiguration, beside Accelerate's."""
    out = {}
    data = TensorDataset(torch.arange(22))
    for lib in ("nbaccel", "accelerate"):
        config_class = (
            DataLoaderConfiguration if lib == "nbaccel" else accelerate.DataLoaderConfiguration
        )
        batches = {}
        for name, options in {
            "split": {"split_batches": True, "use_seedable_sampler": True, "data_seed": 2},
            "uneven seeded": {"even_batches": False, "use_seedable_sampler": True, "data_seed": 5},
        }.items():
            library = Accelerator if lib == "nbaccel" else accelerate.Accelerator
            accelerator = library(cpu=True, dataloader_config=config_class(**options))
            loader = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True))
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                epochs.append([b[0].tolist() for b in loader])
            batches[name] = epochs
        out[lib] = batches
    # No data_seed, ranks seeded apart: nbaccel still shuffles alike (rank 0's seed)
    rank = PartialState(cpu=True).process_index
    torch.manual_seed(rank)
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    loader = Accelerator(cpu=True, live=False, dataloader_config=config).prepare(
        DataLoader(data, batch_size=4, shuffle=True)
    )
    out["unseeded"] = [i for b in loader for i in b[0].tolist()]
    return out


def case_join_uneven_inputs():
    """Uneven batches under join_uneven_inputs: no hang, and the weights of the rule."""
    data = TensorDataset(torch.randn(10, 4, generator=torch.Generator().manual_seed(1)))
    out = {}
    for name, config, override in (
        ("config", DataLoaderConfiguration(even_batches=False), None),
        ("override", DataLoaderConfiguration(), False),
    ):
        accelerator = Accelerator(cpu=True, live=False, dataloader_config=config)
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = accelerator.prepare(
            model, optimizer, DataLoader(data, batch_size=4)
        )
        with accelerator.join_uneven_inputs([model], even_batches=override):
            batches = len(loader)
            for (x,) in loader:
                accelerator.backward(model(x).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
        out[name] = {
            "batches": batches,
            "after": len(loader),
            "weight": accelerator.unwrap_model(model).weight.detach().clone(),
        }
    # plain PyTorch: step 1 averages both ranks' halves (samples 0-7); on step 2 rank 1 has
    # joined and answers the all-reduce with zeros, so samples 8-9 count half
    torch.manual_seed(0)
    plain = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = data.tensors[0]
    for batch, weight in ((x[:8], 1.0), (x[8:], 0.5)):
        (plain(batch).pow(2).mean() * weight).backward()
        optimizer.step()
        optimizer.zero_grad()
    out["plain"] = plain.weight.detach().clone()
    return out


CASES = {
    "schedules": schedules,
    "gather mismatch": case_gather_mismatch,
    "collectives": case_collectives,
    "rng": case_rng,
    "state": case_state,
    "trigger_sync_in_backward": case_trigger_sync_in_backward,
    "sync_each_batch": case_sync_each_batch,
    "loader config": case_loader_config,
    "join_uneven_inputs": case_join_uneven_inputs,
}


def every_case() -> dict:
    return run_each(CASES)


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(every_case, timeout=300)


def case(two_ranks, name):
    return values_of(two_ranks, name)


multiprocess = pytest.mark.multiprocess


@multiprocess
def test_schedule_lasts_the_same_epochs_on_two_processes(two_ranks):
    for result in case(two_ranks, "schedules"):
        for name in ("onecycle", "step", "per epoch"):  # even data: plain PyTorch's, epoch by epoch
            lrs = result[name]
            assert lrs["nbaccel"] == pytest.approx(lrs["plain"], abs=LR_TOLERANCE), name
            assert lrs["nbaccel"] == pytest.approx(lrs["accelerate"], abs=LR_TOLERANCE), name
        # OneCycleLR ends at its end, where a topped-up last batch would step it past
        uneven = result["uneven onecycle"]
        assert uneven["nbaccel"] == pytest.approx(uneven["accelerate"], abs=LR_TOLERANCE)
        assert uneven["nbaccel"][-1] == pytest.approx(uneven["plain"][-1], abs=LR_TOLERANCE)
        for name in ("accumulation", "split_batches"):
            assert result[name]["nbaccel"] == result[name]["accelerate"], name


@multiprocess
def test_a_mismatched_gather_raises_on_every_rank_naming_each_shape(two_ranks):
    for result in case(two_ranks, "gather mismatch"):
        assert "rank 0: [2] float32, rank 1: [3] float32" in result["gather"]
        assert "rank 0: [2] float32, rank 1: [3] float32" in result["utils.gather"]
        assert "rank 0: [2] float32, rank 1: [2] int32" in result["dtype"]
        assert "rank 0: [2] float32, rank 1: [2, 2] float32" in result["pad ndim"]
        assert "dim=2" in result["pad dim"]
        assert result["after"] == [0, 1]


@multiprocess
def test_collectives_equal_accelerates(two_ranks):
    for rank, result in enumerate(case(two_ranks, "collectives")):
        ours, theirs = result["nbaccel"], result["accelerate"]
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert _equal(ours[name], theirs[name]), (rank, name, ours[name], theirs[name])
        assert result["reduce min"].tolist() == [0, -1]
        assert "gather_object([value])" in result["gather_object of a non-list"]


@multiprocess
def test_synchronize_rng_states_gives_every_rank_rank_0s_draws(two_ranks):
    rank0, rank1 = case(two_ranks, "rng")
    assert not torch.equal(rank0["before"][0], rank1["before"][0])  # the check can fail
    assert all(torch.equal(a, b) for a, b in zip(rank0["after"], rank1["after"], strict=True))


@multiprocess
def test_partial_state_and_decorators_equal_accelerates(two_ranks):
    for rank, result in enumerate(case(two_ranks, "state")):
        ours, theirs = result["facts"]
        assert ours == theirs and ours[1] == rank
        assert result["missing in accelerate"] == []  # the names tested are Accelerate's
        assert result["type"] == ["MULTI_CPU", "MULTI_CPU"]
        assert result["accelerator type"] == "MULTI_CPU"
        assert _equal(*result["split"])
        assert result["ran nbaccel"] == result["ran accelerate"]
        assert (
            result["ran nbaccel"]
            == (["main", "local main", "local 0"], ["last", "process 1"])[rank]
        )
        assert result["printed"] == ("hello\n" if rank == 0 else "")
        assert result["triggers"] == [True, False]  # rank 1 raised it: both ranks stop


@multiprocess
def test_trigger_sync_in_backward_all_reduces_inside_no_sync(two_ranks):
    rank0, rank1 = case(two_ranks, "trigger_sync_in_backward")
    assert not torch.allclose(rank0["no_sync"], rank1["no_sync"])  # each rank's own half
    for grads in (rank0, rank1):
        torch.testing.assert_close(grads["triggered"], grads["plain"], atol=1e-6, rtol=0)


@multiprocess
def test_sync_each_batch_syncs_every_micro_batch_to_the_same_weights(two_ranks):
    rank0, rank1 = case(two_ranks, "sync_each_batch")
    for rank in (rank0, rank1):
        torch.testing.assert_close(rank[True]["weights"], rank[False]["weights"], atol=1e-6, rtol=0)
    held, synced = (
        [torch.equal(a, b) for a, b in zip(rank0[each]["mid"], rank1[each]["mid"], strict=True)]
        for each in (False, True)
    )
    assert held and not any(held)  # unsynced mid-window: each rank holds its own gradient
    assert synced and all(synced)


@multiprocess
def test_prepared_loader_batches_equal_accelerates(two_ranks):
    for result in case(two_ranks, "loader config"):
        assert result["nbaccel"] == result["accelerate"]
    rank0, rank1 = (result["unseeded"] for result in case(two_ranks, "loader config"))
    assert len(rank0 + rank1) == 24 and set(rank0 + rank1) == set(range(22))  # 2 top-ups


@multiprocess
def test_join_uneven_inputs_lets_every_rank_finish_uneven_batches(two_ranks):
    rank0, rank1 = case(two_ranks, "join_uneven_inputs")
    for name in ("config", "override"):
        assert (rank0[name]["batches"], rank1[name]["batches"]) == (2, 1)  # uneven, no hang
        for rank in (rank0, rank1):  # the same final weights on both ranks
            torch.testing.assert_close(rank[name]["weight"], rank["plain"], atol=1e-6, rtol=0)
    assert rank1["override"]["after"] == 2  # the loader's own setting is back after the block


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _accelerates_view(steps: int = 3):
    """A worker that builds Hugging Face Accelerate's own Accelerator, as ported code does."""
    from accelerate import Accelerator as Theirs

    accelerator = Theirs()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(accelerator.process_index)  # a different batch on each rank
    for _ in range(steps):
        accelerator.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    return {
        "rank": accelerator.process_index,
        "processes": accelerator.num_processes,
        "type": str(accelerator.distributed_type),
        "precision": accelerator.mixed_precision,
        "weights": weights,
    }


@pytest.mark.multiprocess
def test_notebook_launcher_runs_accelerates_own_accelerator_on_cpu_workers():
    """Launched on CPU workers, Accelerate's Accelerator joins them as one job (MULTI_CPU) and
    takes the launch's precision: without Accelerate's own variables each worker thought it was
    alone (DistributedType.NO) and trained its own copy."""
    seen = nbaccel.notebook_launcher(
        _accelerates_view, num_processes=2, cpu=True, mixed_precision="bf16", return_all=True
    )
    assert [s["rank"] for s in seen] == [0, 1]
    assert {(s["processes"], s["type"], s["precision"]) for s in seen} == {
        (2, "DistributedType.MULTI_CPU", "bf16")
    }
    torch.testing.assert_close(seen[0]["weights"], seen[1]["weights"], rtol=0, atol=0)  # DDP
