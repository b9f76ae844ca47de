"""Small models and datasets the lessons share. Everything is generated: nothing downloads."""

from .data import make_spirals
from .models import MLP

__all__ = ["MLP", "make_spirals"]
