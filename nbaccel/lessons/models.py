"""Models small enough to train on two CPU cores in seconds."""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    """``in -> hidden -> ... -> out`` with ReLU between layers."""

    def __init__(self, inputs: int = 2, hidden: int = 64, outputs: int = 3, depth: int = 2):
        layers: list[nn.Module] = []
        width = inputs
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, outputs))
        super().__init__(*layers)
