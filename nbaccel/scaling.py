"""Run one training function at several process counts and show how it scales.

>>> result = measure_scaling(train, counts=(1, 2), cpu=True)   # doctest: +SKIP
>>> result            # in a notebook: the table and the figure

Throughput is each rank's samples per second between its first and last counter record (the
prepared DataLoader counts them), so process start-up and the first batch's warm-up are left
out; the total is the sum over ranks. Scaling efficiency is ``total(N) / (N * total(1))``:
1.0 is perfect, and on a 2-core CPU two workers also halve each worker's threads, so CPU
efficiency says more about the machine than about DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .metrics import SAMPLES, Run


@dataclass
class Scaling:
    """The runs of a scaling measurement, one per process count, and what they show."""

    runs: dict[int, Run] = field(default_factory=dict)

    def throughput(self, n: int) -> float:
        """Total samples/s over the ranks of the run with ``n`` processes."""
        first: dict[int, tuple[float, float]] = {}
        last: dict[int, tuple[float, float]] = {}
        for r in self.runs[n].records:
            if r.name == SAMPLES:
                first.setdefault(r.rank, (r.time, r.value))
                last[r.rank] = (r.time, r.value)
        total = 0.0
        for rank, (t0, v0) in first.items():
            t1, v1 = last[rank]
            total += (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0
        return total

    def rows(self) -> list[dict[str, float]]:
        base = self.throughput(min(self.runs)) / min(self.runs) if self.runs else 0.0
        rows = []
        for n, run in sorted(self.runs.items()):
            speed = self.throughput(n)
            rows.append(
                {
                    "processes": n,
                    "samples_per_s": speed,
                    "efficiency": speed / (n * base) if base else float("nan"),
                    "seconds": (run.finished or run.started) - run.started,
                }
            )
        return rows

    def table(self) -> str:
        lines = ["| processes | samples/s | efficiency | wall-clock s |", "|---:|---:|---:|---:|"]
        lines += [
            f"| {r['processes']} | {r['samples_per_s']:,.0f} | {r['efficiency']:.2f} | "
            f"{r['seconds']:.1f} |"
            for r in self.rows()
        ]
        return "\n".join(lines)

    def figure(self):
        """Throughput (with the ideal line), efficiency, and loss against wall-clock time."""
        from matplotlib.figure import Figure

        from .display import loss_name

        rows = self.rows()
        counts = [r["processes"] for r in rows]
        fig = Figure(figsize=(12, 3.4), dpi=80, layout="constrained")
        speed_ax, eff_ax, loss_ax = fig.subplots(1, 3)
        speed_ax.plot(counts, [r["samples_per_s"] for r in rows], "o-", label="measured")
        if rows:
            ideal = rows[0]["samples_per_s"] / counts[0]
            speed_ax.plot(counts, [ideal * n for n in counts], "--", color="gray", label="ideal")
        speed_ax.set(xlabel="processes", ylabel="samples/s", title="throughput", xticks=counts)
        speed_ax.legend(fontsize=8)
        eff_ax.plot(counts, [r["efficiency"] for r in rows], "o-")
        eff_ax.axhline(1.0, ls="--", color="gray")
        top = max(
            [1.2] + [1.1 * r["efficiency"] for r in rows if r["efficiency"] == r["efficiency"]]
        )
        eff_ax.set(xlabel="processes", title="scaling efficiency", xticks=counts, ylim=(0, top))
        for n, run in sorted(self.runs.items()):
            name = loss_name(run)
            if name:
                by_step = {r.step: r.time for r in run.records if r.name == name}
                steps, values = run.mean(name)
                loss_ax.plot([by_step[s] - run.started for s in steps], values, label=f"{n} proc")
                loss_ax.set(ylabel=name)
        loss_ax.set(xlabel="wall-clock seconds", title="loss")
        if loss_ax.lines:
            loss_ax.legend(fontsize=8)
        return fig

    def save_png(self, path: str) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(self.figure()).print_png(path)

    def _repr_markdown_(self) -> str:
        return self.table()

    def _ipython_display_(self) -> None:
        """In a notebook: the table, then the figure (a front end shows one format per
        output, so they go out as two)."""
        from IPython.display import Image, Markdown, display

        display(Markdown(self.table()))
        display(Image(self._repr_png_()))

    def _repr_png_(self) -> bytes:
        from .display import to_png

        return to_png(self.figure())


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
    from .env import visible_gpus
    from .launcher import notebook_launcher

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
