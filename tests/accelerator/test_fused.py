"""The step's fused calls (``nbaccel/accelerator/fused.py``) against the calls they stand for.

``Accelerator.backward`` and the prepared optimizer's ``step`` do in one Python frame, where
they can, what ``backward_by_calls`` and ``step_by_calls`` do through ``Strategy.backward``,
``Breakdown.call`` and ``AccumulationWindow.stepped``. The oracle: the same loop run both ways
leaves the same weights, bit for bit, and the same state wherever those calls write. The
breakdown's clock here counts its readings (1, 2, 3, ...), so equal seconds mean the same
readings in the same order.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.accelerator import fused
from nbaccel.accelerator.accumulation import AccumulationWindow
from nbaccel.accelerator.optim import AcceleratedOptimizer
from nbaccel.accelerator.strategies.base import Strategy
from nbaccel.env import BREAKDOWN_VAR
from nbaccel.observe.breakdown import Breakdown

BATCHES = 10  # a pass: with 3 micro-batches a window, its last window ends with the data
WATCHED = {  # the calls that the fused way makes inline, by their code
    Strategy.backward.__code__: "Strategy.backward",
    Breakdown.call.__code__: "Breakdown.call",
    AccumulationWindow.stepped.__code__: "AccumulationWindow.stepped",
}


class Readings:
    """A clock that counts its readings: 1.0, 2.0, 3.0, ..."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> float:
        self.count += 1
        return float(self.count)


def train(way: str, precision: str, steps: int, timed: bool, loader: bool, monkeypatch) -> dict:
    """Two passes of a small loop, ``way`` "fused" (as shipped) or "calls"; what it left."""
    with monkeypatch.context() as patch:
        if way == "calls":
            patch.setattr(Accelerator, "backward", fused.backward_by_calls)
            patch.setattr(AcceleratedOptimizer, "step", fused.step_by_calls)
        patch.setenv(BREAKDOWN_VAR, "1" if timed else "0")
        accelerator = Accelerator(precision, gradient_accumulation_steps=steps, cpu=True)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8 * BATCHES, 6, generator=g), torch.randn(8 * BATCHES, 1, generator=g)
        batches = DataLoader(TensorDataset(x, y), batch_size=8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if loader:
            model, optimizer, batches = accelerator.prepare(model, optimizer, batches)
        else:  # a loop of its own batches: the first compute span starts the breakdown's loop
            model, optimizer = accelerator.prepare(model, optimizer)
        breakdown, recorder = accelerator._breakdown, accelerator.recorder
        if breakdown is not None:
            breakdown.clock = Readings()
        recorder.clock = lambda: -1.0  # never due: its quarter-second work reads real clocks
        depths, losses, calls = [], [], dict.fromkeys(WATCHED.values(), 0)
        model[0].weight.register_hook(  # inside backward: is its compute span open?
            lambda grad: depths.append(None if breakdown is None else breakdown.depth)
        )

        def count(frame, event, arg) -> None:
            if event == "call" and frame.f_code in WATCHED:
                calls[WATCHED[frame.f_code]] += 1

        sys.setprofile(count)
        try:
            for _ in range(2):
                for xb, yb in batches:
                    with accelerator.accumulate(model):
                        loss = nn.functional.mse_loss(model(xb), yb)
                        accelerator.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad()
                    losses.append(loss.item())
        finally:
            sys.setprofile(None)
        window = accelerator._window
        left = {
            "weights": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad for p in model.parameters()],
            "losses": losses,
            "depths in backward": depths,
            "optimizer": (optimizer.stepped, optimizer.step_was_skipped),
            "window": (window.step, window.sync_gradients, window.holds_gradients),
            "last steps": list(window.last_step.values()),
            "recorder": (recorder.optimizer_steps, recorder.samples),
            "calls": calls,
        }
        if breakdown is not None:
            left["breakdown"] = (
                breakdown.start,
                breakdown.data,
                breakdown.compute,
                breakdown.communication,
                breakdown.depth,
                breakdown.clock.count,
            )
        accelerator.end_training()
        return left


