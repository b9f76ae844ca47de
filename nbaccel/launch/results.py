"""What comes back from a launch's workers: their values, unpickled here one rank at a time.

A value pickles in the worker but may not unpickle here: a prepared model asks for the process
group, which only the workers have; a class may live in a module this process cannot import.
So each rank's value is rebuilt on its own, and only the values the call returns can fail it: one
that cannot be rebuilt is a ``LaunchError`` that names its rank and type (read in the worker, see
``protocol.type_name``), says what to return instead, and keeps the values that did come back.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .. import errors
from ..errors import RETURN_INSTEAD, RankFailure

logger = logging.getLogger(__name__)


def collect(ranks: list, return_all: bool, run) -> list[Any]:
    """The values the call returns: rank 0's, or each local rank's with ``return_all``.

    ``ranks``: each with ``rank``, ``pid`` and ``result`` (a ``protocol.Result``): an
    attempt's ``verdict.RankFacts``, or a SLURM job's. Every value that can be rebuilt goes to
    ``run.results``; one of a rank the call does not return that cannot is left out, with a
    warning in the log.
    """
    import cloudpickle

    returned = ranks if return_all else ranks[:1]
    values, lost = {}, []
    for r in ranks:
        try:
            values[r.rank] = cloudpickle.loads(r.result.value)
        except Exception as err:
            failure = _unreturnable(r.rank, r.pid, r.result.type, err)
            if any(r is x for x in returned):
                lost.append(failure)
            else:
                logger.warning("%s run.results leaves it out.", failure.message)
    run.results = values
    exited = [r.rank for r in ranks if r.result.exited]
    if exited and len(exited) < len(ranks):  # a rank that stopped early, on purpose or not
        who = ", ".join(map(str, exited))
        print(
            f"nbaccel: rank {who} left through sys.exit(0) while the others returned; the value "
            "is None there.",
            file=sys.stderr,
            flush=True,
        )
    if lost:
        run.failures = lost
        raise errors.LaunchError(_report(lost, values), lost, run, results=values)
    return [values[r.rank] for r in returned]


def _unreturnable(rank: int, pid: int | None, what: str, err: Exception) -> RankFailure:
    why = f"{type(err).__qualname__}: {err}"
    message = (
        f"rank {rank} returned a {what or 'value'} that cannot be rebuilt in this process "
        f"({why}); {RETURN_INSTEAD}."
    )
    return RankFailure(rank, pid, 0, type(err).__qualname__, message)


def _report(lost: list[RankFailure], values: dict[int, Any]) -> str:
    kept = (
        f"The values that did come back, of ranks {sorted(values)}, are on this error's "
        "`.results` ({rank: value})."
        if values
        else "No value came back."
    )
    return "\n".join([*(f.message for f in lost), f"Every rank finished. {kept}"])
