"""``kwargs_handlers``: each handler reaches torch's object, and the numbers equal Accelerate's.

One launch of 2 CPU ranks (gloo) computes every case (``every_case``); each test reads one.
The oracle is Accelerate's own Accelerator with the same handler, data and seed, except for
``GradScalerKwargs``: Accelerate refuses fp16 on a CPU, so there the oracle is torch's
``GradScaler`` with the same arguments.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import accelerate
import accelerate.state
import accelerate.utils
import pytest
import torch
import torch.distributed as dist
from torch import nn

from nbaccel import Accelerator
from nbaccel.accelerator.handlers import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    Handlers,
    InitProcessGroupKwargs,
)

from ..distributed import run_each, run_ranks, values_of

HOOK_TOLERANCE = 1e-6  # the same hook on the same numbers: equal but for summation order
STEPS = 4

HOOKS = [  # (comm_hook, comm_wrapper, comm_state_option)
    ("no", "no", {}),
    ("fp16", "no", {}),
    ("power_sgd", "no", {"start_powerSGD_iter": 2}),
    ("power_sgd", "fp16", {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}),
    ("batched_power_sgd", "no", {"start_powerSGD_iter": 2}),
    ("batched_power_sgd", "fp16", {"start_powerSGD_iter": 2}),
]
BROKEN = "batched_power_sgd"  # torch 2.13's hook asserts on its own matrix, in both libraries
# torch refuses bf16 hooks without CUDA and NCCL >= 2.10 (gloo could sum bfloat16; torch's
# check is by the hook's name): on CPU both libraries raise torch's TypeError
BF16_HOOKS = [("bf16", "no", {}), ("power_sgd", "bf16", {})]


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own samples
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _train(accelerator, count_buckets: bool = False) -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    buckets = []
    meter = getattr(accelerator, "_meter", None)
    breakdown = None if meter is None else meter.times
    if count_buckets and breakdown is not None:
        ready = breakdown.bucket_ready
        breakdown.bucket_ready = lambda: (buckets.append(1), ready())[1]
    for x, y in _data(accelerator.process_index):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {"weights": weights, "buckets": len(buckets)}


def case_init() -> dict:
    """First, while no group exists: the timeout reaches the group; another one is refused."""
    asked = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=123))
    accelerator = Accelerator(cpu=True, live=False, kwargs_handlers=[asked])
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    out = {"timeout": backend.options._timeout, "backend": dist.get_backend()}
    Accelerator(cpu=True, live=False, kwargs_handlers=[asked])  # the same settings: shared
    try:
        other = InitProcessGroupKwargs(timeout=timedelta(seconds=7))
        Accelerator(cpu=True, live=False, kwargs_handlers=[other])
    except ValueError as err:
        out["refused"] = str(err)
    try:
        Accelerator(cpu=True, live=False, kwargs_handlers=[InitProcessGroupKwargs("mpi")])
    except ValueError as err:
        out["backend refused"] = str(err)
    del accelerator
    return out


def case_ddp_arguments() -> dict:
    """Every DistributedDataParallel argument reaches DDP, in nbaccel as in Accelerate."""
    out = {}
    for name, fields in {
        "most": dict(
            broadcast_buffers=False,
            bucket_cap_mb=1,
            find_unused_parameters=True,
            check_reduction=True,
            gradient_as_bucket_view=True,
        ),
        "static": dict(static_graph=True, dim=1),
    }.items():
        seen = {}
        for lib, accelerator_class, handler_class in (
            ("nbaccel", Accelerator, DistributedDataParallelKwargs),
            ("accelerate", accelerate.Accelerator, accelerate.utils.DistributedDataParallelKwargs),
        ):
            extra = {"live": False} if lib == "nbaccel" else {}
            accelerator = accelerator_class(
                cpu=True, kwargs_handlers=[handler_class(**fields)], **extra
            )
            model = accelerator.prepare(_model())
            seen[lib] = {
                "dim": model.dim,
                "broadcast_buffers": model.broadcast_buffers,
                "bucket_bytes_cap": model.bucket_bytes_cap,
                "find_unused_parameters": model.find_unused_parameters,
                "gradient_as_bucket_view": model.gradient_as_bucket_view,
                "static_graph": model.static_graph,
            }
            accelerate.state.AcceleratorState._reset_state()
        out[name] = seen
    return out


def case_hooks() -> dict:
    """Weights after STEPS steps with each communication hook, nbaccel beside Accelerate."""
    out = {}
    for hook, wrapper, option in HOOKS + BF16_HOOKS:
        runs = {}
        for lib in ("nbaccel", "accelerate"):
            if lib == "nbaccel":
                handler = DistributedDataParallelKwargs(
                    comm_hook=hook, comm_wrapper=wrapper, comm_state_option=dict(option)
                )
                runs[lib] = _refused_or(
                    lambda h=handler: _train(
                        Accelerator(cpu=True, live=False, kwargs_handlers=[h]), count_buckets=True
                    )
                )
            else:
                kinds = accelerate.utils.DDPCommunicationHookType
                handler = accelerate.utils.DistributedDataParallelKwargs(
                    comm_hook=kinds(hook), comm_wrapper=kinds(wrapper), comm_state_option=option
                )
                accelerator = accelerate.Accelerator(cpu=True, kwargs_handlers=[handler])
                runs[lib] = _refused_or(lambda a=accelerator: _train(a))
                accelerate.state.AcceleratorState._reset_state()
        out[(hook, wrapper, str(option))] = runs
    return out


def _refused_or(train) -> dict:
    try:
        return train()
    except (TypeError, ValueError, AssertionError) as err:
        return {"refused": f"{type(err).__name__}: {err}"}


def case_scaler() -> dict:
    """fp16's GradScaler takes GradScalerKwargs (Accelerate has no fp16 on CPU: torch's own
    GradScaler with the same arguments is the oracle)."""
    fields = dict(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=1)
    handlers = [GradScalerKwargs(**fields)]
    accelerator = Accelerator(
        cpu=True, live=False, mixed_precision="fp16", kwargs_handlers=handlers
    )
    _train(accelerator)
    reference = torch.amp.GradScaler("cpu", **fields)  # the same loop, one process
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data(0):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        reference.scale(loss).backward()
        reference.step(optimizer)
        reference.update()
        optimizer.zero_grad()
    off = Accelerator(
        cpu=True,
        live=False,
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(enabled=False)],
    )
    return {
        "scale": accelerator.scaler.get_scale(),
        "reference": reference.get_scale(),
        "disabled": off.scaler.is_enabled(),
    }


def case_autocast() -> dict:
    """AutocastKwargs(enabled=False) runs the bf16 forward in float32, as Accelerate's."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    out = {}
    for lib in ("nbaccel", "accelerate"):
        for enabled in (True, False):
            if lib == "nbaccel":
                handler = AutocastKwargs(enabled=enabled)
                accelerator = Accelerator(
                    cpu=True, live=False, mixed_precision="bf16", kwargs_handlers=[handler]
                )
            else:
                handler = accelerate.utils.AutocastKwargs(enabled=enabled)
                accelerator = accelerate.Accelerator(
                    cpu=True, mixed_precision="bf16", kwargs_handlers=[handler]
                )
            model = accelerator.prepare(_model())
            with torch.no_grad():
                forward = model(x)
                with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=False)):
                    block = accelerator.unwrap_model(model, keep_fp32_wrapper=False)(x)
            out[(lib, enabled)] = {"forward": forward, "block": block}
            accelerate.state.AcceleratorState._reset_state()
    out["plain"] = _model()(x).detach()
    return out


