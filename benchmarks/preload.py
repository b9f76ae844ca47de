"""What does each module the fork server preloads cost, and what would leaving it to the workers
cost instead?

The fork server (``nbaccel/launch/forkserver.py``) imports torch, ``torch._dynamo``,
``torch.distributed``, ``torch.nn``, cloudpickle and nbaccel's Accelerator, freezes them
(``gc.freeze()``) and forks the workers from itself, so they share those pages. Here a stand-in
for it, in a fresh interpreter, imports one set of them (a *variant*), freezes, and forks 2
workers. Each worker then does one of two jobs:

* **idle**: nothing more (the launch benchmark's memory run: its workers only all-reduce);
* **train**: imports the server's whole list (what the variant left out, it loads itself) and
  takes one optimizer step of a small model (building an optimizer imports ``torch._dynamo``).

Measured while both workers hold: the PSS of the stand-in and its 2 workers together (the
launching kernel is the same in every variant and left out), each worker's USS, and the seconds
a worker took from the fork to ready (what a launch would wait for). The variants run in turns,
``--runs`` times each; medians.

A second table says what the stand-in's own memory is made of, before any fork (``composition``,
in a fresh interpreter of its own): the anonymous memory of the heap (``[heap]``: C and C++
allocations, torch's libraries' as they load) and of the other anonymous maps
(Python's object arenas, large allocations), the resident pages of files (shared libraries and
the like, shared with every process that maps them), and what glibc's ``malloc_trim(0)`` gives
back to the system once everything is loaded: whether trimming the server's process itself,
rather than its list, could shrink the tree.

    python benchmarks/preload.py [--runs 5] [--out benchmarks/results/preload-cpu.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SERVER = ["cloudpickle", "torch", "torch._dynamo", "torch.distributed", "torch.nn",
          "nbaccel.accelerator.accelerator"]  # fmt: skip  # forkserver.serve's imports
VARIANTS = {
    "the server's list": SERVER,
    "without torch._dynamo": [m for m in SERVER if m != "torch._dynamo"],
    "without nbaccel's Accelerator": [m for m in SERVER if m != "nbaccel.accelerator.accelerator"],
    "torch alone": ["torch"],
}
WORKERS = 2


def stand_in(modules: list[str], job: str) -> dict:
    """In a fresh interpreter: import ``modules``, freeze, fork the workers, measure, end them."""
    import psutil

    for name in modules:
        importlib.import_module(name)
    gc.freeze()
    hold_r, hold_w = os.pipe()  # the workers hold until it closes (this process's end, too)
    children = []
    for _ in range(WORKERS):
        ready_r, ready_w = os.pipe()
        forked = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # a worker: its job, then say so and hold
            os.close(ready_r)
            os.close(hold_w)
            if job == "train":
                work()
            os.write(ready_w, b"1")
            os.read(hold_r, 1)
            os._exit(0)
        os.close(ready_w)
        children.append((pid, ready_r, forked))
    seconds = []
    for _, ready_r, forked in children:
        os.read(ready_r, 1)
        seconds.append(time.perf_counter() - forked)
        os.close(ready_r)
    processes = [psutil.Process(), *(psutil.Process(pid) for pid, _, _ in children)]
    infos = [p.memory_full_info() for p in processes]
    os.close(hold_w)
    for pid, _, _ in children:
        os.waitpid(pid, 0)
    return {
        "tree_pss_mib": sum(i.pss for i in infos) / 2**20,
        "server_pss_mib": infos[0].pss / 2**20,
        "worker_uss_mib": [i.uss / 2**20 for i in infos[1:]],
        "worker_ready_s": seconds,
    }


def composition(modules: list[str]) -> dict:
    """In a fresh interpreter: import ``modules``, collect, freeze as the server does, and read
    this process's memory by kind from ``/proc/self/smaps``, before and after ``malloc_trim(0)``.
    The server freezes without collecting; the collection here leaves only live objects in
    what is measured (it frees nothing that the table shows: a development check)."""
    import ctypes

    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    before = memory_kinds()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after = memory_kinds()
    anonymous = before["heap_mib"] + before["anon_maps_mib"]
    return {**before, "trim_returns_mib": anonymous - after["heap_mib"] - after["anon_maps_mib"]}


def memory_kinds() -> dict:
    """This process's anonymous memory in its heap and in its other maps (a file's map among
    them, for its pages written since loading), and its resident pages of files as loaded, in
    MiB (``/proc/self/smaps``: each map's Rss and Anonymous; Rss comes first)."""
    kinds = {"heap_mib": 0.0, "anon_maps_mib": 0.0, "file_mib": 0.0}
    name = ""
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a map's header line
                name = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "Rss:" and name.startswith("/"):
                kinds["file_mib"] += int(fields[1]) / 1024
            elif fields[0] == "Anonymous:":  # in a file's map: its pages written since loading
                kind = "heap_mib" if name == "[heap]" else "anon_maps_mib"
                kinds[kind] += int(fields[1]) / 1024
                if name.startswith("/"):
                    kinds["file_mib"] -= int(fields[1]) / 1024
    return kinds


def work() -> None:
    """What a training worker loads and touches: the server's list, then one optimizer step."""
    for name in SERVER:
        importlib.import_module(name)
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    gc.collect()


def measure(variant: str, job: str) -> dict:
    """``stand_in`` (a ``job``: idle or train) or ``composition`` (``job`` "composition") of a
    variant, in a fresh interpreter."""
    call = (
        f"composition(preload.VARIANTS[{variant!r}])"
        if job == "composition"
        else f"stand_in(preload.VARIANTS[{variant!r}], {job!r})"
    )
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import preload; "
        f"print(json.dumps(preload.{call}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/preload-cpu.json")
    args = parser.parse_args()
    samples: dict[str, dict[str, list[dict]]] = {job: {v: [] for v in VARIANTS} for job in
                                                 ("idle", "train", "composition")}  # fmt: skip
    for _ in range(args.runs):
        for job in samples:
            for variant in VARIANTS:
                samples[job][variant].append(measure(variant, job))
    results = {
        job: {variant: summary(runs) for variant, runs in by_variant.items()}
        for job, by_variant in samples.items()
    }
    compositions = results.pop("composition")
    report = {
        "machine": machine(),
        "runs": args.runs,
        "workers": WORKERS,
        "results": results,
        "composition": compositions,
    }
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    text = to_markdown(report)
    out.with_suffix(".md").write_text(text)
    print(text + f"\nwrote {out} and {out.with_suffix('.md')}")