@pytest.mark.parametrize("loader", [True, False], ids=["prepared loader", "own batches"])
@pytest.mark.parametrize("timed", [True, False], ids=["breakdown", "no breakdown"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_the_fused_calls_leave_what_the_calls_leave(precision, steps, timed, loader, monkeypatch):
    fused_way = train("fused", precision, steps, timed, loader, monkeypatch)
    by_calls = train("calls", precision, steps, timed, loader, monkeypatch)
    micro_batches = 2 * BATCHES  # a prepared loader's last batch ends a window early
    real_steps = 2 * -(-BATCHES // steps) if loader else micro_batches // steps
    if precision != "fp16":  # the loop ran as meant (fp16 skips its first steps: inf grads)
        assert by_calls["recorder"][0] == real_steps
    assert by_calls["calls"]["Strategy.backward"] == micro_batches
    assert by_calls["calls"]["AccumulationWindow.stepped"] == real_steps
    if timed:  # each forward, backward and real step is a span; each span opened in backward
        assert by_calls["calls"]["Breakdown.call"] == 2 * micro_batches + real_steps
        assert by_calls["depths in backward"] == [1] * micro_batches
    fused_calls = fused_way.pop("calls")
    if precision == "fp16":  # the scaler's backward and step: the calls, both ways
        assert fused_calls == by_calls["calls"]
    else:  # inline: the forward's span is the one call left
        assert fused_calls == {
            "Strategy.backward": 0,
            "Breakdown.call": micro_batches if timed else 0,
            "AccumulationWindow.stepped": 0,
        }
    del by_calls["calls"]
    for a, b in zip(fused_way.pop("weights"), by_calls.pop("weights"), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fused_way.pop("grads"), by_calls.pop("grads"), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)  # held by an unfinished window
    assert fused_way == by_calls  # losses, depths, every counter and flag


def test_a_span_open_around_backward_and_step_is_the_one_that_counts(monkeypatch):
    """Inside a compute span of the loop's own (``with breakdown:``), ``backward`` and ``step``
    open none of their own: the outer span holds their time, once, both ways."""
    seen = {}
    for way in ("fused", "calls"):
        with monkeypatch.context() as patch:
            if way == "calls":
                patch.setattr(Accelerator, "backward", fused.backward_by_calls)
                patch.setattr(AcceleratedOptimizer, "step", fused.step_by_calls)
            patch.setenv(BREAKDOWN_VAR, "1")
            accelerator = Accelerator(cpu=True)
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model, optimizer = accelerator.prepare(model, optimizer)
            breakdown = accelerator._breakdown
            breakdown.clock = Readings()
            with breakdown:  # opened at reading 1
                accelerator.backward(model(torch.ones(2, 4)).sum())  # the forward: nested
                optimizer.step()
            # closed at the last reading: the outer span alone counted
            seen[way] = (breakdown.compute, breakdown.clock.count, breakdown.depth)
            assert breakdown.compute == breakdown.clock.count - 1
            accelerator.end_training()
    assert seen["fused"] == seen["calls"]


def test_a_backward_that_is_the_first_compute_span_starts_the_loop(monkeypatch):
    """A model the Accelerator did not prepare has no timed forward: then ``backward``'s span is
    the loop's first timed moment (``Breakdown.start``), both ways."""
    seen = {}
    for way in ("fused", "calls"):
        with monkeypatch.context() as patch:
            if way == "calls":
                patch.setattr(Accelerator, "backward", fused.backward_by_calls)
                patch.setattr(AcceleratedOptimizer, "step", fused.step_by_calls)
            patch.setenv(BREAKDOWN_VAR, "1")
            accelerator = Accelerator(cpu=True)
            torch.manual_seed(0)
            model = nn.Linear(4, 1)  # not prepared: its forward is not timed
            optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
            breakdown = accelerator._breakdown
            breakdown.clock = Readings()
            accelerator.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            assert breakdown.start == 1.0  # backward's first reading
            seen[way] = (breakdown.start, breakdown.compute, breakdown.clock.count)
            accelerator.end_training()
    assert seen["fused"] == seen["calls"]
