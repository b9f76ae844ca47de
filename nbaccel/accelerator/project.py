"""Where a run keeps its files, and checkpoints that name themselves (Accelerate's names).

    config = ProjectConfiguration("runs/mnist", automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(project_config=config)
    accelerator.save_state()   # runs/mnist/checkpoints/checkpoint_0, _1, ...: the newest 3 kept
    accelerator.load_state()   # the newest complete one

A checkpoint folder is complete once its manifest is in it (``checkpoint.MANIFEST``, written
last, and the folder renamed into place after that), so a save that was killed leaves at most a
hidden staging folder that nothing here loads or counts. The oldest checkpoints are deleted only
after the new one is complete, so ``total_limit`` never leaves a run without one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from .checkpoint import MANIFEST

logger = logging.getLogger(__name__)

_NAME = re.compile(r"checkpoint_(\d+)")


@dataclass
class ProjectConfiguration:
    """Accelerate's ``ProjectConfiguration``: a run's folder and how checkpoints are named.

    ``project_dir``: the run's folder (trackers write there too). ``logging_dir``: the
    trackers' folder, ``project_dir`` when unset. ``automatic_checkpoint_naming``: ``save_state()``
    and ``load_state()`` need no folder (they need a ``project_dir``: here, or
    ``Accelerator(project_dir=...)``). ``total_limit``: keep at most this many checkpoints.
    ``iteration``: the number the next automatic checkpoint takes at least.
    """

    project_dir: str | os.PathLike | None = None
    logging_dir: str | os.PathLike | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and (
            isinstance(self.total_limit, bool)
            or not isinstance(self.total_limit, int)
            or self.total_limit < 1
        ):
            raise ValueError(f"total_limit={self.total_limit!r} must be a whole number >= 1")
        if self.save_on_each_node:
            raise ValueError(
                "save_on_each_node=True is not supported: here the main process (rank 0) writes "
                "every checkpoint, so on several machines give project_dir a folder that all of "
                "them share. Leave save_on_each_node False."
            )

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` with it when it was unset."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    @property
    def checkpoints(self) -> Path:
        """``project_dir/checkpoints``, where automatic checkpoints go."""
        if self.project_dir is None:  # checked when used: Accelerator(project_dir=...) sets it
            raise ValueError(
                "automatic_checkpoint_naming=True needs a project_dir, where the checkpoints "
                'go: Accelerator(project_dir="runs/my_run", project_config=...) or '
                'ProjectConfiguration(project_dir="runs/my_run", automatic_checkpoint_naming=True)'
            )
        return Path(self.project_dir).expanduser() / "checkpoints"


def numbered(folder: Path) -> list[tuple[int, Path]]:
    """``checkpoint_<n>`` folders in ``folder`` by number, complete or not."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def save_folder(config: ProjectConfiguration, path: str | os.PathLike | None) -> Path:
    """The folder ``save_state(path)`` writes: ``path``, or the next automatic one."""
    if path is not None:
        return Path(path).expanduser()
    if not config.automatic_checkpoint_naming:
        raise ValueError(_no_folder("save_state"))
    return next_folder(config)


def load_folder(config: ProjectConfiguration, path: str | os.PathLike | None) -> Path:
    """The folder ``load_state(path)`` reads: ``path``, or the newest complete automatic one."""
    if path is not None:
        return Path(path).expanduser()
    if not config.automatic_checkpoint_naming:
        raise ValueError(_no_folder("load_state"))
    return newest(config)


def _no_folder(method: str) -> str:
    return (
        f"{method}() needs a folder, e.g. accelerator.{method}('checkpoints/epoch_3'), or a "
        "project that names its checkpoints: Accelerator(project_config=ProjectConfiguration("
        "'runs/my_run', automatic_checkpoint_naming=True))."
    )


def next_folder(config: ProjectConfiguration) -> Path:
    """Where the next automatic ``save_state()`` writes: ``checkpoint_<n>`` with ``n`` past
    every existing one and at least ``config.iteration``, so nothing is ever overwritten."""
    config.checkpoints.mkdir(parents=True, exist_ok=True)  # every rank: exist_ok
    existing = numbered(config.checkpoints)
    n = max([config.iteration] + [k + 1 for k, _ in existing])
    return config.checkpoints / f"checkpoint_{n}"


def saved(config: ProjectConfiguration, folder: Path, is_main: bool) -> None:
    """After ``folder`` became a complete checkpoint: count it, and (the main process) delete
    the oldest beyond ``total_limit``: complete ones count, and the new one is never deleted."""
    config.iteration = int(_NAME.fullmatch(folder.name).group(1)) + 1  # type: ignore[union-attr]
    if config.total_limit is None or not is_main:
        return
    complete = [p for _, p in numbered(config.checkpoints) if (p / MANIFEST).is_file()]
    for old in complete[: max(len(complete) - config.total_limit, 0)]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
            logger.info("deleted %s (total_limit=%d)", old, config.total_limit)


def newest(config: ProjectConfiguration) -> Path:
    """The newest complete checkpoint, for ``load_state()`` with no folder."""
    found = numbered(config.checkpoints)
    for _, folder in reversed(found):
        if (folder / MANIFEST).is_file():
            return folder
    raise CheckpointError(
        f"no complete checkpoint in {config.checkpoints} to load"
        + (f" (found {', '.join(p.name for _, p in found)}, none complete)" if found else "")
        + ": call accelerator.save_state() first, or pass load_state() a folder."
    )
