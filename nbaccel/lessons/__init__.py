"""Models, datasets and measuring tools the lesson notebooks share. Nothing downloads."""

from .data import load_digits, make_spirals
from .models import MLP
from .tools import AllReduceCounter, accuracy, gradient_bytes, machine, needs

__all__ = [
    "MLP",
    "AllReduceCounter",
    "accuracy",
    "gradient_bytes",
    "load_digits",
    "machine",
    "make_spirals",
    "needs",
]