def summary(runs: list[dict]) -> dict:
    median = statistics.median
    if "heap_mib" in runs[0]:  # composition's: a median of each figure
        return {key: round(median(r[key] for r in runs), 1) for key in runs[0]}
    return {
        "tree_pss_mib": round(median(r["tree_pss_mib"] for r in runs), 1),
        "server_pss_mib": round(median(r["server_pss_mib"] for r in runs), 1),
        "worker_uss_mib": round(median(sum(r["worker_uss_mib"]) for r in runs), 1),
        "worker_ready_s": round(median(max(r["worker_ready_s"]) for r in runs), 3),
    }


def machine() -> dict:
    """The other CPU benchmarks' description of the machine (``overhead.machine``), imported only
    here: the stand-in imports this module, and must load nothing but its variant."""
    import overhead

    return overhead.machine(threads=overhead.torch.get_num_threads())


def to_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# What the fork server's preloads cost, on CPU",
        "",
        f"CPU: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; Python {m['python']}; "
        f"nbaccel {m['nbaccel']}; {m['date']}.",
        f"A stand-in server and {report['workers']} forked workers; {report['runs']} runs per "
        "variant, medians. Tree: the server and its workers (PSS, summed); worker USS: both "
        "workers' own memory, summed; ready: the slower worker's seconds from fork to ready.",
        "",
        "| workers | server preloads | tree PSS MiB | server PSS MiB | worker USS MiB | ready s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for job, by_variant in report["results"].items():
        for variant, r in by_variant.items():
            lines.append(
                f"| {job} | {variant} | {r['tree_pss_mib']:.0f} | {r['server_pss_mib']:.0f} | "
                f"{r['worker_uss_mib']:.0f} | {r['worker_ready_s']:.3f} |"
            )
    if "composition" in report:  # results before this table was added have none
        lines += [
            "",
            "The stand-in's own memory before any fork, by kind (MiB, medians): anonymous in the "
            "heap and in other maps, resident file pages, and what `malloc_trim(0)` gives back.",
            "",
            "| server preloads | heap | other anonymous | files | malloc_trim returns |",
            "|---|---:|---:|---:|---:|",
        ]
        for variant, r in report["composition"].items():
            lines.append(
                f"| {variant} | {r['heap_mib']:.0f} | {r['anon_maps_mib']:.0f} | "
                f"{r['file_mib']:.0f} | {r['trim_returns_mib']:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