CASES = {  # in this order: case_init needs a process without a group
    "init": case_init,
    "ddp arguments": case_ddp_arguments,
    "hooks": case_hooks,
    "scaler": case_scaler,
    "autocast": case_autocast,
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
def test_init_process_group_kwargs_reach_the_group_and_a_second_is_refused(two_ranks):
    for result in case(two_ranks, "init"):
        assert result["timeout"] == timedelta(seconds=123)
        assert result["backend"] == "gloo"
        assert "exists already" in result["refused"]
        assert "nbaccel runs 'gloo'" in result["backend refused"]


@multiprocess
def test_every_ddp_argument_reaches_ddp_as_in_accelerate(two_ranks):
    for result in case(two_ranks, "ddp arguments"):
        for seen in result.values():
            assert seen["nbaccel"] == seen["accelerate"]
        assert result["most"]["nbaccel"]["bucket_bytes_cap"] == 1024 * 1024
        assert result["most"]["nbaccel"]["find_unused_parameters"] is True
        assert result["most"]["nbaccel"]["broadcast_buffers"] is False
        assert result["most"]["nbaccel"]["gradient_as_bucket_view"] is True
        assert result["static"]["nbaccel"]["static_graph"] is True
        assert result["static"]["nbaccel"]["dim"] == 1


@multiprocess
@pytest.mark.parametrize(("hook", "wrapper", "option"), HOOKS)
def test_comm_hook_weights_equal_accelerates(two_ranks, hook, wrapper, option):
    """Same hook, same weights, to HOOK_TOLERANCE; the breakdown still saw every bucket."""
    for result in case(two_ranks, "hooks"):
        runs = result[(hook, wrapper, str(option))]
        if hook == BROKEN and "refused" in runs["accelerate"]:
            assert "AssertionError" in runs["accelerate"]["refused"]  # torch's own failure
            assert "Use comm_hook='power_sgd'" in runs["nbaccel"]["refused"]
            continue
        weights = zip(runs["nbaccel"]["weights"], runs["accelerate"]["weights"], strict=True)
        for ours, theirs in weights:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=HOOK_TOLERANCE)
        assert runs["nbaccel"]["buckets"] >= STEPS  # the user's hook composed with the timing


@multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks only: torch refuses bf16 hooks")
def test_bf16_hooks_are_refused_by_torch_on_cpu_as_in_accelerate(two_ranks):
    for result in case(two_ranks, "hooks"):
        for hook, wrapper, option in BF16_HOOKS:
            runs = result[(hook, wrapper, str(option))]
            for lib in ("nbaccel", "accelerate"):
                assert "BF16 all reduce communication hook required" in runs[lib]["refused"]


@multiprocess
def test_compression_changes_the_numbers_only_a_little(two_ranks):
    """The lossy hooks stay near the exact all-reduce (fp16 ~1e-3 relative, PowerSGD more)."""
    for result in case(two_ranks, "hooks"):
        exact = result[("no", "no", "{}")]["nbaccel"]["weights"]
        for (hook, _, _), runs in result.items():
            if "refused" in runs["nbaccel"]:  # bf16 on CPU
                continue
            tolerance = 1e-2 if hook in ("fp16", "bf16") else 0.1
            for ours, plain in zip(runs["nbaccel"]["weights"], exact, strict=True):
                torch.testing.assert_close(ours, plain, rtol=0, atol=tolerance)
            applied = not all(map(torch.equal, runs["nbaccel"]["weights"], exact))
            assert applied == (hook != "no"), hook  # the hook did change what was sent


@multiprocess
def test_grad_scaler_kwargs_reach_the_scaler(two_ranks):
    for result in case(two_ranks, "scaler"):
        assert result["scale"] == result["reference"] == 4.0 * 3.0**STEPS
        assert result["disabled"] is False


@multiprocess
def test_autocast_kwargs_as_in_accelerate(two_ranks):
    for result in case(two_ranks, "autocast"):
        for enabled in (True, False):
            ours, theirs = result[("nbaccel", enabled)], result[("accelerate", enabled)]
            torch.testing.assert_close(ours["forward"], theirs["forward"], rtol=0, atol=0)
            torch.testing.assert_close(ours["block"], result["plain"], rtol=0, atol=0)
        assert torch.equal(result[("nbaccel", False)]["forward"], result["plain"])
        assert not torch.equal(result[("nbaccel", True)]["forward"], result["plain"])


