"""Synthetic datasets, generated from a seed so every rank and every run sees the same data."""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset


def make_spirals(
    n: int = 1024, classes: int = 3, noise: float = 0.15, seed: int = 0
) -> TensorDataset:
    """``n`` 2-D points on ``classes`` interleaved spiral arms; labels are the arm index.

    Not linearly separable, so a small MLP has something to learn for a few hundred steps.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    radius = torch.rand(n, generator=g)
    angle = 4.0 * radius + labels * (2 * math.pi / classes)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    points += noise * radius[:, None] * torch.randn(n, 2, generator=g)
    return TensorDataset(points.float(), labels)
