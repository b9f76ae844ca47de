"""Which tracker each ``log_with`` name makes, in Accelerate's names.

``LOGGER_TYPE_TO_CLASS`` maps a name to its tracker class: nbaccel's own three, and those you
add with ``register_tracker_class``::

    class MyTracker(GeneralTracker):
        name = "my_tracker"
        requires_logging_directory = False  # True: made as MyTracker(project, logging_dir)
        ...

    register_tracker_class(MyTracker)          # before the Accelerator is made
    accelerator = Accelerator(log_with="my_tracker")
    accelerator.init_trackers("project")       # MyTracker("project", **init_kwargs["my_tracker"])

``NOT_IN_NBACCEL`` names Accelerate's trackers that nbaccel has not; ``log_with`` refuses them
with the reason (``refusal``).
"""

from __future__ import annotations

import warnings
from typing import Any

from .builtin import MLflowTracker, TensorBoardTracker, WandBTracker
from .general import GeneralTracker

# name -> tracker class; register_tracker_class adds to it (Accelerate's registry, by its name)
LOGGER_TYPE_TO_CLASS: dict[str, type[Any]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandBTracker,
}

# nbaccel's own trackers: (the module that must be importable, what to install). These are
# also given the logging folder when they do not require one (their default place to write).
BUILT_IN: dict[type[Any], tuple[str, str]] = {
    TensorBoardTracker: ("tensorboard", "tensorboard"),
    MLflowTracker: ("mlflow", "mlflow-skinny sqlalchemy alembic"),
    WandBTracker: ("wandb", "wandb"),
}

# Accelerate's trackers that nbaccel has not: name -> the library's own name
NOT_IN_NBACCEL = {
    "aim": "Aim",
    "comet_ml": "Comet ML",
    "clearml": "ClearML",
    "dvclive": "DVCLive",
    "swanlab": "SwanLab",
    "trackio": "Trackio",
}


def register_tracker_class(tracker_class: type[Any]) -> None:
    """Let ``log_with`` name ``tracker_class`` by its ``name`` (Accelerate's function).

    The class must subclass ``GeneralTracker`` and set ``name`` and
    ``requires_logging_directory`` itself. ``init_trackers(project_name, init_kwargs=...)``
    makes it as ``tracker_class(project_name, **init_kwargs[name])``, with the logging folder
    second when ``requires_logging_directory`` is True. A name already taken (one of nbaccel's
    own included) is taken over, with a warning.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(
            f"register_tracker_class({tracker_class!r}): it takes a class that subclasses "
            "nbaccel.GeneralTracker (the class itself, not an instance of it)."
        )
    name = _own(tracker_class, "name")
    if not isinstance(name, str) or not name or name == "all":
        raise ValueError(
            f"register_tracker_class({tracker_class.__name__}): the class needs a `name` of its "
            f"own, a non-empty string other than 'all' (got {name!r}): log_with names it by it."
        )
    if _own(tracker_class, "requires_logging_directory") is None:
        raise ValueError(
            f"register_tracker_class({tracker_class.__name__}): set the class attribute "
            "`requires_logging_directory`: True if the tracker needs the Accelerator's logging "
            "folder (it is then given it as its second argument), else False."
        )
    if name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(
            f"register_tracker_class: the tracker name {name!r} was taken by "
            f"{LOGGER_TYPE_TO_CLASS[name].__qualname__}; log_with={name!r} now makes "
            f"{tracker_class.__qualname__} instead.",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_class


def refusal(name: str) -> str:
    """Why ``log_with=name`` is refused, for one of ``NOT_IN_NBACCEL``."""
    return (
        f'log_with="{name}": nbaccel has no {NOT_IN_NBACCEL[name]} tracker; it ships '
        "TensorBoard, MLflow and wandb only, each tested against what its library wrote. "
        f"Use one of {', '.join(map(repr, LOGGER_TYPE_TO_CLASS))}, 'all', or write a "
        f"GeneralTracker for {NOT_IN_NBACCEL[name]} and pass an instance, or "
        f'register_tracker_class(it) with name = "{name}".'
    )


def _own(tracker_class: type[Any], attribute: str) -> Any:
    """``attribute`` as the class or a base below ``GeneralTracker`` sets it, else None
    (``GeneralTracker``'s defaults do not count: Accelerate's base class has none)."""
    for klass in tracker_class.__mro__:
        if klass is GeneralTracker:
            return None
        if attribute in vars(klass):
            return vars(klass)[attribute]
    return None
