"""Project data-parallel scaling beyond the machine you have: an explicit, small model.

Three parts, imported one way (the figure needs the model, never the reverse):

* ``model``: the arithmetic, no torch: ``Interconnect`` and its ``PRESETS``, ``project``,
  ``curve``, ``Calibration``; ``check`` (a ``Check`` of a projection against a measured point,
  within ``BOUND``) and ``coinciding`` (links whose curves would hide each other);
* ``calibration``: the torch micro-benchmark, ``calibrate`` and ``calibration_worker``;
* ``view``: the ``figure`` (one curve per group of coinciding links, a check's verdict in its
  title) and the ``whatif`` widget panel.

Every name is importable from here (``from nbaccel import projection``, then
``projection.figure(...)``); the benchmark and the view are imported on first use, so using the
model imports neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .model import (
    BACKWARD_SHARE,
    BOUND,
    GB,
    PRESETS,
    Calibration,
    Check,
    Interconnect,
    Projection,
    check,
    coinciding,
    curve,
    project,
)

_LAZY = {
    "calibrate": "calibration",
    "calibration_worker": "calibration",
    "figure": "view",
    "whatif": "view",
}
__all__ = [
    "BACKWARD_SHARE",
    "BOUND",
    "GB",
    "PRESETS",
    "Calibration",
    "Check",
    "Interconnect",
    "Projection",
    "calibrate",
    "calibration_worker",
    "check",
    "coinciding",
    "curve",
    "figure",
    "project",
    "whatif",
]

if TYPE_CHECKING:
    from .calibration import calibrate, calibration_worker
    from .view import figure, whatif


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'nbaccel.lab.projection' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
