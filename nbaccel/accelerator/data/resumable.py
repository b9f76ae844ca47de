"""Loaders built on torchdata's ``StatefulDataLoader`` (``use_stateful_dataloader=True``), as
Accelerate builds them: the loader's ``state_dict()`` is the StatefulDataLoader's, taken when
the batch last yielded was read (the prepared loader reads one batch ahead, which the state
must not count), and after ``load_state_dict`` the next pass goes on where that one stopped.

torchdata is an optional dependency (the ``stateful`` extra): it is imported only when a
stateful loader is asked for, and its absence is said plainly then.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler


def stateful_loader_class() -> type:
    """torchdata's ``StatefulDataLoader``, or a clear error saying how to install it."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as err:
        raise ImportError(
            "use_stateful_dataloader=True builds the DataLoader on torchdata's "
            "StatefulDataLoader, and torchdata is not installed (or too old: it needs 0.8 or "
            f"newer): {err}. Install it with: pip install 'nbaccel[stateful]'"
        ) from err
    return StatefulDataLoader


def is_stateful(loader: Any) -> bool:
    """Is ``loader`` a StatefulDataLoader? (Never imports torchdata to answer.)"""
    module = sys.modules.get("torchdata.stateful_dataloader")
    kind = getattr(module, "StatefulDataLoader", None)
    return kind is not None and isinstance(loader, kind)


def as_stateful(loader: Any, workers: dict[str, Any]) -> Any:
    """``loader`` rebuilt as a StatefulDataLoader over the same data and batches, loading as
    ``workers`` says (``loader.workers_of(loader)``).

    The default samplers are left for the StatefulDataLoader to make (its own are stateful:
    a shuffle resumes in the order it had); a custom sampler or batch sampler is kept, and
    resuming replays it from its start, skipping what was read.
    """
    kind = stateful_loader_class()
    if isinstance(loader, kind):
        return loader
    where: dict[str, Any] = {}
    if isinstance(loader.dataset, IterableDataset):
        where = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    elif loader.batch_sampler is None:
        where = {"sampler": loader.sampler, "batch_size": None}
    elif type(loader.batch_sampler) is BatchSampler:
        where = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
        sampler = loader.sampler
        if type(sampler) is RandomSampler and not sampler.replacement and sampler.generator is None:
            where["shuffle"] = True
        elif type(sampler) is not SequentialSampler:
            where["sampler"] = sampler
    else:
        where = {"batch_sampler": loader.batch_sampler}
    return kind(loader.dataset, **where, **workers)


class StatefulState:
    """A StatefulDataLoader's state as of the batch last yielded (``current``)."""

    def __init__(self, loader: Any) -> None:
        self.current: dict[str, Any] = loader.state_dict()

    def snapshot(self, loader: Any, finished: bool = False) -> None:
        self.current = loader.state_dict()
        if finished:
            self.current["_iterator_finished"] = True

    def load(self, loader: Any, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(
                f"load_state_dict() takes the dict that state_dict() returned, not a "
                f"{type(state).__name__}"
            )
        if "_iterator_finished" not in state:  # every StatefulDataLoader state has it
            raise ValueError(
                "this DataLoader is built on torchdata's StatefulDataLoader "
                "(use_stateful_dataloader=True), but the state given to it is not one: it "
                f"has the keys {sorted(state)} (a checkpoint saved without "
                "use_stateful_dataloader?). Load it with the configuration it was saved with."
            )
        loader.load_state_dict(state)
        self.current = copy.deepcopy(state)


def stateful_state(loader: Any) -> StatefulState | None:
    """The state keeper of a StatefulDataLoader; None for any other loader."""
    return StatefulState(loader) if is_stateful(loader) else None
