"""Run one training function at several process counts and show how it scales.

>>> result = measure_scaling(train, counts=(1, 2), cpu=True)   # doctest: +SKIP
>>> result            # in a notebook: the table and the figure

Every number comes from one measurement per launch, the samples counter that the prepared
DataLoader keeps on each rank (it counts a batch as it hands it to the loop, and the counter is
recorded at its first batch, about every quarter second, and at the end of each epoch). The
launch's clock splits at the first and the last of those records (``Timing``):

* **start-up**: from the launch to the first batch handed out on any rank: starting workers,
  imports, the process group, building and preparing the model;
* **training**: from there to the last record on any rank, so it starts with the first
  training step (whose one-time costs it includes) and ends with the last epoch;
* **finish**: ``end_training``, the workers' exit and their results coming back.

The three add up to the wall clock of the launch. Throughput is the samples every rank trained
in the training window, summed, over the training seconds; scaling efficiency is
``throughput(N) / (N * throughput(1))``: 1.0 is perfect. On a 2-core CPU two workers also halve
each worker's threads, so CPU efficiency says more about the machine than about DDP.

Where the time goes: each run keeps every rank's breakdown of its training loop into data,
compute, communication and other seconds (``Run.breakdown``). The table gives their mean shares
of the loop per process count (``data %``, ``compute %``, ``comm %``, ``other %``), so it shows
where efficiency is lost, not only that it is: on one process nothing waits for gradients; at
two, the communication share is the price of keeping the replicas in step.

The live progress line shows something else: the rate between each rank's last two counter
records (a quarter second or less), summed, and the wall clock. ``Scaling.live_rate`` reads
that last rate from the same records. Both rates are defined once, with the records
(``Run.timing``, ``Run.samples_per_s``). The figure (``figure``, at the end) draws the same
numbers with matplotlib's object API (no pyplot), imported only when something is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..observe.channel import BREAKDOWN
from ..observe.live.bars import COLOURS
from ..observe.live.line import loss_name
from ..observe.records import Run, Timing

NAN = float("nan")  # a share of a run that did not time its loop


@dataclass
class Scaling:
    """The runs of a scaling measurement, one per process count, and what they show."""

    runs: dict[int, Run] = field(default_factory=dict)

    def timing(self, n: int) -> Timing:
        """Start-up, training and finish seconds of the run with ``n`` processes."""
        return self.runs[n].timing()

    def throughput(self, n: int) -> float:
        """Samples/s of the run with ``n`` processes: all ranks' samples over its training
        seconds (start-up and finish left out)."""
        return self.timing(n).samples_per_s

    def live_rate(self, n: int) -> float:
        """What the live progress line showed last: each rank's rate between its last two
        counter records (a quarter second or less), summed. A recent window, not the run."""
        return self.runs[n].samples_per_s()

    def breakdown(self, n: int) -> dict[int, dict[str, float]]:
        """Each rank's data, compute, communication and other seconds in the run with ``n``
        processes (``Run.breakdown``); {} when the run did not time its loop."""
        return self.runs[n].breakdown()

    def shares(self, n: int) -> dict[str, float]:
        """The parts' shares of the training loop (0..1) in the run with ``n`` processes, each
        the mean over the ranks of part / loop seconds; {} without a breakdown."""
        ranks = [parts for parts in self.breakdown(n).values() if sum(parts.values()) > 0]
        if not ranks:
            return {}
        return {
            part: sum(parts[part] / sum(parts.values()) for parts in ranks) / len(ranks)
            for part in BREAKDOWN
        }

    def rows(self) -> list[dict[str, float]]:
        """One dict per process count: ``processes``, ``samples``, ``startup_s``,
        ``training_s``, ``finish_s``, ``seconds`` (the wall clock), ``samples_per_s``
        (= samples / training_s), ``efficiency`` (= samples_per_s / (processes x the
        smallest count's samples_per_s per process)) and the loop's mean shares (0..1)
        ``data_share``, ``compute_share``, ``communication_share``, ``other_share`` (NaN for a
        run that did not time its loop)."""
        if not self.runs:
            return []
        base = self.throughput(min(self.runs)) / min(self.runs)
        rows = []
        for n in sorted(self.runs):
            t = self.timing(n)
            speed = t.samples_per_s
            shares = self.shares(n)
            rows.append(
                {
                    "processes": n,
                    "samples": sum(t.samples.values()),
                    "startup_s": t.startup,
                    "training_s": t.training,
                    "finish_s": t.finish,
                    "seconds": t.wall,
                    "samples_per_s": speed,
                    "efficiency": speed / (n * base) if base else NAN,
                    **{f"{part}_share": shares.get(part, NAN) for part in BREAKDOWN},
                }
            )
        return rows

    def table(self) -> str:
        """The rows as a Markdown table; the breakdown's columns only if some run has one."""
        rows = self.rows()
        timed = any(not math.isnan(r["compute_share"]) for r in rows)
        header = "| processes | samples | start-up s | training s | finish s | wall s | samples/s "
        header += "| efficiency |" + (" data % | compute % | comm % | other % |" if timed else "")
        lines = [header, "|---:" * (12 if timed else 8) + "|"]
        for r in rows:
            line = (
                f"| {r['processes']} | {r['samples']:,.0f} | {r['startup_s']:.2f} | "
                f"{r['training_s']:.2f} | {r['finish_s']:.2f} | {r['seconds']:.2f} | "
                f"{r['samples_per_s']:,.0f} | {r['efficiency']:.2f} |"
            )
            if timed:
                line += "".join(f" {_percent(r[f'{part}_share'])} |" for part in BREAKDOWN)
            lines.append(line)
        return "\n".join(lines)

    def figure(self):
        """Throughput (with the ideal line), efficiency, where the loop's time goes (if timed),
        and loss against the seconds since each run's first training step (start-up left out,
        as in the table)."""
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
        from ..observe.live.panel import to_png

        return to_png(self.figure())


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.0f}"  # NaN: this run was not timed


def measure_scaling(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    counts: Sequence[int] | None = None,
    **launch: Any,
) -> Scaling:
    """Launch ``function`` once per process count (default: 1 and 2 on a CPU, 1..N on N GPUs).

    Every count runs in worker processes, one process included, so they compare alike. Other
    keyword arguments go to ``notebook_launcher`` (``cpu``, ``mixed_precision``, ``live``, ...).
    """
    from ..env import visible_gpus
    from ..launch.launcher import notebook_launcher

    if counts is None:  # one GPU: one process (a second would need a second GPU, or cpu=True)
        gpus = 0 if launch.get("cpu") else visible_gpus()
        counts = range(1, gpus + 1) if gpus else (1, 2)
    counts = list(counts)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"counts={counts!r} must be positive ints, e.g. counts=(1, 2)")
    result = Scaling()
    for n in counts:
        run = Run()
        launch.setdefault("start_method", "forkserver")  # one process too: in a worker
        notebook_launcher(function, args, kwargs, num_processes=n, run=run, **launch)
        result.runs[n] = run
    return result


