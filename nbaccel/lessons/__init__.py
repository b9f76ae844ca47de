"""Models, datasets and measuring tools the lesson notebooks share. Nothing downloads."""

from . import gpu_figures
from .data import load_digits, make_spirals
from .gpu_figures import gpu_results
from .hf import answer_accelerate_config, deepspeed_accelerator, preload_for_notebook_launcher
from .models import MLP
from .tools import AllReduceCounter, accuracy, gradient_bytes, machine, needs
from .verdicts import rate_spread

__all__ = [
    "MLP",
    "AllReduceCounter",
    "accuracy",
    "answer_accelerate_config",
    "deepspeed_accelerator",
    "gpu_figures",
    "gpu_results",
    "gradient_bytes",
    "load_digits",
    "machine",
    "make_spirals",
    "needs",
    "preload_for_notebook_launcher",
    "rate_spread",
]
