"""Logging from several processes: Accelerate's ``get_logger``, under its name.

``get_logger(__name__)`` gives a ``logging.LoggerAdapter`` whose calls take two more keywords:
``main_process_only`` (default True: only rank 0 logs) and ``in_order`` (every rank logs, one
after the other, rank 0 first). Each message starts with ``[RANK i]``.

One difference, on purpose: Accelerate's logger raises unless its process-wide state exists
(``PartialState()`` or an ``Accelerator``) before the first message. nbaccel keeps no such
state: the rank comes from the launcher's variables (as ``PartialState`` reads it), so a logger
works before any Accelerator exists. Only ``in_order=True`` with several processes needs the
process group (for its barriers), and says so when there is none.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from ..env import DistEnv

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger for several processes: by default only rank 0 logs (``main_process_only=False``
    logs on every rank, ``in_order=True`` on every rank in rank order)."""

    def __init__(self, logger: logging.Logger, extra: Any = None) -> None:
        super().__init__(logger, extra or {})
        self._warned: set[Any] = set()  # warning_once's messages, per logger

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        # the record names the caller of info()/warning(), not this module (a stacklevel the
        # caller chose is kept)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {DistEnv.from_environ().rank}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log on rank 0 only, or with ``main_process_only=False`` on every rank; with
        ``in_order=True`` every rank logs, one after the other (``main_process_only`` is then
        ignored; every rank must make the call, since it waits for all of them)."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        env = DistEnv.from_environ()
        msg, kwargs = self.process(msg, kwargs)
        if not in_order:
            if not main_process_only or env.rank == 0:
                self.logger.log(level, msg, *args, **kwargs)
            return
        if env.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "logger.log(..., in_order=True) makes the ranks take turns, which needs the "
                "process group, and this process has none yet. Create the Accelerator (or a "
                "PartialState) first, or log without in_order."
            )
        for rank in range(env.world_size):
            if rank == env.rank:
                self.logger.log(level, msg, *args, **kwargs)
            if env.world_size > 1:
                dist.barrier()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning``, but a message this logger gave already is not given again."""
        key = (args, tuple(sorted(kwargs.items())))
        kwargs.setdefault("stacklevel", 3)  # the record names the caller of warning_once
        try:
            if key in self._warned:
                return
            self._warned.add(key)
        except TypeError:  # unhashable arguments: no way to tell, so it is given
            pass
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger ``name`` (``logging.getLogger(name)``) for several processes.

    ``log_level`` (``"INFO"``, ``"debug"``, ...), else the variable ``ACCELERATE_LOG_LEVEL``
    where set, becomes the level of this logger and of the root logger; else both keep theirs.
    """
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
