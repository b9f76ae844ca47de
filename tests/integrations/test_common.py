"""What the integrations share (``observe/hf/common.py``): the numbers out of another library's
log, the empty panel's hint, and the note of what a loop's hooks cannot time apart."""

from __future__ import annotations

import numpy as np
import torch

from nbaccel import Run
from nbaccel.env import CHANNEL_VAR, METRICS_DIR_VAR
from nbaccel.observe.channel import (
    TIME_COMMUNICATION,
    TIME_COMPUTE,
    TIME_DATA,
    TIME_LOOP,
    UNMEASURED,
    Record,
)
from nbaccel.observe.hf import common
from nbaccel.observe.hf.common import empty_hint, numbers
from nbaccel.observe.live.panel import Panel
from nbaccel.observe.live.view import LiveView

from ..observe.live.test_view import FakeFrontend


def test_numbers_keeps_numbers_and_flattens_dicts():
    logged = {
        "loss": torch.tensor(0.5),
        "lr": np.float32(0.25),
        "acc": np.array([0.75]),
        "eval": {"loss": 2},
        "phase": "train",
        "done": True,
        "logits": torch.ones(3),
    }
    assert numbers(logged) == {"loss": 0.5, "lr": 0.25, "acc": 0.75, "eval/loss": 2.0}


def uses_trainer():
    from transformers import Trainer

    return Trainer


def uses_accelerate():
    import accelerate

    return accelerate.Accelerator


def uses_nbaccel():
    from nbaccel import Accelerator

    return Accelerator


def calls_a_helper_that_uses_trainer():
    return uses_trainer()


def test_the_hint_names_the_integration_for_the_library_the_function_uses():
    assert "callbacks=[nbaccel.LiveCallback()]" in empty_hint(uses_trainer)
    assert "callbacks=[nbaccel.LiveCallback()]" in empty_hint(calls_a_helper_that_uses_trainer)
    assert "log_with=nbaccel.LiveTracker()" in empty_hint(uses_accelerate)
    assert empty_hint(uses_nbaccel) is None
    assert empty_hint(print) is None  # no code to read


def test_an_empty_run_closes_with_the_hint_and_a_recorded_one_without():
    view = LiveView(frontend=FakeFrontend())
    view.empty_hint = empty_hint(uses_trainer)
    view.close(Run())
    assert view.frontend.texts == [view.empty_hint]
    view = LiveView(frontend=FakeFrontend())
    view.empty_hint = "never said"
    run = Run()
    run.add([Record(0, 0, 1e9, "loss", 1.0)])
    view.close(run)
    assert "never said" not in view.frontend.texts


def test_a_log_before_the_watch_still_names_the_runs_device(monkeypatch):
    # LiveTracker.log makes this process's recorder without a device; the watch, after it,
    # knows the device: the run must be named by it, as when the watch came first
    monkeypatch.delenv(CHANNEL_VAR, raising=False)
    monkeypatch.delenv(METRICS_DIR_VAR, raising=False)
    first = common.recorder()
    try:
        assert first.run.device is None
        assert common.recorder(device=torch.device("cpu")) is first
        assert first.run.device == "CPU"
    finally:
        common.close()


def test_a_part_not_measured_apart_is_said_under_the_bars():
    run = Run()
    parts = {TIME_DATA: 1.0, TIME_COMPUTE: 3.0, TIME_COMMUNICATION: 0.0, TIME_LOOP: 5.0}
    run.add([Record(r, 0, 1e9, n, v) for r in (0, 1) for n, v in parts.items()])
    assert run.unmeasured() == []
    run.add([Record(1, 0, 1e9, UNMEASURED + "communication", 1.0)])
    assert run.unmeasured() == ["communication"]
    panel = Panel()
    panel.png(run, None)
    assert "communication not measured apart (in compute)" in panel.breakdown.ax.get_xlabel()