# -- the figure -----------------------------------------------------------------------------------
def figure(scaling: Scaling):
    """Throughput (with the ideal line), efficiency, the loop's shares per process count (when
    the runs timed their loops), and loss against the seconds since each run's first training
    step (start-up left out, as in the table)."""
    from matplotlib.figure import Figure

    rows = scaling.rows()
    counts = [r["processes"] for r in rows]
    timed = [r for r in rows if not math.isnan(r["compute_share"])]
    fig = Figure(figsize=(15 if timed else 12, 3.4), dpi=80, layout="constrained")
    speed_ax, eff_ax, *time_ax, loss_ax = fig.subplots(1, 4 if timed else 3)
    speed_ax.plot(counts, [r["samples_per_s"] for r in rows], "o-", label="measured")
    if rows:
        ideal = rows[0]["samples_per_s"] / counts[0]
        speed_ax.plot(counts, [ideal * n for n in counts], "--", color="gray", label="ideal")
    speed_ax.set(xlabel="processes", ylabel="samples/s", title="throughput", xticks=counts)
    speed_ax.legend(fontsize=8)
    eff_ax.plot(counts, [r["efficiency"] for r in rows], "o-")
    eff_ax.axhline(1.0, ls="--", color="gray")
    top = max([1.2] + [1.1 * r["efficiency"] for r in rows if r["efficiency"] == r["efficiency"]])
    eff_ax.set(xlabel="processes", title="scaling efficiency", xticks=counts, ylim=(0, top))
    if timed:
        shares(time_ax[0], timed)
    for n, run in sorted(scaling.runs.items()):
        name = loss_name(run)
        if name:
            begin = run.started + scaling.timing(n).startup  # the first training step
            by_step = {r.step: r.time for r in run.records if r.name == name}
            steps, values = run.mean(name)
            loss_ax.plot([by_step[s] - begin for s in steps], values, label=f"{n} proc")
            loss_ax.set(ylabel=name)
    loss_ax.set(xlabel="seconds since the first training step", title="loss")
    if loss_ax.lines:
        loss_ax.legend(fontsize=8)
    return fig


def shares(ax, rows: list[dict[str, float]]) -> None:
    """One bar per process count, its loop's mean shares stacked: the efficiency lost shows up
    as the communication (red) and data (orange) parts that grow with the count."""
    labels = [str(r["processes"]) for r in rows]  # categories: evenly spaced, whatever the counts
    bottom = [0.0] * len(rows)
    for part in BREAKDOWN:
        heights = [100 * r[f"{part}_share"] for r in rows]
        ax.bar(labels, heights, bottom=bottom, color=COLOURS[part], label=part, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(xlabel="processes", ylabel="% of the training loop", ylim=(0, 100))
    ax.set_title("where the time goes")
    handles, names = ax.get_legend_handles_labels()  # listed top down, as the bars stack
    ax.legend(handles[::-1], names[::-1], fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
