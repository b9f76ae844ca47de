"""The first launch a learner meets: in a real Jupyter kernel, the import cell, a pause (the user
writing the next cells), then a trivial 2-worker launch, timed inside the kernel from the call to
the return. Then the same launch again (warm).

Cases, each in a fresh kernel, round-robin (the first case rotates each round):

- nbaccel, pause 10 s: the fork server started at the import (``client.prestart``) and had the
  pause to import torch; the launch draws its live view, as a user's does by default (the
  kernel loaded its matplotlib after the import cell, on its own thread: ``client.warm_kernel``);
- nbaccel, pause 10 s, live=False: the same without the view (this benchmark's only case before
  the warm-up: the view's first launch then imported matplotlib, about 0.45 s more);
- nbaccel, pause 10 s, ``import nbaccel``: the package imported, not the launcher (the server
  starts after that cell: ``nbaccel._prestart_once_bound``);
- nbaccel, pause 10 s, no torch in the cells: the kernel never imports torch itself (the job
  does, in the workers), so the launch's ``torch.distributed`` is imported by the same warm-up;
- nbaccel, no pause: the launch right after the import cell, while the server still imports;
- nbaccel, pause 10 s, prestart off (``NBACCEL_PRESTART=0``): the first launch starts the
  server, as every first launch did before the prestart;
- Accelerate's and Fabric's notebook launch after the same pause, where installed: both fork the
  kernel itself (``accelerate.notebook_launcher``; ``Fabric(strategy="ddp_fork").launch``).

The job is ``benchmarks/launch.py``'s: join a gloo group, all-reduce one tensor, leave (nbaccel's
workers through ``Accelerator()``). Medians with min and max over the rounds.

    python benchmarks/first_launch.py [--rounds 4] [--pause 10] \
        [--out benchmarks/results/first-launch-cpu.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.launch import machine, machine_line, summary, write  # noqa: E402  (shared)
from tests.kernel import Kernel  # noqa: E402  (a real kernel, driven by jupyter_client)

NBACCEL = """
import time, torch
from nbaccel import Accelerator, notebook_launcher

def job():
    accelerator = Accelerator()
    accelerator.reduce(torch.ones(1))
    accelerator.end_training()

def launch(live=True):
    began = time.perf_counter()
    notebook_launcher(job, num_processes=2, cpu=True, live=live)
    return time.perf_counter() - began
"""

PACKAGE = (
    NBACCEL.replace("from nbaccel import Accelerator, notebook_launcher", "import nbaccel")
    .replace("Accelerator()", "nbaccel.Accelerator()")
    .replace("    notebook_launcher(", "    nbaccel.notebook_launcher(")
)

NO_TORCH = NBACCEL.replace(  # the kernel never imports torch: the job does, in the workers
    "import time, torch\nfrom nbaccel import Accelerator, notebook_launcher",
    "import time\nfrom nbaccel import notebook_launcher",
).replace("def job():\n", "def job():\n    import torch\n    from nbaccel import Accelerator\n\n")

ACCELERATE = """
import os, socket, time, torch, torch.distributed as dist
import accelerate

def job():
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()

def launch():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.perf_counter()
    accelerate.notebook_launcher(job, num_processes=2, use_port=port)
    return time.perf_counter() - began
"""

FABRIC = """
import os, socket, time, torch, torch.distributed as dist
from lightning.fabric import Fabric

def job(fabric):
    dist.all_reduce(torch.ones(1))

def launch():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    began = time.perf_counter()
    Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(job)
    return time.perf_counter() - began
"""


def cases(pause: float) -> dict[str, tuple[str, dict[str, str], float, str]]:
    """name: (the import cell, the kernel's extra environment, the pause in seconds, the call)"""
    off = {"NBACCEL_PRESTART": "0"}
    found = {
        f"nbaccel, pause {pause:g} s": (NBACCEL, {}, pause, "launch()"),
        f"nbaccel, pause {pause:g} s, live=False": (NBACCEL, {}, pause, "launch(live=False)"),
        f"nbaccel, pause {pause:g} s, `import nbaccel`": (PACKAGE, {}, pause, "launch()"),
        f"nbaccel, pause {pause:g} s, no torch in the cells": (NO_TORCH, {}, pause, "launch()"),
        "nbaccel, no pause": (NBACCEL, {}, 0.0, "launch()"),
        f"nbaccel, pause {pause:g} s, prestart off": (NBACCEL, off, pause, "launch()"),
    }
    if importlib.util.find_spec("accelerate"):
        found[f"accelerate, pause {pause:g} s"] = (ACCELERATE, {}, pause, "launch()")
    if importlib.util.find_spec("lightning"):
        found[f"fabric, pause {pause:g} s"] = (FABRIC, {}, pause, "launch()")
    return found


def one(cell: str, env: dict[str, str], pause: float, call: str) -> dict[str, float]:
    """A fresh kernel: the import cell, the pause, the first launch, then a warm one."""
    with tempfile.TemporaryDirectory() as cwd:
        kernel = Kernel(cwd, env={"OMP_NUM_THREADS": "1", **env})
        try:
            out = kernel.run(cell, timeout=300)
            assert out.error is None, out.error
            if pause:
                kernel.run(f"time.sleep({pause})", timeout=pause + 60)
            times = {}
            for name in ("first", "warm"):
                out = kernel.run(call, timeout=300)
                assert out.error is None and out.value is not None, out.error
                times[name] = float(out.value)
            return times
        finally:
            kernel.shutdown()


def report(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# The first launch in a fresh kernel, on CPU",
        "",
        f"{machine_line(m)}; {results['rounds']} rounds, each case in a fresh kernel, round-robin.",
        "",
        "A trivial 2-worker launch timed inside the kernel, from the call to the return: the "
        "first after the import cell and the pause, then the next (warm). Median (min-max).",
        "",
        "| case | first launch, s | warm launch, s |",
        "|---|---:|---:|",
    ]
    for name, r in results["cases"].items():
        first, warm = r["first"], r["warm"]
        lines.append(
            f"| {name} | {first['median']:.3f} ({first['min']:.3f}-{first['max']:.3f}) "
            f"| {warm['median']:.3f} ({warm['min']:.3f}-{warm['max']:.3f}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pause", type=float, default=10.0)
    default = Path("benchmarks/results/first-launch-cpu.json")
    parser.add_argument("--out", type=Path, default=default)
    args = parser.parse_args()
    start_load = os.getloadavg()[0]
    chosen = cases(args.pause)
    names = list(chosen)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            runs[name].append(one(*chosen[name]))
            print(f"round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    results = {
        "machine": machine(args.rounds, start_load),
        "rounds": args.rounds,
        "pause_s": args.pause,
        "cases": {
            name: {
                "first": summary([t["first"] for t in ts]),
                "warm": summary([t["warm"] for t in ts]),
                "all": ts,
            }
            for name, ts in runs.items()
        },
    }
    write(args.out, results, report(results))
    print(report(results))


if __name__ == "__main__":
    main()
