"""What ``Accelerator.log`` does with a loop's numbers: where each kind of value goes.

The method itself, with ``init_trackers``, ``get_tracker`` and ``total_steps``, is in
``accelerator.py``; it hands this module the two places numbers go by name. Numbers go to the
live view on every rank (the ``recorder``, ``observe/rank_recorder.py``) and to the experiment
trackers that ``log_with`` chose on the main process (``observe/trackers/``). Nothing here
knows the Accelerator, so nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..observe.rank_recorder import Recorder
    from ..observe.trackers.log_with import Trackers


def log(
    recorder: Recorder,
    trackers: Trackers,
    values: Mapping[str, Any],
    step: int | None,
    log_kwargs: dict | None,
    steps_before: int,
) -> None:
    """Numbers to ``recorder``; those and the strings and mappings (TensorBoard text, say) to
    ``trackers``, at ``step`` or the optimizer steps taken, counting the ``steps_before`` of
    the run this one resumed. The trackers get the values as given (an int stays an int, as
    in Accelerate), one-number tensors as Python numbers."""
    if not trackers.chosen:
        recorder.log(values, step)
        return
    plain = {k: _number(v) for k, v in values.items()}
    other = {k for k, v in plain.items() if isinstance(v, str | Mapping)}  # the trackers' only
    recorder.log({k: v for k, v in plain.items() if k not in other}, step)
    steps = steps_before + recorder.optimizer_steps
    trackers.log(plain, steps if step is None else step, log_kwargs)


def _number(value: Any) -> Any:
    """A one-number tensor as its Python number (read once, for both places); else as it is."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        return value.item()
    return value
