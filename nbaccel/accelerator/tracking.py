"""The Accelerator's numbers: ``log``, ``init_trackers``, ``get_tracker``, ``total_steps``.

Each function here is a method of the ``Accelerator``, written in this module as ``saving.py``'s
are: its first argument, ``self``, is the Accelerator, and the class assigns the function to
its name (``log = tracking.log``). Numbers go to the live view on every rank (the Accelerator's
``recorder``, ``observe/rank_recorder.py``) and to the experiment trackers that ``log_with``
chose on the main process (``observe/trackers/``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .accelerator import Accelerator


def log(
    self: Accelerator,
    values: Mapping[str, Any],
    step: int | None = None,
    log_kwargs: dict | None = None,
) -> None:
    """Send numbers (floats, ints, 0-d tensors) to the live view, on every rank, and
    ``values`` to the trackers ``init_trackers`` started (strings too: TensorBoard text).

    ``step`` defaults, in the live view, to the number of earlier ``log`` calls on this
    rank; in the trackers, to the optimizer steps taken (counted on across ``load_state``).
    ``log_kwargs``: per tracker, ``{"wandb": {...}}``. Never blocks training.
    """
    if not self._trackers.chosen:
        self.recorder.log(values, step)
        return
    other = {k: v for k, v in values.items() if isinstance(v, str | Mapping)}  # trackers'
    numbers = self.recorder.log({k: v for k, v in values.items() if k not in other}, step)
    steps = self._steps_before + self.recorder.optimizer_steps
    self._trackers.log({**numbers, **other}, steps if step is None else step, log_kwargs)


def init_trackers(
    self: Accelerator,
    project_name: str,
    config: dict | None = None,
    init_kwargs: dict | None = None,
) -> None:
    """Start the ``log_with`` trackers for a run named ``project_name`` (on the main
    process), recording ``config``, the hyperparameters; ``init_kwargs`` go to each
    library, e.g. ``{"wandb": {"entity": "me"}}``. Every rank may call it."""
    self._trackers.start(project_name, config, init_kwargs, self.is_main_process)


def get_tracker(self: Accelerator, name: str, unwrap: bool = False) -> Any:
    """The started tracker ``name`` (``unwrap``: the library's own object: the
    SummaryWriter, the MlflowClient, the wandb run); on other ranks one that does nothing."""
    return self._trackers.get(name, unwrap)


def get_total_steps(self: Accelerator) -> int | None:
    """The batches the loop will take (e.g. ``epochs * len(loader)``): the progress line's
    total and ETA, counted as its steps are (batches; ``/ K`` if only optimizer steps log)."""
    return self._total_steps


def set_total_steps(self: Accelerator, value: int) -> None:
    self.recorder.accumulation = self.gradient_accumulation_steps
    self._total_steps = self.recorder.total_steps = value
