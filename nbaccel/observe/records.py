"""What a launch recorded, on the launching side: every rank's records, results and failures.

The workers' ``channel.Channel`` sends ``Record``s; the launching process keeps them in a
``Run``, which answers the questions the live view and the scaling lab ask (each metric per
rank, its mean, rates of the counters, the training window) and exports them as CSV or JSON.

Data flows one way: worker -> ``channel`` -> ``Run`` -> the view (``live``). The view is given
a ``Run`` to draw (``live.panel.figure(run)``, ``live.panel.save_png(run, path)``); this module
never imports it, so a ``Run`` is read, saved and tested without matplotlib.
"""

from __future__ import annotations

import bisect
import csv
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .channel import (
    BREAKDOWN,
    ESTIMATED,
    MIN_RATE_SPAN_S,
    MIN_WINDOW_S,
    RATE_WINDOW_S,
    SAMPLES,
    TIME_COMMUNICATION,
    TIME_COMPUTE,
    TIME_DATA,
    TIME_LOOP,
    UNMEASURED,
    Record,
)
from .straggler import Straggler, find_straggler

#: The measured parts of a rank's loop (``breakdown``), by ``Run.breakdown``'s names.
_PARTS = {"data": TIME_DATA, "compute": TIME_COMPUTE, "communication": TIME_COMMUNICATION}
#: A straggler is judged on the whole run and again on about its last seconds.
RECENT_S = 2.0


@dataclass(frozen=True)
class Timing:
    """One launch's clock split at its first and last samples-counter record (seconds), and the
    samples each rank trained in between."""

    startup: float  # launch -> the first batch handed out on any rank
    training: float  # -> the last counter record on any rank
    finish: float  # -> the results back in the launching process
    wall: float  # the launch, end to end, read from its own two timestamps
    samples: dict[int, float]  # per rank: every sample handed out from its first record on

    @property
    def throughput(self) -> float:
        """All ranks' samples over the training seconds: the launch's throughput, in samples/s
        (0.0 when the window is empty). The scaling table's number and the final progress
        line's."""
        return sum(self.samples.values()) / self.training if self.training > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        """The old name of ``throughput`` (kept: the same number)."""
        return self.throughput


