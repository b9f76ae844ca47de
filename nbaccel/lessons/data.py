"""The lessons' datasets: shipped with a package or generated from a seed. Nothing downloads."""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset

DIGITS_TEST = 297  # of the 1,797 digits, held out for accuracy; the other 1,500 train


def load_digits(split: str = "train", seed: int = 0) -> TensorDataset:
    """Handwritten digits, 8x8 grey images (UCI optdigits, as scikit-learn ships it).

    Returns ``(image, label)`` pairs: ``image`` is 64 float32 values in [0, 1] (``.view(8, 8)``
    to draw it), ``label`` the digit 0-9. ``split`` is ``"train"`` (1,500), ``"test"`` (297) or
    ``"all"``; the split is a fixed shuffle from ``seed``, the same on every rank and run.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"split={split!r}: use 'train', 'test' or 'all'")
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ImportError(
            "the digits come with scikit-learn: pip install 'nbaccel[notebook]' "
            "(or pip install scikit-learn)"
        ) from None
    digits = sklearn_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    if split != "all":
        order = order[DIGITS_TEST:] if split == "train" else order[:DIGITS_TEST]
    return TensorDataset(images[order], labels[order])


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
