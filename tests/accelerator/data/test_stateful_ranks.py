"""``use_stateful_dataloader=True`` on two CPU ranks (gloo): a shuffled pass that a checkpoint
interrupted resumes on every rank with exactly the batches the uninterrupted pass went on with."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator, DataLoaderConfiguration

from ...distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def resume_mid_epoch(folder: str, dispatch: bool) -> list:
    config = DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=dispatch)
    data = TensorDataset(torch.arange(40.0))

    def prepared(seed):
        torch.manual_seed(seed)
        accelerator = Accelerator(dataloader_config=config)
        return accelerator, accelerator.prepare(DataLoader(data, batch_size=3, shuffle=True))

    first, loader = prepared(0)
    seen = []
    for i, (batch,) in enumerate(loader):
        seen.append(batch.tolist())
        if i == 2:
            first.save_state(folder)
    second, loader = prepared(123)  # another run: another shuffle, until load_state
    second.load_state(folder)
    resumed = [batch.tolist() for (batch,) in loader]
    return [resumed == seen[3:], len(seen)]


def test_a_shuffled_pass_resumes_on_every_rank(tmp_path):
    assert run_ranks(resume_mid_epoch, str(tmp_path / "ckpt"), False) == [[True, 7], [True, 7]]


def refuse_dispatch(folder: str) -> str:
    try:
        resume_mid_epoch(folder, True)
    except ValueError as err:
        return str(err)
    return "not refused"


def test_dispatched_stateful_loaders_are_refused_on_several_ranks(tmp_path):
    for message in run_ranks(refuse_dispatch, str(tmp_path / "ckpt")):
        assert "dispatch_batches=True on several processes is not supported" in message