@dataclass
class Run:
    """Everything a launch recorded: metrics from every rank, results, failures, timings.

    Pass one to ``notebook_launcher(..., run=run)`` to keep it; ``LaunchError.run`` holds it
    when a launch fails.
    """

    records: list[Record] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    failures: list[Any] = field(default_factory=list)
    dropped: dict[int, int] = field(default_factory=dict)
    world_size: int = 1
    label: str | None = None  # how the progress line names the ranks, e.g. "rank 0 of 2"
    device: str | None = None  # what they train on, for the progress line: "CPU", "GPU"
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def __post_init__(self) -> None:
        # (name, rank) -> that rank's records of that name, in order; kept up to date lazily,
        # so the live view's five-times-a-second progress line costs the same at any length.
        self._index: dict[tuple[str, int], list[Record]] = {}
        self._indexed = 0
        # (name, window, rank) -> (records done, their times, their windowed rates, the
        # shortest and longest span): a point depends only on records at or before it, so
        # each is computed once (``rates``)
        self._rates: dict[tuple[str, float, int], tuple[int, list, list, float, float]] = {}

    def reset(self) -> None:
        """Forget what was recorded (a restarted launch records from step 0 again); keep what
        the launch is: its world size, label and device."""
        kept = {"world_size": self.world_size, "label": self.label, "device": self.device}
        self.__dict__.update(type(self)(**kept).__dict__)

    def add(self, records: list[Record]) -> None:
        self.records += records

    def _sync(self) -> None:
        for r in self.records[self._indexed :]:
            self._index.setdefault((r.name, r.rank), []).append(r)
        self._indexed = len(self.records)

    def _by_rank(self, name: str) -> dict[int, list[Record]]:
        self._sync()
        return {rank: rs for (n, rank), rs in sorted(self._index.items()) if n == name}

    def names(self) -> list[str]:
        """The metric names the user logged (the library's own counters left out)."""
        self._sync()
        return sorted({n for n, _ in self._index if not n.startswith("nbaccel/")})

    def series(self, name: str) -> dict[int, tuple[list[int], list[float]]]:
        """``{rank: (steps, values)}`` for one metric."""
        return {
            rank: ([r.step for r in rs], [r.value for r in rs])
            for rank, rs in self._by_rank(name).items()
        }

    def over_time(self, name: str) -> dict[int, tuple[list[float], list[float]]]:
        """``{rank: (seconds since start, values)}`` for one metric, against the clock: how the
        panel draws a gauge, each rank's CPU memory (``channel.RSS``)."""
        return {
            rank: ([r.time - self.started for r in rs], [r.value for r in rs])
            for rank, rs in self._by_rank(name).items()
        }

    def mean(self, name: str) -> tuple[list[int], list[float]]:
        """The metric averaged over the ranks that logged each step."""
        by_step: dict[int, list[float]] = {}
        for rs in self._by_rank(name).values():
            for r in rs:
                by_step.setdefault(r.step, []).append(r.value)
        steps = sorted(by_step)
        return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]

    def rates(
        self, name: str = SAMPLES, window: float = RATE_WINDOW_S
    ) -> dict[int, tuple[list[float], list[float]]]:
        """``{rank: (seconds since start, per second)}`` from a cumulative counter: at each of a
        rank's records, its rate over its last ``window`` seconds (since its first record, while
        it has fewer), drawn only where that span is at least ``MIN_RATE_SPAN_S``. The live
        panel's curves; their last points are ``live_rate``, their spans ``rate_spans``."""
        return {
            rank: ([t - self.started for t in times], list(values))
            for rank, (times, values, *_) in self._points(name, window).items()
        }

    def rate_spans(
        self, name: str = SAMPLES, window: float = RATE_WINDOW_S
    ) -> tuple[float, float] | None:
        """The shortest and longest span of ``rates``' points, any rank's (the panel's title
        says them): ``window`` and at most a step more while the loop counts, less in a run's
        first seconds, more after a pause. None before the first point."""
        points = self._points(name, window).values()
        return (min(p[2] for p in points), max(p[3] for p in points)) if points else None

    def _points(self, name: str, window: float) -> dict[int, tuple[list, list, float, float]]:
        out = {}
        for rank, rs in self._by_rank(name).items():
            done, times, values, lo, hi = self._rates.get(
                (name, window, rank), (0, [], [], float("inf"), 0.0)
            )
            for b, rate, span in _windowed(rs[done:], window, rs):  # the records new since
                times.append(b.time)
                values.append(rate)
                lo, hi = min(lo, span), max(hi, span)
            self._rates[name, window, rank] = (len(rs), times, values, lo, hi)
            if times:
                out[rank] = (times, values, lo, hi)
        return out

    def latest(self, name: str) -> dict[int, float]:
        """Each rank's last value of a metric."""
        return {rank: rs[-1].value for rank, rs in self._by_rank(name).items()}

    def latest_step(self, name: str) -> dict[int, int]:
        return {rank: rs[-1].step for rank, rs in self._by_rank(name).items()}

    def live_rate(self, name: str = SAMPLES, window: float = RATE_WINDOW_S) -> dict[int, float]:
        """Each rank's rate of a cumulative counter over its last ``window`` seconds of records
        (``rates``' last point); a rank whose records span less than ``MIN_RATE_SPAN_S`` has
        none yet."""
        return {rank: rate for rank, (rate, _) in self._live(name, window).items()}

    def live_span(self, name: str = SAMPLES, window: float = RATE_WINDOW_S) -> float | None:
        """The seconds of records ``live_rate``'s rates are over: the longest rank's. Less than
        ``window`` in a run's first seconds; while the loop counts, ``window`` and at most one
        step or counters' interval more; longer after a pause that counted nothing (a rate over
        the pause too, and the progress line says so)."""
        spans = [span for _, span in self._live(name, window).values()]
        return max(spans) if spans else None

    def _live(self, name: str, window: float) -> dict[int, tuple[float, float]]:
        """``{rank: (rate, span)}`` at each rank's last record."""
        ends = {rank: _windowed(rs[-1:], window, rs) for rank, rs in self._by_rank(name).items()}
        return {rank: last[0][1:] for rank, last in ends.items() if last}

    def live_samples_per_s(self, window: float = RATE_WINDOW_S) -> float | None:
        """What the progress line shows while the run goes: every rank's samples rate over its
        last ``window`` seconds, summed; None until every rank that counted samples has
        ``MIN_RATE_SPAN_S`` of records. A recent window, not the run: ``throughput()`` is the
        run's."""
        counted = self._by_rank(SAMPLES)
        rates = self.live_rate(SAMPLES, window)
        if not rates or set(rates) != set(counted):
            return None
        return sum(rates.values())

    #: The old name of ``live_samples_per_s`` (it was one counter interval's rate; now the
    #: window's).
    samples_per_s = live_samples_per_s

    def throughput(self) -> float | None:
        """The run's throughput: every rank's samples over the training window, in samples/s
        (``timing().throughput``), what the progress line shows once the run ended and what the
        scaling table uses. None when the window is shorter than ``MIN_WINDOW_S``."""
        timing = self.timing()
        return timing.throughput if timing.training >= MIN_WINDOW_S else None

    def timing(self) -> Timing:
        """Split the clock at the first and last samples-counter record of any rank.

        A prepared DataLoader's counter is first recorded as it hands out the first batch, with
        that batch counted, so the samples from that record on are exactly the ones trained in
        the window. (The records and ``started`` both read ``time.time()`` on this machine.)"""
        counted = self._by_rank(SAMPLES)
        end = self.finished if self.finished is not None else self.started
        if not counted:
            return Timing(end - self.started, 0.0, 0.0, end - self.started, {})
        begin = min(rs[0].time for rs in counted.values())
        stop = max(rs[-1].time for rs in counted.values())
        samples = {rank: rs[-1].value for rank, rs in counted.items()}
        return Timing(begin - self.started, stop - begin, end - stop, end - self.started, samples)

    def breakdown(self) -> dict[int, dict[str, float]]:
        """Where each rank's loop time went, in seconds, from its latest counters:
        ``{rank: {"data": s, "compute": s, "communication": s, "other": s}}``, the parts adding
        up to the rank's loop time (``nbaccel.observe.breakdown`` says what each part holds). ``{}``
        when no rank recorded them (``NBACCEL_BREAKDOWN=0``, or no prepared loop ran)."""
        latest = {part: self.latest(name) for part, name in _PARTS.items()}
        return {
            rank: _parts({part: values.get(rank, 0.0) for part, values in latest.items()}, loop)
            for rank, loop in self.latest(TIME_LOOP).items()
        }

    def unmeasured(self) -> list[str]:
        """The breakdown's parts some rank could not measure apart (``channel.UNMEASURED``: a
        loop that is not nbaccel's, timed through its hooks), in the breakdown's order."""
        self._sync()
        said = {n[len(UNMEASURED) :] for n, _ in self._index if n.startswith(UNMEASURED)}
        return [part for part in BREAKDOWN if part in said]

    def estimated(self) -> dict[str, float]:
        """The breakdown's parts some rank estimated from a sample of its spans
        (``channel.ESTIMATED``: CUDA's events), with the sample's rate: ``{"compute": 4.0}`` is
        one interval of each kind in 4 timed. ``{}`` when every rank timed every span (the
        CPU's clocks)."""
        self._sync()
        rates: dict[str, float] = {}
        for (name, _), rs in self._index.items():
            if name.startswith(ESTIMATED):
                part = name[len(ESTIMATED) :]
                rates[part] = max(rates.get(part, 0.0), rs[-1].value)
        return {part: rates[part] for part in BREAKDOWN if part in rates}

    def straggler(self) -> Straggler | None:
        """The rank the others consistently wait for, and why; None when no rank stands out.

        The rule: the others spend at least ``WAITING_SHARE`` of their loop communicating, this
        rank at most ``CLEARLY_BELOW`` of the least of their shares, and its data or compute
        exceeds the others' mean (the larger excess is the cause). It must hold for the whole
        run and again for its last ``RECENT_S`` seconds (the counters' increments), naming the
        same rank and cause: a rank that was slow once, long ago, is no straggler now."""
        found = find_straggler(self.breakdown())
        recent = find_straggler(self._recent_breakdown(RECENT_S))
        same = found and recent and (recent.rank, recent.cause) == (found.rank, found.cause)
        return found if same else None

    def _recent_breakdown(self, seconds: float) -> dict[int, dict[str, float]]:
        """Each rank's breakdown over its last ``seconds``: the increments of its counters from
        the last record at least that much older than its latest (or its first record). Binary
        searches in each rank's records: the progress line asks five times a second, at a cost
        that does not grow with the run."""
        out = {}
        series = {part: self._by_rank(name) for part, name in _PARTS.items()}
        for rank, rs in self._by_rank(TIME_LOOP).items():
            last = rs[-1]
            first = rs[max(bisect.bisect_right(rs, last.time - seconds, key=_time) - 1, 0)]
            if last.time <= first.time:
                continue
            parts = {
                part: _value_at(by_rank.get(rank, []), last.time)
                - _value_at(by_rank.get(rank, []), first.time)
                for part, by_rank in series.items()
            }
            out[rank] = _parts(parts, last.value - first.value)
        return out

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps([asdict(r) for r in self.records]))
        return path

    def to_csv(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["rank", "step", "time", "name", "value"])
            writer.writerows((r.rank, r.step, r.time, r.name, r.value) for r in self.records)
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Run:
        records = [Record(**row) for row in json.loads(Path(path).read_text())]
        run = cls(records=records)
        if records:
            run.started = min(r.time for r in records)
            run.world_size = max(r.rank for r in records) + 1
        return run


