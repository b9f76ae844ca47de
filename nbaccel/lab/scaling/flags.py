"""When a scaling measurement is not a result: the thresholds, and the flags that say why.

A flag is a sentence with the measured number and the threshold it crossed, e.g.
``"busy: other processes kept 0.62 cores busy (median of 3 launches; threshold 0.25)"``. Its
words before the colon are its short name, which the figure writes beside a spoiled point.

The thresholds, and why these values (``THRESHOLDS``; a ``Scaling`` keeps the ones it used):

* ``other_cores`` 0.25: an idle machine measures a few hundredths of a core (the kernel, the
  notebook's server); a quarter of a core is a quarter of one worker's time on a machine whose
  cores all train, enough to move a 2-process efficiency by more than 10 %.
* ``spread`` 0.2: the repeats of one count on a quiet machine agree within a few percent; when
  the slowest and the fastest differ by a fifth of the median, the machine changed under them.
* ``baseline_slow`` 0.15: with equal threads, a lone worker does per sample what each worker of
  a larger count does, minus the communication, and no faster than it alone; 15 % slower than
  them is beyond the jitter of a per-sample time from seconds of loop, so it was slowed down.
* ``efficiency`` 1.05: above 1 is impossible at equal threads per worker (the workers of a
  larger count do the same work per sample, and communicate too); 5 % is the noise allowed.
* ``training_s`` 0.25: the progress line's least training window for a throughput
  (``observe.channel.MIN_WINDOW_S``, one counter interval); a shorter run's number says more
  about one hiccup of the machine than about the run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from ...observe.channel import MIN_WINDOW_S

THRESHOLDS: Mapping[str, float] = MappingProxyType(
    {
        "other_cores": 0.25,
        "spread": 0.2,
        "baseline_slow": 0.15,
        "efficiency": 1.05,
        "training_s": MIN_WINDOW_S,
    }
)

IMPOSSIBLE_CPU = (
    "efficiency above 1 with equal threads per worker is impossible on a CPU beyond noise; "
    "rerun on an idle machine"
)
IMPOSSIBLE_GPU = (
    "efficiency above 1 with one GPU per process means the 1-process run was held back "
    "(warm-up, clocks, another job on its GPU) or the work per process differs; rerun with the "
    "GPUs to yourself"
)


def spread(values: Sequence[float]) -> float:
    """(max - min) / median; NaN for fewer than two values (nothing to compare) or a median
    of 0."""
    if len(values) < 2:
        return math.nan
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else math.nan


def too_short(training_s: float, limit: float) -> str | None:
    """The run the row shows trained for less than ``limit`` seconds."""
    if training_s >= limit:
        return None
    return (
        f"too short: a training window of {training_s:.2f} s (at least {limit:.2f} s); "
        "train longer (more epochs or a larger SIZE)"
    )


def short(flag: str) -> str:
    """A flag's short name: its words before the colon ("busy", "wide spread", ...)."""
    return flag.split(":", 1)[0]


def busy(other_cores: Sequence[float], shown: int, limit: float) -> str | None:
    """Other processes kept more than ``limit`` cores busy, in the median of a count's launches
    (most of them were disturbed) or in launch ``shown``, the one whose numbers the row shows."""
    if not other_cores:
        return None  # not measured
    middle = statistics.median(other_cores)
    if other_cores[shown] > max(middle, limit):
        which, cores = "in the run shown", other_cores[shown]
    elif middle > limit:
        which, cores = f"median of {len(other_cores)} launches", middle
    else:
        return None
    return f"busy: other processes kept {cores:.2f} cores busy ({which}; threshold {limit:.2f})"


def wide(throughputs: Sequence[float], limit: float) -> str | None:
    """The repeats' samples/s disagree by more than ``limit`` of their median."""
    measured = spread(throughputs)
    if not measured > limit:  # NaN: one repeat, nothing to compare
        return None
    return (
        f"wide spread: the {len(throughputs)} repeats' samples/s differ by {measured:.0%} of "
        f"their median (threshold {limit:.0%})"
    )


def work_per_sample(breakdown: Mapping[int, Mapping[str, float]], samples: Mapping[int, float]):
    """Seconds a rank spends per sample on data, compute and other (all but communication),
    the mean over the ranks; None without a breakdown or samples. At equal threads per worker
    this work is the same at every process count."""
    ranks = [
        (parts["data"] + parts["compute"] + parts["other"]) / samples[rank]
        for rank, parts in breakdown.items()
        if samples.get(rank, 0) > 0
    ]
    return sum(ranks) / len(ranks) if ranks else None


def slow_baseline(
    base: float | None, here: float | None, base_n: int, n: int, limit: float
) -> str | None:
    """The baseline's work per sample (``base``, at ``base_n`` processes) exceeds ``1 + limit``
    times the same work at ``n`` processes (``here``): the lone worker was slowed down."""
    if not base or not here or base <= (1 + limit) * here:
        return None
    return (
        f"slow baseline: the {base_n}-process run took {base / here:.2f} x the time per sample "
        f"of a worker at {n} processes for the same work (data, compute, other; threshold "
        f"{1 + limit:.2f})"
    )


def spoiled_baseline(base_n: int, base_flags: Sequence[str]) -> str | None:
    """The row this efficiency is measured against is flagged itself."""
    if not base_flags:
        return None
    names = ", ".join(short(f) for f in base_flags)
    return f"spoiled baseline: the {base_n}-process row is flagged ({names})"


def above_one(
    efficiency: float, causes: Sequence[str], device: str | None, limit: float
) -> str | None:
    """Efficiency above ``limit``: always flagged, with its cause, the other flags if any."""
    if not efficiency > limit:
        return None
    if causes:
        why = "explained by " + ", ".join(short(c) for c in causes)
    else:
        why = IMPOSSIBLE_GPU if device == "GPU" else IMPOSSIBLE_CPU
    return f"above 1: efficiency {efficiency:.2f} (threshold {limit:.2f}); {why}"
