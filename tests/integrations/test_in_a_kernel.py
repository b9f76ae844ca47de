"""From notebook cells in a real Jupyter kernel, as a user runs them: transformers' Trainer and
HF Accelerate's Accelerator, defined in cells, trained on 2 CPU processes by notebook_launcher
with nbaccel's callback and tracker; the panel is drawn, every rank's records reach the Run, and
the weights equal a run without the integration."""

from __future__ import annotations

import pytest

from ..kernel import kernel_with, no_workers_left

pytest.importorskip("transformers", reason="make installs it (nbaccel[transformers])")
pytestmark = pytest.mark.multiprocess

CELLS = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from nbaccel import LiveCallback, LiveTracker, Run, notebook_launcher

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16):
        self.ids = torch.randint(0, 100, (n, length), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i, 0] % 2}

def with_trainer(callback, folder):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=4, num_train_epochs=2,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[LiveCallback()] if callback else [])
    trainer.train()
    return [p.detach() for p in model.parameters()]

def with_accelerate(integrated):
    from accelerate import Accelerator
    torch.manual_seed(0)
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    accelerator = Accelerator(cpu=True, log_with=LiveTracker() if integrated else None)
    accelerator.init_trackers("course")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if integrated:
        loader = LiveTracker.watch(accelerator, model, optimizer, loader)
    for epoch in range(3):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss.item()})
    accelerator.end_training()
    return [p.detach() for p in accelerator.unwrap_model(model).parameters()]

def same(a, b):
    return all(torch.allclose(p, q, rtol=0, atol=1e-6) for x, y in zip(a, b) for p, q in zip(x, y))
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with kernel_with(str(tmp_path_factory.mktemp("kernel")), CELLS) as kernel:
        yield kernel


@pytest.fixture(autouse=True)
def _no_workers_left(kernel):
    yield
    no_workers_left(kernel)


def with_and_without(kernel, function: str, live: str, plain: str, answer: str):
    """Launch ``function(*live)`` with ``run=run`` (the panel must be drawn), then
    ``function(*plain)`` without the integration; the cell's answer is ``answer``'s value."""
    launch = "num_processes=2, cpu=True, return_all=True"
    out = kernel.run(
        f"run = Run()\nlive = notebook_launcher({function}, args={live}, {launch}, run=run)",
        timeout=300,
    )
    assert out.error is None, out.error
    assert out.images, "no panel was drawn"
    check = kernel.run(
        f"plain = notebook_launcher({function}, args={plain}, {launch})\n{answer}", timeout=300
    )
    assert check.error is None, check.error
    return check


def test_trainer_with_the_callback_draws_both_ranks(kernel):
    check = with_and_without(
        kernel, "with_trainer", "(True, 'a')", "(False, 'b')",
        "(sorted(run.series('loss')), sorted(run.latest('nbaccel/samples')),"
        " same(live, plain), run.to_csv('trainer.csv').exists())",
    )  # fmt: skip
    assert check.value == "([0, 1], [0, 1], True, True)"
    # the launch without the callback recorded nothing: the panel's empty state names it
    assert any("callbacks=[nbaccel.LiveCallback()]" in text for text in check.texts), check.texts


def test_accelerates_accelerator_with_the_tracker_draws_rank_0s_loss_and_both_ranks_samples(
    kernel,
):
    check = with_and_without(
        kernel, "with_accelerate", "(True,)", "(False,)",
        "(sorted(run.series('loss')), sorted(run.latest('nbaccel/samples')),"
        " sorted(run.breakdown()), same(live, plain), run.to_json('accelerate.json').exists())",
    )  # fmt: skip
    assert check.value == "([0], [0, 1], [0, 1], True, True)"