def _time(record: Record) -> float:
    return record.time


def _windowed(
    ends: list[Record], window: float, records: list[Record] | None = None
) -> list[tuple[Record, float, float]]:
    """For each record of ``ends`` (some of ``records``, in time order): its rate over the
    ``window`` seconds before it, from the last record at least that much older (or the first
    record), and that span, kept where the span is at least ``MIN_RATE_SPAN_S``."""
    records = ends if records is None else records
    first = records[0] if records else None
    out = []
    for b in ends:
        i = bisect.bisect_right(records, b.time - window, key=_time)
        a = records[i - 1] if i else first
        if a is not None and b.time - a.time >= MIN_RATE_SPAN_S:
            out.append((b, (b.value - a.value) / (b.time - a.time), b.time - a.time))
    return out


def _value_at(records: list[Record], moment: float) -> float:
    """The value of the last of ``records`` (in time order) at or before ``moment``; 0 before."""
    i = bisect.bisect_right(records, moment, key=_time)
    return records[i - 1].value if i else 0.0


def _parts(measured: dict[str, float], loop: float) -> dict[str, float]:
    """The measured parts and "other", the rest of ``loop`` (never below zero)."""
    parts = {part: measured[part] for part in BREAKDOWN if part != "other"}
    return parts | {"other": max(loop - sum(parts.values()), 0.0)}
