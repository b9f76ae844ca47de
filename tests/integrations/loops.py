"""Training loops written for other libraries, as their users write them, with and without
nbaccel's integrations: HF Accelerate's ``Accelerator`` (``LiveTracker``, its watch) and
transformers' ``Trainer`` (``LiveCallback``). Nothing is downloaded: a tiny BERT from a config,
synthetic tokens. Each returns its trained weights, so a test can compare a run with the
integration to one without (the oracle: the same numbers)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

SAMPLES, BATCH, EPOCHS, ACCUMULATION = 96, 8, 2, 2


def accelerate_loop(
    track: bool = True, watch: int = 1, hook: str | None = None, nbaccel: bool = False
) -> list[torch.Tensor]:
    """The course's Accelerate loop: regression, accumulation 2, log every micro-batch.
    ``hook``: "after" registers a communication hook of the user's after the watch (it
    counts its calls), "accelerate" has Accelerate register its fp16 hook in ``prepare``.
    ``watch``: how many times the loader is watched (2: a notebook cell run twice).
    ``nbaccel``: the same code with ``from nbaccel import Accelerator`` (the port back)."""
    from accelerate import Accelerator as HF
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from nbaccel import Accelerator as Ours
    from nbaccel import LiveTracker

    torch.manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    options = {"gradient_accumulation_steps": ACCUMULATION, "cpu": True}
    if track:
        options["log_with"] = LiveTracker()
    if hook == "accelerate":
        fp16 = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
        options["kwargs_handlers"] = [fp16]
    accelerator = (Ours if nbaccel else HF)(**options)
    accelerator.init_trackers("lesson")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(int(watch)):
        loader = LiveTracker.watch(accelerator, model, optimizer, loader)
    calls = []
    if hook == "after":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counted(state, bucket):
            calls.append(1)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counted)
    for _ in range(EPOCHS):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            accelerator.log({"loss": loss.item(), "phase": "train"})
    accelerator.end_training()
    weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return [*weights, torch.tensor(float(len(calls)))]


class Tokens(Dataset):
    """Synthetic token ids; the label is the first token's parity."""

    def __init__(self, n: int = SAMPLES // 2, length: int = 16, vocab: int = 100) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=generator)
        self.labels = self.ids[:, 0] % 2

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def trainer_loop(callback: bool = True, output_dir: str = "trainer-out") -> list[torch.Tensor]:
    """transformers' Trainer on a tiny BERT built from a config: 2 epochs, log every 2 steps."""
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from nbaccel import LiveCallback

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
        logging_steps=2, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False,
    )  # fmt: skip
    callbacks = [LiveCallback()] if callback else []
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks).train()
    return [p.detach().clone() for p in model.parameters()]
