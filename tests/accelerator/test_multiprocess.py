"""Two CPU ranks on gloo, each checked against plain PyTorch in one process on the same data.

Tolerances: DDP averages two half-batch gradients where one process averages one full batch;
float32 sums in another order differ by about 1e-7 per step, so weights after a few dozen SGD
steps agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator, set_seed

from ..distributed import run_ranks

pytestmark = pytest.mark.multiprocess
DDP_TOLERANCE = 1e-5


def make_data(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * x[:, 1:2] + x[:, 2:3]).sin()
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def train(accelerator, batch_size: int, epochs: int = 2, order: str = "zero_grad last"):
    set_seed(0)  # the same initial weights and the same shuffles as the reference
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(make_data(), batch_size=batch_size, shuffle=True)
    if accelerator is not None:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            if accelerator is None:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                continue
            with accelerator.accumulate(model):
                if order == "zero_grad first":
                    optimizer.zero_grad()
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                if order == "zero_grad last":
                    optimizer.zero_grad()
    weights = model if accelerator is None else accelerator.unwrap_model(model)
    return {k: v.detach().clone() for k, v in weights.state_dict().items()}


def ddp_against_one_process(steps: int, order: str) -> float:
    accelerator = Accelerator(gradient_accumulation_steps=steps)
    got = train(accelerator, batch_size=8, order=order)
    expected = train(None, batch_size=8 * 2 * steps)  # the same global batch, one process
    accelerator.end_training()
    assert list(got) == list(expected)  # no "module." prefix
    return max((got[k] - expected[k]).abs().max().item() for k in got)


@pytest.mark.parametrize(
    "steps, order", [(1, "zero_grad last"), (2, "zero_grad last"), (2, "zero_grad first")]
)
def test_ddp_matches_one_process_on_the_global_batch(steps, order):
    gaps = run_ranks(ddp_against_one_process, steps, order)
    assert max(gaps) < DDP_TOLERANCE, f"weights differ by {max(gaps):.2e}"


def gathers() -> dict:
    accelerator = Accelerator()
    data = TensorDataset(torch.arange(250.0))  # 250 = 15 steps of 2 x 8, plus 10
    loader = accelerator.prepare(DataLoader(data, batch_size=8))
    seen = torch.cat([accelerator.gather_for_metrics(x) for (x,) in loader])
    for (x,) in loader:  # the last step's labels, as Python objects
        labels = accelerator.gather_for_metrics([f"s{int(i)}" for i in x])
    with accelerator.split_between_processes(list(range(5)), apply_padding=True) as share:
        shares = accelerator.gather(torch.tensor(share))
    ragged = torch.ones(accelerator.rank + 1)
    out = {
        "seen": seen,
        "steps": len(loader),
        "labels": labels,
        "shares": shares,
        "padded": accelerator.gather(accelerator.pad_across_processes(ragged)),
        "sum": accelerator.reduce(torch.tensor(float(accelerator.rank + 1))),
        "mean": accelerator.reduce(torch.tensor(float(accelerator.rank + 1)), "mean"),
    }
    accelerator.end_training()
    return out


def test_gather_for_metrics_returns_every_sample_once():
    rank0, rank1 = run_ranks(gathers)
    torch.testing.assert_close(rank0["seen"], torch.arange(250.0))  # in order, no repeats
    torch.testing.assert_close(rank1["seen"], rank0["seen"])
    assert rank0["steps"] == rank1["steps"] == 16
    assert rank0["labels"] == [f"s{i}" for i in range(240, 250)]
    assert rank0["shares"].tolist() == [0, 1, 2, 3, 4, 4]  # 3 and 2, padded to 3 and 3
    assert rank0["padded"].tolist() == [1, 0, 1, 1]
    assert (rank0["sum"].item(), rank1["mean"].item()) == (3.0, 1.5)


def mixed_precision_losses(mode: str) -> list[float]:
    set_seed(0)
    accelerator = Accelerator(mixed_precision=mode)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(make_data(), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(4):
        total = torch.zeros(())
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
        losses.append(accelerator.reduce(total / len(loader), "mean").item())
    accelerator.end_training()
    return losses


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(mode):
    losses, same = run_ranks(mixed_precision_losses, mode)
    assert losses == same  # the ranks agree on the all-reduced loss
    assert losses[-1] < 0.8 * losses[0], losses  # it learns


def overflow_skips_the_step() -> dict:
    accelerator = Accelerator(mixed_precision="fp16")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = accelerator.unwrap_model(model).state_dict()
    before = {k: v.clone() for k, v in before.items()}
    x = torch.ones(4, 8)
    if accelerator.rank == 1:
        x[0, 0] = float("inf")  # one rank's inf reaches both through the all-reduce
    accelerator.backward(model(x).sum())
    optimizer.step()
    scheduler.step()
    after = accelerator.unwrap_model(model).state_dict()
    out = {
        "skipped": optimizer.step_was_skipped,
        "unchanged": all(torch.equal(before[k], after[k]) for k in after),
        "lr": scheduler.get_last_lr(),
        "scale": accelerator.scaler.get_scale(),
    }
    accelerator.end_training()
    return out


def test_an_inf_gradient_skips_the_fp16_step_and_the_scheduler():
    for result in run_ranks(overflow_skips_the_step):
        assert result == {"skipped": True, "unchanged": True, "lr": [0.1], "scale": 32768.0}


def resume(folder: str) -> bool:
    """Train 1 epoch, save, train 1 more; then restore into fresh objects and train it again."""

    def objects(accelerator, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Tanh(), nn.Linear(32, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
        loader = DataLoader(make_data(), batch_size=8, shuffle=True)
        return accelerator.prepare(model, optimizer, loader, scheduler)

    def epoch(accelerator, model, optimizer, loader, scheduler):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    first = Accelerator(gradient_accumulation_steps=3)
    parts = objects(first, seed=0)
    epoch(first, *parts)
    first.save_state(folder)
    uninterrupted = epoch(first, *parts)

    second = Accelerator(gradient_accumulation_steps=3)
    parts = objects(second, seed=123)  # other weights, other RNG: load_state must restore all
    second.load_state(folder)
    resumed = epoch(second, *parts)
    first.end_training()
    return all(torch.equal(uninterrupted[k], resumed[k]) for k in resumed)


def test_save_state_then_load_state_continues_bit_identically(tmp_path):
    assert run_ranks(resume, str(tmp_path / "ckpt")) == [True, True]


def outlive_the_group() -> tuple[bool, bool]:
    """A model still referenced after end_training, as a user's local variable would be."""
    accelerator = Accelerator(live=False)
    model = accelerator.prepare(make_model())
    accelerator.backward(model(torch.randn(16, 8)).sum())  # a fresh all-reduce
    accelerator.end_training()
    return model.reducer is None, torch.distributed.is_initialized()


def test_a_model_that_outlives_end_training_has_let_go_of_the_group():
    # Plain PyTorch with gloo: a DDP model freed after destroy_process_group hung within 60
    # rounds here (its Reducer tore the group down holding the GIL a gloo thread waited for);
    # with the Reducer freed first, 200 rounds passed. end_training frees it first.
    assert run_ranks(outlive_the_group) == [(True, False), (True, False)]
