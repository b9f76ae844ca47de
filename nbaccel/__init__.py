"""nbaccel: run distributed PyTorch training from a notebook cell, and see what happens inside.

>>> from nbaccel import Accelerator, notebook_launcher, set_seed

Names are imported on first use, so ``import nbaccel.observe.live`` (or the CLI) does not pay
for torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "accelerator.accelerator",
    "set_seed": "utils",
    "DataLoaderConfiguration": "accelerator.data.sharding",
    "DataLoaderShard": "accelerator.data.adapters",
    "DataLoaderDispatcher": "accelerator.data.adapters",
    "SkipDataLoader": "accelerator.data.adapters",
    "skip_first_batches": "accelerator.data.adapters",
    "DataLoaderStateMixin": "accelerator.data.loader",
    "BatchSamplerShard": "accelerator.data.samplers",
    "SkipBatchSampler": "accelerator.data.samplers",
    "IterableDatasetShard": "accelerator.data.streams",
    "GradientAccumulationPlugin": "accelerator.accumulation",
    "DistributedType": "accelerator.state",
    "PartialState": "accelerator.state",
    "send_to_device": "utils",
    "CheckpointError": "errors",
    "LaunchError": "errors",
    "NbaccelError": "errors",
    "notebook_launcher": "launch.launcher",
    "SlurmCluster": "launch.slurm",
    "Ranks": "launch.session",
    "CellError": "errors",
    "Run": "observe.records",
    "LiveView": "observe.live.view",
    "LiveTracker": "observe.hf.tracker",
    "LiveCallback": "observe.hf.callback",
    "measure_scaling": "lab.scaling",
    "Recorder": "observe.rank_recorder",
    "Tracker": "observe.rank_recorder",  # Recorder's old name
    "FSDPPlugin": "accelerator.strategies.fully_sharded",
    "FullyShardedDataParallelPlugin": "accelerator.strategies.fully_sharded",
    "DeepSpeedPlugin": "accelerator.strategies.ds_config",
    "ProjectConfiguration": "accelerator.project",
    "GeneralTracker": "observe.trackers.general",
    "LoggerType": "observe.trackers.general",
    "TensorBoardTracker": "observe.trackers.builtin",
    "MLflowTracker": "observe.trackers.builtin",
    "WandBTracker": "observe.trackers.builtin",
    "LOGGER_TYPE_TO_CLASS": "observe.trackers.registry",
    "register_tracker_class": "observe.trackers.registry",
    "AcceleratorState": "accelerator.current",
    "GradientState": "accelerator.current",
    "AutocastKwargs": "accelerator.handlers",
    "DDPCommunicationHookType": "accelerator.handlers",
    "DistributedDataParallelKwargs": "accelerator.handlers",
    "GradScalerKwargs": "accelerator.handlers",
    "InitProcessGroupKwargs": "accelerator.handlers",
    "find_executable_batch_size": "accelerator.memory_utils",
}
__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "BatchSamplerShard",
    "CellError",
    "CheckpointError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FSDPPlugin",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "InitProcessGroupKwargs",
    "IterableDatasetShard",
    "LaunchError",
    "LiveCallback",
    "LiveTracker",
    "LiveView",
    "LoggerType",
    "MLflowTracker",
    "NbaccelError",
    "PartialState",
    "ProjectConfiguration",
    "Ranks",
    "Recorder",
    "Run",
    "SkipBatchSampler",
    "SkipDataLoader",
    "SlurmCluster",
    "TensorBoardTracker",
    "Tracker",
    "WandBTracker",
    "find_executable_batch_size",
    "measure_scaling",
    "notebook_launcher",
    "register_tracker_class",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
]

if TYPE_CHECKING:
    from .accelerator.accelerator import Accelerator
    from .accelerator.accumulation import GradientAccumulationPlugin
    from .accelerator.current import AcceleratorState, GradientState
    from .accelerator.data.adapters import (
        DataLoaderDispatcher,
        DataLoaderShard,
        SkipDataLoader,
        skip_first_batches,
    )
    from .accelerator.data.loader import DataLoaderStateMixin
    from .accelerator.data.samplers import BatchSamplerShard, SkipBatchSampler
    from .accelerator.data.sharding import DataLoaderConfiguration
    from .accelerator.data.streams import IterableDatasetShard
    from .accelerator.handlers import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
    )
    from .accelerator.memory_utils import find_executable_batch_size
    from .accelerator.project import ProjectConfiguration
    from .accelerator.state import DistributedType, PartialState
    from .accelerator.strategies.ds_config import DeepSpeedPlugin
    from .accelerator.strategies.fully_sharded import FSDPPlugin, FullyShardedDataParallelPlugin
    from .errors import CellError, CheckpointError, LaunchError, NbaccelError
    from .lab.scaling import measure_scaling
    from .launch.launcher import notebook_launcher
    from .launch.session import Ranks
    from .launch.slurm import SlurmCluster
    from .observe.hf.callback import LiveCallback
    from .observe.hf.tracker import LiveTracker
    from .observe.live.view import LiveView
    from .observe.rank_recorder import Recorder, Tracker
    from .observe.records import Run
    from .observe.trackers.builtin import MLflowTracker, TensorBoardTracker, WandBTracker
    from .observe.trackers.general import GeneralTracker, LoggerType
    from .observe.trackers.registry import LOGGER_TYPE_TO_CLASS, register_tracker_class
    from .utils import send_to_device, set_seed


# Modules the lessons use by name: ``from nbaccel import projection``.
_MODULES = {"projection": "lab.projection"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        from .errors import not_ported  # torch-free

        error = not_ported("nbaccel", name)
        if error is not None:  # from nbaccel import init_empty_weights: says why not
            raise error
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_MODULES])


def load_ipython_extension(shell: Any) -> None:
    """``%load_ext nbaccel``: the ``%ranks`` and ``%%ranks`` magics (``nbaccel/magics.py``,
    which nothing in the package imports: it is loaded by name, as IPython loads this)."""
    importlib.import_module(".magics", __name__).load_ipython_extension(shell)


def unload_ipython_extension(shell: Any) -> None:
    importlib.import_module(".magics", __name__).unload_ipython_extension(shell)


def _prestart_once_bound(*_: Any) -> None:
    """In a Jupyter kernel, after each cell until the launcher is imported (its import starts
    the worker server ahead: ``launch.client.prestart``): once the notebook holds the package
    itself (``import nbaccel``), ``nbaccel.notebook_launcher`` is one attribute away, so the
    launcher is imported now (0.1 s), and its import starts the server, as in ``from nbaccel
    import notebook_launcher``. ``from nbaccel import Accelerator`` alone starts nothing."""
    shell = sys.modules["IPython"].get_ipython()
    launcher = f"{__name__}.launch.launcher" in sys.modules
    package = sys.modules[__name__]
    if launcher or any(value is package for value in list(shell.user_ns.values())):
        shell.events.unregister("post_run_cell", _prestart_once_bound)
        if not launcher:
            importlib.import_module(".launch.launcher", __name__)


if "IPython" in sys.modules:  # a kernel's cells: docs/architecture.md names this exception
    from .env import in_notebook

    if in_notebook():
        sys.modules["IPython"].get_ipython().events.register("post_run_cell", _prestart_once_bound)
