"""Training throughput with the live view on versus off: the cost of watching.

Two CPU workers train an MLP through ``notebook_launcher``; the launching process either draws
the notebook panel (a PNG rendered by matplotlib, as in Jupyter; here handed to a sink instead
of a display) or draws nothing. Throughput is the workers' own samples/s, between their first
and last counter record, summed over ranks. Rounds alternate the order (on, off / off, on);
the result is the median of the per-round ratios on/off.

    python benchmarks/live.py [--rounds 9] [--steps 1500] [--out benchmarks/results/live-cpu.json]
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
from nbaccel.scaling import Scaling


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


def throughput(live: bool, steps: int) -> tuple[float, int]:
    run, sink = Run(), PanelSink()
    view = LiveView(sink) if live else False
    notebook_launcher(train, args=(steps,), num_processes=2, cpu=True, run=run, live=view)
    return Scaling({2: run}).throughput(2), sink.images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=1500, help="training steps per launch")
    parser.add_argument("--out", default="benchmarks/results/live-cpu.json")
    args = parser.parse_args()
    throughput(False, 50)  # warm up: the fork server, imports ...
    throughput(True, 50)  # ... and matplotlib in this process
    on, off, ratios, images = [], [], [], []
    for i in range(args.rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {live: throughput(live, args.steps) for live in order}
        on.append(got[True][0])
        off.append(got[False][0])
        images.append(got[True][1])
        ratios.append(got[True][0] / got[False][0])
        print(f"round {i}: on {on[-1]:,.0f} off {off[-1]:,.0f} ratio {ratios[-1]:.3f}", flush=True)
    result = {
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "setup": f"2 CPU workers, {args.steps} steps of batch 64 per launch, {args.rounds} rounds",
        "samples_per_s_on_median": statistics.median(on),
        "samples_per_s_off_median": statistics.median(off),
        "ratio_on_off_median": statistics.median(ratios),
        "ratio_on_off_quartiles": statistics.quantiles(ratios, n=4),
        "panels_drawn_per_launch_median": statistics.median(images),
        "ratios": ratios,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "ratios"}, indent=2))


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
