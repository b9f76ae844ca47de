"""What every experiment tracker is, in Accelerate's names: ``GeneralTracker``, the names
``log_with`` takes (``LoggerType``), and ``on_main_process`` for trackers written for Accelerate.

Your own tracker: subclass ``GeneralTracker`` and pass an instance to ``log_with``, or register
the class by its ``name`` (``registry.register_tracker_class``) and pass the name.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from ...env import DistEnv


class LoggerType(str, enum.Enum):
    """The trackers ``log_with`` names (Accelerate's enum; its members equal the strings).

    nbaccel has the first four; the others are Accelerate's names for trackers nbaccel does
    not have, kept so that ported code reaches ``Accelerator(log_with=...)``, which says so."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    WANDB = "wandb"
    AIM = "aim"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"

    @classmethod
    def list(cls) -> list[str]:
        """Every member's value (Accelerate's enums have this)."""
        return [member.value for member in cls]


def on_main_process(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a tracker's method on the main process only (unless its ``main_process_only`` is
    False): Accelerate's decorator of this name, for trackers written for it."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "main_process_only", True) or DistEnv.from_environ().rank == 0:
            return method(self, *args, **kwargs)
        return None

    return wrapper


class GeneralTracker:
    """What every tracker does; subclass it for your own (every method may be left as is)."""

    name = "general"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:  # Accelerate's signature
        pass

    def start(self) -> None:
        """Open the writer or run (``init_trackers`` calls it, on the main process): the
        constructor only keeps its arguments, so a tracker made early touches nothing."""

    @property
    def tracker(self) -> Any:
        """The library's own object (``get_tracker(name, unwrap=True)`` returns it)."""
        return None

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters, once, at ``init_trackers``."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def flush(self) -> None:
        """Write what ``log`` has kept back (the built-in trackers write once a second)."""

    def finish(self) -> None:
        """Write what is left and close (``end_training`` calls it)."""


def installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
