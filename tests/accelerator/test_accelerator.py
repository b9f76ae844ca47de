"""The Accelerator in one process, checked against plain PyTorch on the same data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator, set_seed
from nbaccel.accelerator.optim import AcceleratedOptimizer


def make_data(n: int = 128, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def plain_training(data, batch_size: int, epochs: int = 2):
    """Plain PyTorch, one process: the oracle."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    for _ in range(epochs):
        for x, y in DataLoader(data, batch_size=batch_size):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()
    return model, scheduler.get_last_lr()


def accelerated_training(data, batch_size: int, steps: int, order: str, epochs: int = 2):
    accelerator = Accelerator(gradient_accumulation_steps=steps)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(data, batch_size=batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                if order == "zero_grad first":  # the course's order
                    optimizer.zero_grad()
                    accelerator.backward(nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                else:  # Accelerate's documented order
                    accelerator.backward(nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                scheduler.step()
    return model, scheduler.get_last_lr()


@pytest.mark.parametrize("order", ["zero_grad first", "zero_grad last"])
def test_accumulation_matches_the_big_batch(order):
    """K micro-batches of B end on the weights of plain PyTorch with batches of K*B."""
    data = make_data(128)
    expected, expected_lr = plain_training(data, batch_size=32)
    got, got_lr = accelerated_training(data, batch_size=8, steps=4, order=order)
    for (name, a), b in zip(expected.state_dict().items(), got.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=f"{name} differs")
    assert got_lr == expected_lr  # the scheduler counted optimizer steps, not micro-batches


def test_a_wiped_window_would_be_caught():
    """The oracle can fail: dividing the loss twice leaves the weights far from the big batch."""
    data = make_data(128)
    expected, _ = plain_training(data, batch_size=32)
    accelerator = Accelerator(gradient_accumulation_steps=4)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
    for _ in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y) / 4)
                optimizer.step()
                optimizer.zero_grad()
    gap = max(
        (a - b).abs().max().item()
        for a, b in zip(expected.parameters(), model.parameters(), strict=True)
    )
    assert gap > 1e-3


def test_sync_gradients_follows_the_window_and_the_end_of_data():
    accelerator = Accelerator(gradient_accumulation_steps=4)
    loader = accelerator.prepare(DataLoader(make_data(40), batch_size=4))  # 10 batches
    seen = []
    for _ in loader:
        with accelerator.accumulate():
            seen.append(accelerator.sync_gradients)
    assert seen == [False, False, False, True] * 2 + [False, True]
    seen = []
    for _ in loader:
        with accelerator.accumulate():
            seen.append(accelerator.sync_gradients)
    assert seen[:4] == [False, False, False, True]  # the next epoch starts a fresh window


def test_optimizer_steps_once_per_window():
    accelerator = Accelerator(gradient_accumulation_steps=3)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = make_data(8).tensors
    before = copy.deepcopy(model.state_dict())
    changes = []
    for _ in range(6):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        after = model.state_dict()
        changes.append(any(not torch.equal(before[k], after[k]) for k in after))
        before = copy.deepcopy(after)
    assert changes == [False, False, True, False, False, True]


def test_batches_arrive_on_the_device_in_their_structure():
    accelerator = Accelerator(cpu=True)
    data = [{"x": torch.ones(2), "pair": (torch.zeros(1), 3)} for _ in range(4)]
    loader = accelerator.prepare(DataLoader(data, batch_size=2))
    batch = next(iter(loader))
    assert batch["x"].device == accelerator.device
    assert isinstance(batch["pair"], list) and batch["pair"][0].shape == (2, 1)
    assert len(loader) == 2 and loader.batch_size == 2


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_prepared_forward_runs_under_autocast(mode, dtype):
    accelerator = Accelerator(mixed_precision=mode, cpu=True)
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 3)))
    inner = []
    model[0].register_forward_hook(lambda m, i, out: inner.append(out.dtype))
    out = model(torch.randn(2, 4))
    assert inner == [dtype]  # computed in low precision ...
    assert out.dtype == torch.float32  # ... handed back as float32 for the loss
    with accelerator.autocast():
        assert nn.Linear(4, 3)(torch.randn(2, 4)).dtype == dtype
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    plain(torch.randn(2, 4))
    assert inner[1:] == [torch.float32]  # the autocast wrapper is gone


def autocast_state() -> tuple:
    """CPU autocast's switches, and how many autocast blocks are open (torch's count)."""
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled(), nesting)  # fmt: skip


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_prepared_forward_computes_what_torch_autocast_computes(mode, dtype):
    """The prepared forward turns autocast on and off with torch's switches (not the context
    manager's Python): its output and gradients equal, bit for bit, those of the same module
    under ``torch.autocast`` with the output made float32, also after the weights changed in
    place (autocast's casts of them are dropped with each forward); inside a user's own
    autocast block it leaves that block's state as it was; a forward that raises leaves
    autocast off."""
    set_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(5, 8)
    twin = copy.deepcopy(model)
    prepared = Accelerator(mixed_precision=mode, cpu=True).prepare(model)
    outside = autocast_state()
    out = prepared(x)
    assert autocast_state() == outside
    with torch.autocast("cpu", dtype):
        expected = twin(x).float()
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)

    def step() -> None:  # an optimizer's: in place, which the weights' casts must follow
        with torch.no_grad():
            for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
                mine.sub_(0.25)
                theirs.sub_(0.25)

    step()
    prepared(x)
    step()
    out = prepared(x)  # before any block of this test's own drops the casts a forward left
    with torch.autocast("cpu", dtype):
        assert torch.equal(out, twin(x).float())
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        inside = autocast_state()
        prepared(x)
        assert autocast_state() == inside  # still on, in the block's dtype and cache setting
    broken = Accelerator(mixed_precision=mode, cpu=True).prepare(nn.Linear(8, 3))
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        broken(torch.randn(5, 4))
    assert autocast_state() == outside