# -- one process: the refusals and warnings ---------------------------------------------------
def test_two_handlers_of_one_kind_are_refused():
    with pytest.raises(ValueError, match="two GradScalerKwargs"):
        Handlers.sorted([GradScalerKwargs(), GradScalerKwargs(init_scale=2.0)])
    with pytest.raises(TypeError, match="kwargs_handlers takes"):
        Handlers.sorted([{"find_unused_parameters": True}])


def test_accelerates_own_handlers_are_taken():
    handlers = Handlers.sorted([accelerate.utils.GradScalerKwargs(init_scale=2.0)])
    assert handlers.scaler == GradScalerKwargs(init_scale=2.0)


def test_handler_fields_and_defaults_are_accelerates():
    import inspect

    for ours, theirs in (
        (DistributedDataParallelKwargs, accelerate.utils.DistributedDataParallelKwargs),
        (GradScalerKwargs, accelerate.utils.GradScalerKwargs),
        (InitProcessGroupKwargs, accelerate.utils.InitProcessGroupKwargs),
        (AutocastKwargs, accelerate.utils.AutocastKwargs),
    ):
        mine = {f: v.default for f, v in inspect.signature(ours).parameters.items()}
        them = {f: v.default for f, v in inspect.signature(theirs).parameters.items()}
        assert mine.keys() == them.keys(), ours
        for name in mine:
            assert mine[name] == them[name] or str(mine[name]) == str(them[name]), (ours, name)
        assert ours().to_kwargs() == theirs().to_kwargs() == {}
    assert {m.value for m in DDPCommunicationHookType} == {
        m.value for m in accelerate.utils.DDPCommunicationHookType
    }


def test_hook_options_that_mean_nothing_are_refused():
    with pytest.raises(ValueError, match="must be one of"):
        DistributedDataParallelKwargs(comm_hook="fp8")
    with pytest.raises(ValueError, match="must be one of"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="power_sgd")
    with pytest.raises(ValueError, match="configures PowerSGD"):
        DistributedDataParallelKwargs(comm_hook="fp16", comm_state_option={"x": 1})
    with pytest.raises(ValueError, match="wraps a comm_hook"):
        DistributedDataParallelKwargs(comm_wrapper="fp16")


def test_a_handler_with_nothing_to_configure_warns():
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    with pytest.warns(UserWarning, match="does not use DDP"):
        Accelerator(cpu=True, live=False, kwargs_handlers=[ddp])
    with pytest.warns(UserWarning, match="uses no GradScaler"):
        Accelerator(
            cpu=True, live=False, mixed_precision="bf16", kwargs_handlers=[GradScalerKwargs(2.0)]
        )
    with pytest.warns(UserWarning, match="runs no autocast"):
        Accelerator(cpu=True, live=False, kwargs_handlers=[AutocastKwargs(cache_enabled=False)])
    with pytest.warns(UserWarning, match="one process has no process group"):
        Accelerator(cpu=True, live=False, kwargs_handlers=[InitProcessGroupKwargs("gloo")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # handlers at their defaults ask for nothing
        defaults = [DistributedDataParallelKwargs(), GradScalerKwargs(), AutocastKwargs()]
        Accelerator(cpu=True, live=False, kwargs_handlers=[*defaults, InitProcessGroupKwargs()])


def test_what_a_back_end_cannot_honour_is_refused():
    handlers = Handlers.sorted([GradScalerKwargs(init_scale=2.0)])
    with pytest.raises(ValueError, match="DeepSpeed config"):
        handlers.check("DEEPSPEED", ddp=False, mode="fp16", scales=False)
    handlers = Handlers.sorted([AutocastKwargs(cache_enabled=False)])
    with pytest.raises(ValueError, match="under FSDP the forward runs without autocast"):
        handlers.check("FSDP", ddp=False, mode="bf16", scales=True)
