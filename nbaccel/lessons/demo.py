"""`make demo`: a short DDP training run on 2 CPU workers, through the Accelerator.

Started by torch's elastic launcher (``torchrun --nproc-per-node 2 -m nbaccel.lessons.demo``),
which sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for each worker; ``Accelerator()`` reads
them, joins the gloo process group and shards the data, with no other code change.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from nbaccel import Accelerator, set_seed
from nbaccel.lessons import MLP, make_spirals


def main(epochs: int = 8) -> float:
    set_seed(0)  # same initial weights on every rank (DDP would broadcast rank 0's anyway)
    accelerator = Accelerator(gradient_accumulation_steps=2, live=False)  # it prints its own
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(make_spirals(2048), batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(
        f"{accelerator.num_processes} workers on {accelerator.device}, "
        f"{len(loader)} batches of {loader.batch_size} per worker per epoch"
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        total = torch.zeros((), device=accelerator.device)
        for inputs, labels in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(inputs), labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach()
        mean = accelerator.reduce(total / len(loader), reduction="mean").item()
        accelerator.print(f"epoch {epoch}: loss {mean:.4f}")
    accelerator.end_training()
    return mean


if __name__ == "__main__":
    main()