def test_launch_default_mixed_precision_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"
    assert Accelerator(mixed_precision="no").mixed_precision == "no"


def test_two_accelerators_share_no_state():
    a, b = Accelerator(gradient_accumulation_steps=2), Accelerator(gradient_accumulation_steps=3)
    with a.accumulate():
        pass
    assert (a.step, b.step) == (1, 0)
    assert a.sync_gradients is False and b.sync_gradients is True
    assert a.run is not b.run


def test_fp16_on_cpu_skips_a_step_with_inf_gradients():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model = nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    weights = model.weight.detach().clone()
    accelerator.backward(model(torch.full((2, 4), float("inf"))).sum())
    optimizer.step()
    scheduler.step()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert torch.equal(model.weight, weights) and scheduler.get_last_lr() == [0.1]
    optimizer.zero_grad()
    accelerator.backward(model(torch.full((2, 4), 0.01)).sum())  # fits fp16 at scale 2**15
    optimizer.step()
    scheduler.step()
    assert not optimizer.step_was_skipped and scheduler.get_last_lr() == [0.05]


def test_clip_grad_norm_clips_the_true_gradient_under_fp16():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model = nn.Linear(4, 1, bias=False)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(optimizer, AcceleratedOptimizer)
    # d(mean)/dw = 0.01 for each of the 4 weights: the norm is 0.02 (65536x that, scaled)
    accelerator.backward(model(torch.full((8, 4), 0.01)).mean())
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.01)
    torch.testing.assert_close(norm, torch.tensor(0.02), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.weight.grad.norm(), torch.tensor(0.01), atol=1e-5, rtol=0)
    optimizer.step()  # unscaled once, stepped once: GradScaler does not unscale twice
    assert not optimizer.step_was_skipped


def test_unwrap_model_returns_the_users_module():
    accelerator = Accelerator()
    model = make_model()
    assert accelerator.unwrap_model(accelerator.prepare(model)) is model
    assert accelerator.unwrap_model(nn.DataParallel(model)) is model


def test_split_and_collectives_in_one_process():
    accelerator = Accelerator()
    with accelerator.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    t = torch.arange(3.0)
    assert accelerator.gather(t) is t and accelerator.gather_for_metrics(t) is t
    torch.testing.assert_close(accelerator.reduce(t, "mean"), t)
    accelerator.wait_for_everyone()
    with accelerator.main_process_first():
        pass


def test_print_only_on_the_main_process(capsys):
    Accelerator().print("hello")
    assert capsys.readouterr().out == "hello\n"


def test_log_records_numbers():
    accelerator = Accelerator()
    accelerator.log({"loss": torch.tensor(0.5), "lr": 1e-3}, step=3)
    accelerator.log({"loss": 0.25})
    assert accelerator.run.series("loss") == {0: ([3, 1], [0.5, 0.25])}
    assert accelerator.run.series("lr") == {0: ([3], [1e-3])}


def test_set_seed_repeats_the_draws():
    set_seed(7)
    a = torch.rand(3)
    set_seed(7)
    assert torch.equal(a, torch.rand(3))


# -- bad input: each raise says what was wrong and how to fix it --------------------------------
def test_unknown_mixed_precision():
    with pytest.raises(ValueError, match=r"mixed_precision='fp32' is not one of 'no', 'fp16'"):
        Accelerator(mixed_precision="fp32")


@pytest.mark.parametrize("steps", [2.0, "4", True])
def test_accumulation_steps_must_be_an_int(steps):
    with pytest.raises(TypeError, match=r"gradient_accumulation_steps=.* must be an int"):
        Accelerator(gradient_accumulation_steps=steps)


@pytest.mark.parametrize("steps", [0, -2])
def test_accumulation_steps_must_be_positive(steps):
    with pytest.raises(ValueError, match=r"must be a positive int"):
        Accelerator(gradient_accumulation_steps=steps)


def test_prepare_passes_what_it_does_not_prepare_through():  # as Accelerate's prepare
    options = {"lr": 1e-3}
    assert Accelerator().prepare(options) is options


def test_log_refuses_what_is_not_a_number():
    with pytest.raises(TypeError, match=r"log\(\) got acc='high'"):
        Accelerator().log({"acc": "high"})
    with pytest.raises(TypeError, match=r"tensor of shape \(3,\)"):
        Accelerator().log({"loss": torch.ones(3)})


def test_reduce_names_the_allowed_reductions():
    with pytest.raises(ValueError, match=r"reduction='avg' must be one of \['max', 'mean'"):
        Accelerator().reduce(torch.ones(1), "avg")
