"""HF Accelerate's own Accelerator under notebook_launcher, with nbaccel's LiveTracker and its
watch: what reaches the notebook's Run, and that nothing Accelerate computes changes (the
oracle: the same loop without the integration, to 1e-6)."""

from __future__ import annotations

import pytest
import torch

from nbaccel import Run, notebook_launcher
from nbaccel.observe.channel import SAMPLES, STEPS

from .loops import ACCUMULATION, BATCH, EPOCHS, accelerate_loop
from .loops import SAMPLES as DATA

pytestmark = pytest.mark.multiprocess

BATCHES = EPOCHS * DATA // 2 // BATCH  # per rank: half the data each epoch
TOLERANCE = 1e-6


def launch(*args, run=None):
    return notebook_launcher(
        accelerate_loop, args=args, num_processes=2, cpu=True, run=run, return_all=True,
        live=False, timeout=300,
    )  # fmt: skip


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(p, q, rtol=0, atol=TOLERANCE) for p, q in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def without():
    """The loop without nbaccel: each rank's weights."""
    return launch(False, False)


def test_tracker_and_watch_record_every_rank_and_change_no_number(without, tmp_path):
    run = Run()
    values = launch(True, True, run=run)
    for rank in (0, 1):
        assert same(values[rank][:-1], without[rank][:-1]), f"rank {rank}'s weights moved"
    # Accelerate calls trackers on its main process only: rank 0's loss, every micro-batch
    assert list(run.series("loss")) == [0]
    assert run.series("loss")[0][0] == list(range(BATCHES))
    # the watch: every rank's samples and optimizer steps, and where its time went
    assert run.latest(SAMPLES) == {0: DATA * EPOCHS / 2, 1: DATA * EPOCHS / 2}
    assert run.latest(STEPS) == {0: BATCHES / ACCUMULATION, 1: BATCHES / ACCUMULATION}
    breakdown = run.breakdown()
    assert sorted(breakdown) == [0, 1]
    for parts in breakdown.values():
        assert parts["compute"] > 0 and parts["data"] > 0
        assert parts["communication"] > 0  # the hook saw each all-reduce done after its bucket
    assert run.unmeasured() == []
    exported = run.to_csv(tmp_path / "run.csv").read_text()
    assert "nbaccel/samples" in exported and "loss" in exported
    assert Run.from_json(run.to_json(tmp_path / "run.json")).latest(SAMPLES) == run.latest(SAMPLES)


def test_a_second_watch_replaces_the_first_and_counts_nothing_twice(without):
    # a notebook cell that watches run twice: the samples, steps and communication once
    run = Run()
    values = launch(True, 2, run=run)
    assert same(values[0][:-1], without[0][:-1]) and same(values[1][:-1], without[1][:-1])
    assert run.latest(SAMPLES) == {0: DATA * EPOCHS / 2, 1: DATA * EPOCHS / 2}
    assert run.latest(STEPS) == {0: BATCHES / ACCUMULATION, 1: BATCHES / ACCUMULATION}
    assert run.unmeasured() == []
    assert all(parts["communication"] > 0 for parts in run.breakdown().values())


def test_the_tracker_alone_draws_rank_0s_loss_and_counts_nothing(without):
    run = Run()
    values = launch(True, False, run=run)
    assert same(values[0][:-1], without[0][:-1])
    assert list(run.series("loss")) == [0]
    assert run.latest(SAMPLES) == {}
    assert run.breakdown() == {}


def test_a_hook_of_the_users_after_the_watch_runs_inside_its_timing(without):
    run = Run()
    values = launch(True, True, "after", run=run)
    assert values[0][-1].item() > 0 and values[1][-1].item() > 0  # the user's hook ran
    assert same(values[0][:-1], without[0][:-1])
    assert run.unmeasured() == []
    assert all(parts["communication"] > 0 for parts in run.breakdown().values())


def test_a_hook_accelerate_registered_is_kept_and_communication_said_unmeasured():
    run = Run()
    values = launch(True, True, "accelerate", run=run)
    plain = launch(False, False, "accelerate")
    assert same(values[0][:-1], plain[0][:-1])  # Accelerate's fp16 hook still compresses
    assert run.unmeasured() == ["communication"]
    assert all(parts["communication"] == 0 for parts in run.breakdown().values())


def test_under_nbaccels_accelerator_the_tracker_adds_nothing_twice():
    # the port back is one import: nbaccel's Accelerator draws what it logs on every rank,
    # and its own counters: the tracker and the watch add no second record
    run = Run()
    launch(True, True, None, True, run=run)
    assert sorted(run.series("loss")) == [0, 1]
    assert run.series("loss")[0][0] == list(range(BATCHES))  # once per log call
    assert run.latest(SAMPLES) == {0: DATA * EPOCHS / 2, 1: DATA * EPOCHS / 2}


def test_the_watch_hooks_the_torch_optimizer_however_deep_the_wrappers():
    """Accelerate wraps torch's optimizer; under DeepSpeed that wrapper holds the engine's ZeRO
    optimizer, which holds torch's in turn (and has no step hooks of its own)."""
    from types import SimpleNamespace

    from nbaccel.observe.hf.tracker import _torch_optimizer

    adamw = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    zero = SimpleNamespace(optimizer=adamw)  # no register_step_post_hook, like DeepSpeed's
    accelerated = SimpleNamespace(optimizer=zero)
    assert _torch_optimizer(accelerated) is adamw
    assert _torch_optimizer(SimpleNamespace(optimizer=adamw)) is adamw
    assert _torch_optimizer(adamw) is adamw
