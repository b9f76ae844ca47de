"""The Accelerator's trackers: which ones ``log_with`` asks for (checked when the Accelerator is
made), started by ``init_trackers`` and written to by ``log``. The trackers themselves are in
``general`` (your own) and ``builtin`` (TensorBoard, MLflow, wandb).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from .builtin import MLflowTracker, TensorBoardTracker, WandBTracker
from .general import GeneralTracker, LoggerType, installed

# name -> (class, the module that must be importable, what to install)
BUILT_IN: dict[str, tuple[type[GeneralTracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "tensorboard"),
    "mlflow": (MLflowTracker, "mlflow", "mlflow-skinny sqlalchemy alembic"),
    "wandb": (WandBTracker, "wandb", "wandb"),
}


def resolve(log_with: Any, logging_dir: str | os.PathLike | None) -> list[str | GeneralTracker]:
    """The trackers ``log_with`` asks for: names checked (installed, a folder where one is
    needed) and objects as given. Raised here, when the Accelerator is made."""
    if log_with is None:
        return []
    asked = list(log_with) if isinstance(log_with, list | tuple) else [log_with]
    chosen: list[str | GeneralTracker] = []
    for item in asked:
        if _is_tracker(item):
            chosen.append(item)
            continue
        name = item.value if isinstance(item, LoggerType) else item
        if name == "all":
            found = [n for n, (_, module, _) in BUILT_IN.items() if installed(module)]
            if not found:
                raise ImportError(f'log_with="all" found no tracker installed. {_install()}')
            chosen += found
            continue
        if not isinstance(name, str) or name not in BUILT_IN:
            raise ValueError(
                f"log_with={item!r}: the trackers are {', '.join(map(repr, BUILT_IN))}, 'all', "
                "or an nbaccel.GeneralTracker instance of your own."
            )
        if not installed(BUILT_IN[name][1]):
            raise ImportError(
                f'log_with="{name}" needs the {BUILT_IN[name][1]} package, which is not '
                f"installed here. {_install(BUILT_IN[name][2])}"
            )
        chosen.append(name)
    for name in chosen:
        if (
            isinstance(name, str)
            and BUILT_IN[name][0].requires_logging_directory
            and not logging_dir
        ):
            raise ValueError(
                f'log_with="{name}" writes files: give the Accelerator a folder for them, '
                f'e.g. Accelerator(log_with="{name}", project_dir="runs").'
            )
    return list(dict.fromkeys(chosen))  # each once, in the order asked


class Trackers:
    """One Accelerator's trackers: checked when it is made, started by ``init_trackers``."""

    def __init__(self, log_with: Any, logging_dir: str | os.PathLike | None) -> None:
        self.chosen = resolve(log_with, logging_dir)
        self.logging_dir, self.is_main = logging_dir, True
        self.started: list[GeneralTracker] = []

    def start(
        self,
        project_name: str,
        config: dict[str, Any] | None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None,
        is_main: bool,
    ) -> None:
        self.finish()  # a second init_trackers starts new runs
        init_kwargs, self.is_main = init_kwargs or {}, is_main
        for item in self.chosen:
            kind = item if _is_tracker(item) else BUILT_IN[item][0]
            if getattr(kind, "main_process_only", True) and not is_main:
                continue
            if _is_tracker(item):  # made by the user, on every rank
                if hasattr(item, "in_nbaccel"):  # LiveTracker: this Accelerator draws already
                    item.in_nbaccel = True
                self.started.append(item)
            else:
                kwargs = dict(init_kwargs.get(item, {}))
                self.started.append(kind(project_name, self.logging_dir, **kwargs))
        if config is not None:
            for tracker in self.started:
                tracker.store_init_configuration(dict(config))

    def log(
        self, values: Mapping[str, Any], step: int, log_kwargs: Mapping[str, Any] | None
    ) -> None:
        for tracker in self.started:
            tracker.log(values, step, **dict((log_kwargs or {}).get(tracker.name, {})))

    def get(self, name: str, unwrap: bool) -> Any:
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main:  # nothing is written here: a tracker that does nothing
            return GeneralTracker()
        names = [t.name for t in self.started] or ["none: call init_trackers first"]
        raise ValueError(f"no tracker named {name!r}; started: {', '.join(names)}")

    def flush(self) -> None:
        for tracker in self.started:
            if callable(flush := getattr(tracker, "flush", None)):  # Accelerate's have none
                flush()

    def finish(self) -> None:
        started, self.started = self.started, []
        for tracker in started:
            tracker.finish()


def _is_tracker(item: Any) -> bool:
    """A tracker object: nbaccel's ``GeneralTracker``, or one written for Accelerate's API (its
    own ``GeneralTracker``, nbaccel's ``LiveTracker``), which has the same methods."""
    if isinstance(item, GeneralTracker):
        return True
    methods = ("log", "store_init_configuration", "finish")
    return isinstance(getattr(item, "name", None), str) and all(
        callable(getattr(item, m, None)) for m in methods
    )


def _install(packages: str = "") -> str:
    extra = f" (or only this one: {sys.executable} -m pip install {packages})" if packages else ""
    return f'Install the trackers with: {sys.executable} -m pip install "nbaccel[trackers]"{extra}'
