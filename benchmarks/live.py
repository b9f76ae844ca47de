"""Training throughput with the live view on versus off: the cost of watching.

Two CPU workers train an MLP through ``notebook_launcher``; the launching process either draws
the notebook panel (a PNG rendered by matplotlib, as in Jupyter; here handed to a sink instead
of a display) or draws nothing. Throughput is the workers' own samples/s, between their first
and last counter record, summed over ranks. Each round runs a short and a longer launch, each
on and off, the order alternating; the result is the median of the per-round ratios on/off.

The workers time their loops (the breakdown is on by default), so the panel drawn "on" has the
per-rank breakdown view. Its own cost, the panel's budget: after each round, the longer
launch's records are drawn again in this process, a panel with the breakdown view against the
same records without the loop's counters (the two-axes panel), the order alternating.

    python benchmarks/live.py [--rounds 9] [--steps 1500 4500] \
        [--out benchmarks/results/live-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from nbaccel import LiveView, Run, notebook_launcher
from nbaccel.lab.scaling import Scaling
from nbaccel.observe.live.panel import Panel


class PanelSink:
    """The notebook front end's work (render the panel, format the line), minus the display."""

    draws = True

    def __init__(self) -> None:
        self.images = 0

    def text(self, line: str) -> None:
        pass

    def image(self, png: bytes) -> None:
        self.images += 1

    def close(self) -> None:
        pass


def train(steps: int) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(live=False)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(8192, 256), torch.randint(0, 10, (8192,)))
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=64, shuffle=True)
    )
    step = 0
    while step < steps:  # every rank stops at the same step (never on its own clock)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss})
            step += 1
            if step == steps:
                break
    accelerator.end_training()


def throughput(live: bool, steps: int) -> tuple[float, int, Run]:
    run, sink = Run(), PanelSink()
    view = LiveView(sink) if live else False
    notebook_launcher(train, args=(steps,), num_processes=2, cpu=True, run=run, live=view)
    return Scaling({2: run}).throughput(2), sink.images, run


