"""Launch one function at several process counts, at equal threads, repeated and interleaved."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ...observe.records import Run
from .contention import Load
from .result import Scaling


def measure_scaling(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    counts: Sequence[int] | None = None,
    *,
    threads: int | None = None,
    repeats: int = 3,
    **launch: Any,
) -> Scaling:
    """Launch ``function`` ``repeats`` times at each process count (default: 1 and 2 on a CPU,
    1..N on N GPUs), and judge whether the machine let the numbers be results.

    * Every count runs in worker processes, one process included, so they compare alike.
    * Every worker gets ``threads`` torch threads at every count (default: the cores / the
      largest count, or ``OMP_NUM_THREADS`` if you set it), so a larger count adds workers,
      not threads: a lone worker with all the cores' threads is another experiment, and on a
      busy machine its threads can fight each other. ``OMP_NUM_THREADS`` is set for each launch
      (the launcher reads it) and put back as it was afterwards, even when a launch fails.
    * The launches go in turn, 1, 2, 1, 2, 1, 2: a slow minute of the machine hits every count
      alike, not one. Each count's throughput is the median of its repeats; its spread,
      (max - min) / median, says how far they agree.
    * During each launch a ``Load`` meter measures the cores other processes kept busy.
    * A row is flagged, its number shown but marked as not a result, when other processes kept
      more than 0.25 cores busy (``THRESHOLDS["other_cores"]``; in the median of its launches,
      or in the one it shows), it trained for under 0.25 s (``"training_s"``), its spread
      exceeds 20 % (``"spread"``), its baseline is flagged
      or took more than 1.15 x the time per sample of a worker at this count for the same work
      (``"baseline_slow"``), and always when its efficiency exceeds 1.05 (``"efficiency"``),
      which equal threads make impossible beyond noise. Why these values: an idle machine
      measures a few hundredths of a core, and repeats on it agree within a few percent
      (``flags.py`` gives each reason).

    Other keyword arguments go to ``notebook_launcher`` (``cpu``, ``mixed_precision``,
    ``live``, ...).

    >>> result = measure_scaling(train, counts=(1, 2), cpu=True)  # doctest: +SKIP
    >>> result.trusted, result.flags()  # doctest: +SKIP
    (True, [])
    """
    from ...env import threads_per_worker, visible_gpus
    from ...launch.launcher import notebook_launcher

    if counts is None:  # one GPU: one process (a second would need a second GPU, or cpu=True)
        gpus = 0 if launch.get("cpu") else visible_gpus()
        counts = range(1, gpus + 1) if gpus else (1, 2)
    counts = list(counts)
    if not counts or any(not _positive(n) for n in counts):
        raise ValueError(f"counts={counts!r} must be positive ints, e.g. counts=(1, 2)")
    if not _positive(repeats):
        raise ValueError(f"repeats={repeats!r} must be a positive int, e.g. repeats=3")
    if threads is not None and not _positive(threads):
        raise ValueError(f"threads={threads!r} must be a positive int or None (the default)")
    counts = list(dict.fromkeys(counts))  # each count once; repeats= asks for more
    threads = threads or threads_per_worker(max(counts))
    launch.setdefault("start_method", "forkserver")  # one process too: in a worker
    runs: dict[int, list[Run]] = {n: [] for n in counts}
    other: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(repeats):
        for n in counts:  # in turn: 1, 2, 1, 2, ...
            run = Run()
            with omp_threads(threads), Load() as load:
                notebook_launcher(function, args, kwargs, num_processes=n, run=run, **launch)
            runs[n].append(run)
            other[n].append(load.other_cores)
    return Scaling(repeats=runs, other_cores=other, threads=threads)


@contextmanager
def omp_threads(threads: int) -> Iterator[None]:
    """``OMP_NUM_THREADS=threads`` inside the block (the launcher gives each worker that
    many), and the environment exactly as before after it: the old value, or none."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _positive(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1
