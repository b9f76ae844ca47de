"""A prepared Accelerator pickles and unpickles (Accelerate's code does, e.g. to hand it to a
subprocess or a cache): the copy reports the same state and yields the same batches; it does
not hold the process group, draw the live view or send records (the original does)."""

from __future__ import annotations

import pickle

import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator


def test_a_prepared_accelerator_round_trips():
    accelerator = Accelerator(cpu=True, live=False)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(24.0).reshape(8, 3))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2))
    accelerator.log({"loss": 1.0})
    copy = pickle.loads(pickle.dumps(accelerator))
    assert copy is not accelerator
    assert accelerator.state.__dict__ == copy.state.__dict__  # as Accelerate's test asks
    assert copy.state.__dict__["num_processes"] == 1
    copied_loader = copy._dataloaders[0]
    assert [b[0].tolist() for b in copied_loader] == [b[0].tolist() for b in loader]
    copy.log({"loss": 2.0})  # goes to the copy's own records, not the original's
    assert [r.value for r in accelerator.run.records if r.name == "loss"] == [1.0]
    accelerator.end_training()
