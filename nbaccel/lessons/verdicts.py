"""Verdicts a lesson prints beside its measurements, in words the measured values choose.

A lesson's prose says what to look for; the cell that measures says what it saw. Here: a flag
for two runs of one model whose per-rank throughputs disagree by more than sharing the cores
explains, so a speed-up read from them is not taken for the model's before its cause is known
(a spoiled run, or steps that are mostly communication).
"""

from __future__ import annotations

#: Two runs of one model whose per-rank throughputs differ by more than this factor are flagged:
#: splitting the same cores among more processes does not explain it.
SPREAD_LIMIT = 3.0


def rate_spread(runs: dict[str, tuple[float | None, int]], limit: float = SPREAD_LIMIT) -> str:
    """Print and return the verdict on runs of one model: ``{label: (samples/s, ranks)}``.

    Each run's throughput is divided by its ranks (what one process did). When the fastest and
    the slowest per-rank figures differ by more than ``limit``, the line starts ``FLAGGED`` and
    names the two runs; a run without a throughput (too short to time) is named and left out.
    """
    if limit <= 1:
        raise ValueError(f"limit={limit}: a factor above 1 (the default is {SPREAD_LIMIT})")
    per_rank = {}
    for label, (rate, ranks) in runs.items():
        if ranks < 1:
            raise ValueError(f"{label!r}: ranks={ranks}; a run has at least 1 rank")
        if rate is not None and rate > 0:
            per_rank[label] = rate / ranks
    untimed = [label for label in runs if label not in per_rank]
    note = f" ({', '.join(untimed)}: too short to time, left out)" if untimed else ""
    if len(per_rank) < 2:
        line = f"per-rank throughput: fewer than 2 timed runs to compare{note}"
        print(line)
        return line
    slow = min(per_rank, key=per_rank.get)
    fast = max(per_rank, key=per_rank.get)
    factor = per_rank[fast] / per_rank[slow]
    figures = ", ".join(f"{label} {value:,.0f}" for label, value in per_rank.items())
    if factor > limit:
        line = (
            f"FLAGGED: per-rank throughput of one model differs {factor:.1f}x (more than "
            f"{limit:g}x) between {slow!r} ({per_rank[slow]:,.0f} samples/s a rank) and "
            f"{fast!r} ({per_rank[fast]:,.0f}): more than sharing the cores explains. Either "
            "the machine was not the same for both (another program, a first call's warm-up) "
            "or communication takes most of each step of the slower one (its time breakdown "
            f"says which); read no speed-up from this pair until you know which{note}."
        )
    else:
        line = (
            f"per-rank throughput of one model ({figures} samples/s a rank): within "
            f"{factor:.1f}x of each other, under the {limit:g}x that would flag a spoiled "
            f"run{note}"
        )
    print(line)
    return line