def panel_seconds(run: Run, repeats: int = 5) -> dict[str, float]:
    """Median seconds to update and render one panel from ``run``'s records, with the breakdown
    view and without it (the same records less the loop's counters), alternating."""
    untimed = Run(world_size=run.world_size, started=run.started, finished=run.finished)
    untimed.add([r for r in run.records if not r.name.startswith("nbaccel/time/")])
    panels = {"with": (Panel(), run), "without": (Panel(), untimed)}
    if not run.breakdown():
        raise SystemExit("the workers recorded no breakdown: is NBACCEL_BREAKDOWN=0 set?")
    seconds: dict[str, list[float]] = {kind: [] for kind in panels}
    for i in range(repeats + 1):
        for kind in sorted(panels, reverse=i % 2 == 1):
            panel, records = panels[kind]
            start = time.perf_counter()
            panel.png(records)
            if i:  # the first draw of each builds its axes: not what a redraw costs
                seconds[kind].append(time.perf_counter() - start)
    assert panels["with"][0].breakdown is not None and panels["without"][0].breakdown is None
    return {kind: statistics.median(got) for kind, got in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[1500, 4500], help="training steps per launch"
    )
    parser.add_argument("--out", default="benchmarks/results/live-cpu.json")
    args = parser.parse_args()
    throughput(False, 50)  # warm up: the fork server, imports ...
    throughput(True, 50)  # ... and matplotlib in this process
    lengths = {steps: {"on": [], "off": [], "ratios": [], "panels": []} for steps in args.steps}
    cost: dict[str, list[float]] = {"with": [], "without": []}  # seconds per panel
    for i in range(args.rounds):
        for steps, got in lengths.items():  # every length in every round, order alternating
            order = (True, False) if i % 2 == 0 else (False, True)
            pair = {live: throughput(live, steps) for live in order}
            got["on"].append(pair[True][0])
            got["off"].append(pair[False][0])
            got["panels"].append(pair[True][1])
            got["ratios"].append(pair[True][0] / pair[False][0])
            print(
                f"round {i}, {steps} steps: on {got['on'][-1]:,.0f} off {got['off'][-1]:,.0f} "
                f"ratio {got['ratios'][-1]:.3f}, {got['panels'][-1]} panels",
                flush=True,
            )
        drawn = panel_seconds(pair[True][2])  # the longest launch of the round, as drawn live
        for kind, seconds in drawn.items():
            cost[kind].append(seconds)
        print(f"round {i}: a panel takes {_ms(drawn)}", flush=True)
    result = {
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "setup": f"2 CPU workers, batch 64, {args.rounds} rounds",
        "lengths": {
            str(steps): {
                "seconds_off_median": statistics.median(
                    steps * 64 * 2 / rate for rate in got["off"]
                ),
                "samples_per_s_on_median": statistics.median(got["on"]),
                "samples_per_s_off_median": statistics.median(got["off"]),
                "ratio_on_off_median": statistics.median(got["ratios"]),
                "ratio_on_off_quartiles": statistics.quantiles(got["ratios"], n=4),
                "panels_drawn_per_launch_median": statistics.median(got["panels"]),
                "ratios": got["ratios"],
            }
            for steps, got in lengths.items()
        },
        "panel_seconds": {
            "records": len(pair[True][2].records),
            "with_breakdown_median": statistics.median(cost["with"]),
            "without_breakdown_median": statistics.median(cost["without"]),
            "with_breakdown": cost["with"],
            "without_breakdown": cost["without"],
        },
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")


def markdown(result: dict) -> str:
    m = result["machine"]
    rows = []
    for steps, r in result["lengths"].items():
        q1, _, q3 = r["ratio_on_off_quartiles"]
        rows.append(
            f"| {steps} steps (about {r['seconds_off_median']:.0f} s) "
            f"| {r['samples_per_s_on_median']:,.0f} | {r['samples_per_s_off_median']:,.0f} "
            f"| **{r['ratio_on_off_median']:.3f}** ({q1:.3f}-{q3:.3f}) "
            f"| {r['panels_drawn_per_launch_median']:.0f} |"
        )
    per_round = "; ".join(
        f"{steps} steps: " + ", ".join(f"{x:.3f}" for x in r["ratios"])
        for steps, r in result["lengths"].items()
    )
    p = result["panel_seconds"]
    with_s, without_s = p["with_breakdown_median"], p["without_breakdown_median"]
    return f"""# Live view on versus off: training throughput (CPU)

CPU: {m["cpu"]}, {m["cores"]} cores; Python {m["python"]}; torch {m["torch"]}; {m["date"]};
1-min load average at the end {m["load_average"][0]:.1f} (the machine is shared).
Setup: {result["setup"]}; MLP 256-512-10, SGD; `accelerator.log` every step on both ranks.
"On" draws the notebook panel in the launching process (PNG rendered, handed to a sink
instead of a display) and the progress line; "off" draws nothing. Throughput: the workers' own
samples/s, summed over ranks. Each round runs every length, on and off, the order alternating;
ratios are per round.

| run | samples/s on | samples/s off | ratio on/off, median (quartiles) | panels drawn |
|---|---:|---:|---:|---:|
{chr(10).join(rows)}

Target: at least 0.99. The panels drawn include the final one, drawn after training. The first
three panels come once a second whatever they cost, so that a short run is seen to move; after
them drawing is held to 1% of a core. Those three are a fixed cost, a larger share of a short
run than of a long one.
Per-round ratios: {per_round}.

## The panel's own cost, with the breakdown view

The workers time their loops (on by default), so "on" draws the panel with each rank's
breakdown. Drawn again in this process from the longest launch's {p["records"]:,} records, one
panel (update and render) takes **{1000 * with_s:.0f} ms** with the breakdown view and
**{1000 * without_s:.0f} ms** without it (the same records less the loop's counters: the
two-axes panel), medians over the rounds, ratio {with_s / without_s:.2f}. The throttle does not
change: at most one panel a second, and after the first three at most 1% of a core, so a
dearer panel is drawn less often rather than costing the training more.
Per round, ms with / without: {
        ", ".join(
            f"{1000 * a:.0f}/{1000 * b:.0f}"
            for a, b in zip(p["with_breakdown"], p["without_breakdown"], strict=True)
        )
    }.
CPU figures only; no GPU was available to this run.
"""


def _ms(seconds: dict[str, float]) -> str:
    return ", ".join(f"{1000 * s:.0f} ms {kind} the breakdown" for kind, s in seconds.items())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
