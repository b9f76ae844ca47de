"""The Accelerator's trackers: which ones ``log_with`` asks for (checked when the Accelerator is
made), started by ``init_trackers`` and written to by ``log``. The trackers themselves are in
``general`` (your own), ``builtin`` (TensorBoard, MLflow, wandb), and ``registry`` says which
class each name makes.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Mapping
from typing import Any

from .general import GeneralTracker, installed
from .registry import BUILT_IN, LOGGER_TYPE_TO_CLASS, NOT_IN_NBACCEL, refusal


def resolve(log_with: Any, logging_dir: str | os.PathLike | None) -> dict[str | int, Any]:
    """The trackers ``log_with`` asks for, each once, in the order asked: a name with the class
    it makes (checked: installed, a folder where one is needed), and an object as given (keyed
    by its id). Raised here, when the Accelerator is made."""
    if log_with is None:
        return {}
    asked = list(log_with) if isinstance(log_with, list | tuple) else [log_with]
    chosen: dict[str | int, Any] = {}
    for item in asked:
        if _is_tracker(item):
            chosen.setdefault(id(item), item)
            continue
        name = item.value if isinstance(item, enum.Enum) else item  # Accelerate's LoggerType too
        if name == "all":
            # Accelerate's "all": the built-in trackers whose library is here (not the classes
            # registered by name, which "all" leaves out there too)
            found = [c for c, (module, _) in BUILT_IN.items() if installed(module)]
            if not found:
                raise ImportError(f'log_with="all" found no tracker installed. {_install()}')
            for kind in found:  # the class now registered under its name, if you replaced it
                chosen.setdefault(kind.name, LOGGER_TYPE_TO_CLASS.get(kind.name, kind))
            continue
        if isinstance(name, str) and name not in LOGGER_TYPE_TO_CLASS and name in NOT_IN_NBACCEL:
            raise ValueError(refusal(name))
        if not isinstance(name, str) or name not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(
                f"log_with={item!r}: the trackers are "
                f"{', '.join(map(repr, LOGGER_TYPE_TO_CLASS))}, 'all', a GeneralTracker object "
                "of your own, or the name of a class given to register_tracker_class."
            )
        kind = LOGGER_TYPE_TO_CLASS[name]
        if not _installed(kind):
            module, packages = BUILT_IN[kind]
            raise ImportError(
                f'log_with="{name}" needs the {module} package, which is not installed here. '
                f"{_install(packages)}"
            )
        chosen.setdefault(name, kind)
    for name, kind in chosen.items():
        if isinstance(name, str) and kind.requires_logging_directory and not logging_dir:
            raise ValueError(
                f"Logging with `{name}` requires a `logging_dir`, a folder for its files: give "
                f'the Accelerator one, e.g. Accelerator(log_with="{name}", project_dir="runs") '
                "(or project_config=ProjectConfiguration(logging_dir=...))."
            )
    return chosen


class Trackers:
    """One Accelerator's trackers: checked when it is made, started by ``init_trackers``."""

    def __init__(self, log_with: Any, logging_dir: str | os.PathLike | None) -> None:
        self._chosen = resolve(log_with, logging_dir)
        self.chosen = list(self._chosen.values())
        self.logging_dir, self.is_main = logging_dir, True
        self.started: list[GeneralTracker] = []

    def start(
        self,
        project_name: str,
        config: dict[str, Any] | None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None,
        is_main: bool,
    ) -> None:
        """Make the named trackers, then ``start()`` each (Accelerate's deferred start), then
        give them ``config``."""
        self.finish()  # a second init_trackers starts new runs
        init_kwargs, self.is_main = init_kwargs or {}, is_main
        for name, item in self._chosen.items():
            if getattr(item, "main_process_only", True) and not is_main:
                continue
            if not isinstance(name, str):  # made by the user, on every rank
                if hasattr(item, "in_nbaccel"):  # LiveTracker: this Accelerator draws already
                    item.in_nbaccel = True
                self.started.append(item)
            else:
                kwargs = dict(init_kwargs.get(name, {}))
                if item.requires_logging_directory or item in BUILT_IN:
                    self.started.append(item(project_name, self.logging_dir, **kwargs))
                else:
                    self.started.append(item(project_name, **kwargs))
        for tracker in self.started:
            if callable(start := getattr(tracker, "start", None)):  # none before Accelerate 1.0
                start()
        if config is not None:
            for tracker in self.started:
                tracker.store_init_configuration(dict(config))

    def log(
        self, values: Mapping[str, Any], step: int, log_kwargs: Mapping[str, Any] | None
    ) -> None:
        for tracker in self.started:
            tracker.log(values, step=step, **dict((log_kwargs or {}).get(tracker.name, {})))

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


def _installed(kind: type[Any]) -> bool:
    """Whether ``kind``'s library is importable (a class of your own needs none)."""
    return kind not in BUILT_IN or installed(BUILT_IN[kind][0])


def _install(packages: str = "") -> str:
    extra = f" (or only this one: {sys.executable} -m pip install {packages})" if packages else ""
    return f'Install the trackers with: {sys.executable} -m pip install "nbaccel[trackers]"{extra}'
