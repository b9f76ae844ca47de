"""The straggler rule: the rank the others consistently wait for, and why (``Run.straggler``
applies it to a whole run and to its last seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: A straggler: the others spend at least this share of their loop communicating,
WAITING_SHARE = 0.15
#: and the straggler at most this fraction of the least of theirs.
CLEARLY_BELOW = 0.5


@dataclass(frozen=True)
class Straggler:
    """The rank the others consistently wait for (``Run.straggler``).

    ``cause``: what makes it slow, the part of its loop that exceeds the others' most.
    ``waited``: the seconds each other rank spent waiting for it, on average: their mean
    communication beyond the straggler's own.
    """

    rank: int
    cause: Literal["data", "compute"]
    waited: float


def find_straggler(breakdown: dict[int, dict[str, float]]) -> Straggler | None:
    """``Run.straggler``'s rule applied to one breakdown (``{rank: parts}``); None when no
    rank stands out."""
    shares = {
        rank: parts["communication"] / total
        for rank, parts in breakdown.items()
        if (total := sum(parts.values())) > 0
    }
    if len(shares) < 2:
        return None
    rank = min(shares, key=shares.__getitem__)
    others = [r for r in shares if r != rank]
    least = min(shares[r] for r in others)
    if least < WAITING_SHARE or shares[rank] > CLEARLY_BELOW * least:
        return None
    mine = breakdown[rank]

    def excess(part: str) -> float:
        return mine[part] - sum(breakdown[r][part] for r in others) / len(others)

    cause = max(("data", "compute"), key=excess)
    if excess(cause) <= 0:
        return None  # slow elsewhere (evaluation, logging): not in data or compute
    mean_wait = sum(breakdown[r]["communication"] for r in others) / len(others)
    return Straggler(rank, cause, max(mean_wait - mine["communication"], 0.0))  # type: ignore[arg-type]
