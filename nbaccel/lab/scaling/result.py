"""What a scaling measurement found: every run, the median one per count, the flags, the table.

``measure_scaling`` (``measure.py``) fills a ``Scaling``; this module reads it. The package's
docstring (``nbaccel.lab.scaling``) says how the numbers are measured and judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ...observe.channel import BREAKDOWN
from ...observe.live.bars import estimate_notes
from ...observe.records import Run, Timing
from . import flags as judge

NAN = float("nan")  # a share of a run that did not time its loop; a spread of one repeat


def median_run(runs: list[Run]) -> Run:
    """The run whose training-window throughput is the median one (of an even number of runs,
    the lower of the two middle ones: always a run that happened)."""
    ranked = sorted(runs, key=lambda run: run.timing().samples_per_s)
    return ranked[(len(ranked) - 1) // 2]


@dataclass
class Scaling:
    """The runs of a scaling measurement, every repeat of every process count, and what they
    show. ``runs[n]`` is the median run of count ``n`` (the one the table's times, breakdown and
    loss come from); ``repeats[n]`` all of them, in launch order; ``other_cores[n]`` the cores
    other processes kept busy during each of those launches ([] when not measured).

    Built by hand from runs alone (``Scaling(runs={1: run})``) each count has one repeat.
    ``thresholds`` are the ones the flags were judged by; ``dataclasses.replace(scaling,
    thresholds=...)`` judges the same runs again by others.
    """

    runs: dict[int, Run] = field(default_factory=dict)
    repeats: dict[int, list[Run]] = field(default_factory=dict)
    other_cores: dict[int, list[float]] = field(default_factory=dict)
    threads: int | None = None  # torch threads per worker, the same at every count
    thresholds: dict[str, float] = field(default_factory=lambda: dict(judge.THRESHOLDS))

    def __post_init__(self) -> None:
        self.runs = dict(self.runs)
        self.repeats = {n: list(runs) for n, runs in self.repeats.items()}
        self.other_cores = {n: list(cores) for n, cores in self.other_cores.items()}
        for n, run in self.runs.items():
            self.repeats.setdefault(n, [run])
        for n, runs in self.repeats.items():
            if not runs:
                raise ValueError(f"repeats[{n}] is empty: every process count needs a run")
            run = self.runs.setdefault(n, median_run(runs))
            if not any(r is run for r in runs):
                raise ValueError(f"runs[{n}] is not one of repeats[{n}]; pass one of them")
            if len(self.other_cores.get(n, runs)) != len(runs):
                raise ValueError(
                    f"other_cores[{n}] has {len(self.other_cores[n])} values for {len(runs)} "
                    "repeats: one per launch, or none"
                )

    def timing(self, n: int) -> Timing:
        """Start-up, training and finish seconds of the median run with ``n`` processes."""
        return self.runs[n].timing()

    def throughputs(self, n: int) -> list[float]:
        """Each repeat's samples/s with ``n`` processes, in launch order."""
        return [run.timing().samples_per_s for run in self.repeats[n]]

    def throughput(self, n: int) -> float:
        """Samples/s with ``n`` processes: the median over the repeats of all ranks' samples
        over the training seconds (start-up and finish left out)."""
        return statistics.median(self.throughputs(n))

    def spread(self, n: int) -> float:
        """(max - min) / median of the repeats' samples/s; NaN for a single repeat."""
        return judge.spread(self.throughputs(n))

    def live_rate(self, n: int) -> float | None:
        """What the live progress line showed last in the median run with ``n`` processes:
        every rank's samples rate over its last seconds of records, summed
        (``Run.live_samples_per_s``; None for a run too short to have one). A recent window,
        not the run."""
        return self.runs[n].live_samples_per_s()

    def breakdown(self, n: int) -> dict[int, dict[str, float]]:
        """Each rank's data, compute, communication and other seconds in the median run with
        ``n`` processes (``Run.breakdown``); {} when the run did not time its loop."""
        return self.runs[n].breakdown()

    def shares(self, n: int) -> dict[str, float]:
        """The parts' shares of the training loop (0..1) in the median run with ``n``
        processes, each the mean over the ranks of part / loop seconds; {} without a
        breakdown."""
        ranks = [parts for parts in self.breakdown(n).values() if sum(parts.values()) > 0]
        if not ranks:
            return {}
        return {
            part: sum(parts[part] / sum(parts.values()) for parts in ranks) / len(ranks)
            for part in BREAKDOWN
        }

    def rows(self) -> list[dict[str, Any]]:
        """One dict per process count: ``processes``; from the median run ``samples``,
        ``startup_s``, ``training_s``, ``finish_s``, ``seconds`` (the wall clock) and the
        loop's mean shares (0..1) ``data_share``, ``compute_share``, ``communication_share``,
        ``other_share`` (NaN for a run that did not time its loop); from all the repeats
        ``samples_per_s`` (their median), ``efficiency`` (= samples_per_s / (processes x the
        smallest count's samples_per_s per process)), ``repeats`` (how many), ``throughputs``
        (each one's samples/s), ``spread``, ``other_cores`` (their median; NaN if not
        measured); ``threads`` per worker; and ``flags``, the reasons this row is not a result
        ([] when it is trusted)."""
        if not self.runs:
            return []
        first = min(self.runs)
        base = self.throughput(first) / first
        rows: list[dict[str, Any]] = []
        for n in sorted(self.runs):
            t = self.timing(n)
            speed = self.throughput(n)
            efficiency = speed / (n * base) if base else NAN
            shares = self.shares(n)
            cores = self.other_cores.get(n)
            rows.append(
                {
                    "processes": n,
                    "samples": sum(t.samples.values()),
                    "startup_s": t.startup,
                    "training_s": t.training,
                    "finish_s": t.finish,
                    "seconds": t.wall,
                    "samples_per_s": speed,
                    "efficiency": efficiency,
                    **{f"{part}_share": shares.get(part, NAN) for part in BREAKDOWN},
                    "repeats": len(self.repeats[n]),
                    "threads": self.threads,
                    "spread": self.spread(n),
                    "throughputs": self.throughputs(n),
                    "other_cores": statistics.median(cores) if cores else NAN,
                    "flags": self._flags(n, efficiency, rows[0]["flags"] if rows else []),
                }
            )
        return rows

    def _flags(self, n: int, efficiency: float, base_flags: list[str]) -> list[str]:
        """Why the row of ``n`` processes is not a result (``flags.py`` has the rules)."""
        limits, first = self.thresholds, min(self.runs)
        shown = next(i for i, run in enumerate(self.repeats[n]) if run is self.runs[n])
        found = [
            judge.too_short(self.timing(n).training, limits["training_s"]),
            judge.busy(self.other_cores.get(n, []), shown, limits["other_cores"]),
            judge.wide(self.throughputs(n), limits["spread"]),
        ]
        if n != first:
            found.append(judge.spoiled_baseline(first, base_flags))
            found.append(
                judge.slow_baseline(
                    self._work(first), self._work(n), first, n, limits["baseline_slow"]
                )
            )
        found = [f for f in found if f]
        above = judge.above_one(efficiency, found, self.runs[n].device, limits["efficiency"])
        return found + ([above] if above else [])

    def _work(self, n: int) -> float | None:
        return judge.work_per_sample(self.breakdown(n), self.timing(n).samples)

    def flags(self, n: int | None = None) -> list[str]:
        """The flags of the row of ``n`` processes; without ``n``, every row's, each led by
        its count ("2 processes: busy: ...")."""
        rows = self.rows()
        if n is not None:
            return next(r["flags"] for r in rows if r["processes"] == n)
        return [f"{_processes(r['processes'])}: {f}" for r in rows for f in r["flags"]]

    @property
    def trusted(self) -> bool:
        """True when no row is flagged: every number in the table is a result."""
        return not self.flags()

    def table(self) -> str:
        """The rows as Markdown: the table (the breakdown's columns only if some run has one),
        a numbered note for each flagged row, whose efficiency is marked "(!k)", which shares
        are estimates (``Run.estimated``: on GPUs), and how the numbers were measured and
        judged."""
        rows = self.rows()
        timed = any(not math.isnan(r["compute_share"]) for r in rows)
        header = "| processes | samples | start-up s | training s | finish s | wall s "
        header += "| median samples/s | spread % | repeats | efficiency |"
        header += " data % | compute % | comm % | other % |" if timed else ""
        lines = [header, "|---:" * (14 if timed else 10) + "|"]
        notes = []
        for r in rows:
            efficiency = f"{r['efficiency']:.2f}"
            if r["flags"]:
                flags = "; ".join(r["flags"])
                notes.append(f"{_processes(r['processes'])}, not a result: {flags}")
                efficiency += f" (!{len(notes)})"
            line = (
                f"| {r['processes']} | {r['samples']:,.0f} | {r['startup_s']:.2f} | "
                f"{r['training_s']:.2f} | {r['finish_s']:.2f} | {r['seconds']:.2f} | "
                f"{r['samples_per_s']:,.0f} | {_percent(r['spread'])} | {r['repeats']} | "
                f"{efficiency} |"
            )
            if timed:
                line += "".join(f" {_percent(r[f'{part}_share'])} |" for part in BREAKDOWN)
            lines.append(line)
        lines += [""] + [f"{k}. {note}" for k, note in enumerate(notes, 1)] + [""] * bool(notes)
        estimated = {p: e for run in self.runs.values() for p, e in run.estimated().items()}
        lines += [f"The shares' {note}." for note in estimate_notes(estimated) if timed]
        return "\n".join([*lines, self._method()])

    def _method(self) -> str:
        """One line: how the table's numbers were measured, and what flags a row."""
        limits = self.thresholds
        threads = (
            f"{self.threads} torch thread(s) per worker at every count"
            if self.threads
            else "threads per worker not recorded"
        )
        return (
            f"samples/s: the median of each count's repeats, launched in turn; {threads}. "
            f"Flagged, not a result: other processes above {limits['other_cores']:.2f} cores "
            f"busy, spread above {limits['spread']:.0%}, the baseline's time per sample above "
            f"{1 + limits['baseline_slow']:.2f} x a worker's at a larger count, efficiency "
            f"above {limits['efficiency']:.2f}, a training window under "
            f"{limits['training_s']:.2f} s."
        )

    def figure(self):
        """Throughput (each repeat, the median, the ideal line), efficiency, where the loop's
        time goes (if timed), and loss against the seconds since each median run's first
        training step; flagged counts drawn hollow and grey, labelled "spoiled"."""
        from .view import figure

        return figure(self)

    def save_png(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self._repr_png_())

    def _repr_markdown_(self) -> str:
        return self.table()

    def _ipython_display_(self) -> None:
        """In a notebook: the table, then the figure (a front end shows one format per
        output, so they go out as two)."""
        from IPython.display import Image, Markdown, display

        display(Markdown(self.table()))
        display(Image(self._repr_png_()))

    def _repr_png_(self) -> bytes:
        from ...observe.live.panel import to_png

        return to_png(self.figure())


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.0f}"  # NaN: not measured


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"
