"""How long does a trivial 2-worker launch take, and how much memory do its processes hold?

The job is the same for every launcher: join a gloo process group, all-reduce one tensor, leave.
nbaccel's workers do it the nbaccel way (``Accelerator()``, ``reduce``, ``end_training``); the
others call ``torch.distributed`` directly. A launch is timed from the call to the return.

The machine may be shared and noisy, so the variants run round-robin in this one process (the
first variant rotates each round) and we report medians with min and max. This process never
runs a torch op, so forking it is as safe as forking a fresh notebook kernel; it has imported
every launcher, which makes its forks a little dearer than a lean kernel's. Then, each round,
every variant also runs in a fresh process that imported only torch, nbaccel and that launcher:
its first launch is timed (for nbaccel, that one starts the fork server), then a memory run, where
the workers sleep 1 s after the all-reduce while a thread sums the PSS and USS of the workers,
nbaccel's fork server apart, and of the whole process tree (the launching process included);
then a second memory run, where the workers first train a few steps and collect their garbage
(``work``), as any worker that trains a while has done.

    python benchmarks/launch.py [--runs 10] [--out benchmarks/results/launch-cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nbaccel

HOLD = 1.0  # seconds a worker stays alive after the all-reduce in memory runs


def nbaccel_job(hold: float, train: bool = False) -> None:
    accelerator = nbaccel.Accelerator()
    accelerator.reduce(torch.ones(1))
    then_hold(hold, train)
    accelerator.end_training()


def torch_job(hold: float, train: bool = False) -> None:  # RANK, WORLD_SIZE, MASTER_* are set
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    then_hold(hold, train)
    dist.destroy_process_group()


def then_hold(hold: float, train: bool) -> None:
    if train:
        work()
    time.sleep(hold)


def work() -> None:
    """What a worker of a memory run does before it holds: a few training steps of a small
    model, then a full garbage collection, as any run that trains a while has had. A collection
    writes to every object it visits, so the pages a worker shares with the process it was
    forked from are copied unless those objects were frozen there (``gc.freeze``)."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    gc.collect()


def fork_job(rank: int, hold: float, train: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    torch_job(hold, train)


def fabric_job(fabric, hold: float, train: bool) -> None:  # Fabric set up the process group
    dist.all_reduce(torch.ones(1))
    then_hold(hold, train)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nbaccel(hold: float, train: bool = False, **kwargs) -> None:
    args = (hold, train)
    nbaccel.notebook_launcher(nbaccel_job, args=args, num_processes=2, cpu=True, **kwargs)


def run_fork(hold: float, train: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.start_processes(fork_job, args=(hold, train), nprocs=2, start_method="fork")


def run_accelerate(hold: float, train: bool = False) -> None:
    import accelerate

    args = (hold, train)
    accelerate.notebook_launcher(torch_job, args=args, num_processes=2, use_port=free_port())


def run_fabric(hold: float, train: bool = False) -> None:
    from lightning.fabric import Fabric

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(fabric_job, hold, train)


VARIANTS = {  # name: (run, the module it needs, the call as recorded in the results)
    "nbaccel": (run_nbaccel, "nbaccel", "notebook_launcher(fn, num_processes=2, cpu=True)"),
    "nbaccel spawn": (
        lambda hold, train=False: run_nbaccel(hold, train, start_method="spawn"),
        "nbaccel",
        "notebook_launcher(fn, num_processes=2, cpu=True, start_method='spawn')",
    ),
    "bare fork": (run_fork, "torch", "torch.multiprocessing.start_processes(fn, nprocs=2, "
                  "start_method='fork'), MASTER_ADDR/MASTER_PORT set"),
    "accelerate": (run_accelerate, "accelerate", "accelerate.notebook_launcher(fn, "
                   "num_processes=2, use_port=<free port>) (it has no cpu argument)"),
    "fabric": (run_fabric, "lightning.fabric", "Fabric(accelerator='cpu', devices=2, "
               "strategy='ddp_fork').launch(fn), MASTER_PORT=<free port>, built inside the timing"),
}  # fmt: skip


@contextlib.contextmanager
def isolated():
    """Peers set MASTER_PORT and friends in os.environ, print, and leave log directories behind
    (torch's elastic agent, under accelerate, makes one per launch): keep all that to one run."""
    saved, stdout = dict(os.environ), os.dup(1)
    sys.stdout.flush()
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)  # forked workers print to the inherited descriptor
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            tempfile.tempdir = tmp
            yield
    finally:
        tempfile.tempdir = None
        os.dup2(stdout, 1)
        os.close(stdout)
        os.environ.clear()
        os.environ.update(saved)


def timed(run) -> float:
    with isolated():
        start = time.perf_counter()
        run(0.0)
        return time.perf_counter() - start


def memory(run, train: bool) -> dict:
    """The sample (MiB) with the largest worker PSS among those that saw exactly 2 workers."""
    samples, done, me = [], threading.Event(), psutil.Process()

    def sample() -> None:
        while not done.wait(0.05):
            mib = dict.fromkeys(("workers_pss", "workers_uss", "server_pss", "server_uss"), 0.0)
            mib["workers"] = 0
            with contextlib.suppress(psutil.Error):
                mib["tree_pss"] = me.memory_full_info().pss / 2**20
                for p in me.children(recursive=True):
                    info = p.memory_full_info()  # the server's forks share its command line
                    if p.ppid() == me.pid and "nbaccel.launch.forkserver" in " ".join(p.cmdline()):
                        mib["server_pss"] += info.pss / 2**20
                        mib["server_uss"] += info.uss / 2**20
                    else:
                        mib["workers"] += 1
                        mib["workers_pss"] += info.pss / 2**20
                        mib["workers_uss"] += info.uss / 2**20
                mib["tree_pss"] += mib["workers_pss"] + mib["server_pss"]
                if mib.pop("workers") == 2:
                    samples.append(mib)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with isolated():
            run(HOLD, train)
    finally:
        done.set()
        sampler.join()
    if not samples:
        raise RuntimeError("no memory sample saw exactly 2 live workers")
    return max(samples, key=lambda mib: mib["workers_pss"])


def fresh(name: str) -> dict:
    """Run `child(name)` in a new interpreter; return what it measured."""
    child = subprocess.Popen([sys.executable, __file__, "--child", name], stdout=subprocess.PIPE)
    try:
        out, _ = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if child.returncode != 0:
        raise RuntimeError(f"the fresh-process run of {name!r} failed ({child.returncode})")
    return json.loads(out.decode().strip().splitlines()[-1])


def child(name: str) -> None:
    run, module, _ = VARIANTS[name]
    importlib.import_module(module)  # as a notebook would have, before it launches
    first = timed(run)
    print(json.dumps({"first": first, "memory": memory(run, False), "trained": memory(run, True)}))


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def machine_line(m: dict) -> str:
    """``machine()``'s description as a report's line: the CPU, Python, the versions, the date
    and the load before and after the run."""
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    before, after = m["loadavg_1min"]
    return (
        f"CPU: {m['cpu']}, {m['cores']} cores; Python {m['python']}; {versions}; {m['date']}; "
        f"1-min load {before:.1f} before, {after:.1f} after"
    )


def ratio(values: list[float], baseline: list[float]) -> float:
    """Median of the per-round ratios: each pair ran seconds apart, under the same load."""
    return statistics.median(v / b for v, b in zip(values, baseline, strict=True))


def machine(runs: int, start_load: float) -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), cpu)
    versions = {}
    for pkg in ("torch", "nbaccel", "accelerate", "lightning", "psutil", "cloudpickle"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    source = Path(nbaccel.__file__).parent

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", source, *args], capture_output=True, text=True)
        return run.stdout.strip()

    versions["nbaccel"] += f" ({git('rev-parse', '--short', 'HEAD') or source}"
    versions["nbaccel"] += ", uncommitted changes)" if git("status", "--porcelain", ".") else ")"
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions, "date": now, "runs": runs,
            "hold_s": HOLD, "loadavg_1min": [start_load, os.getloadavg()[0]]}  # fmt: skip


def report(results: dict) -> str:
    m = results["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    load = "-".join(f"{x:.1f}" for x in m["loadavg_1min"])
    head = "variant | launch s (median) | min | max | / bare fork | fresh process: 1st launch s"
    head += " | worker PSS MiB | worker USS MiB | server PSS MiB | server USS MiB | tree PSS MiB"
    lines = [
        "# Launch time and memory: a trivial job on 2 CPU workers",
        "",
        f"CPU: {m['cpu']}, {m['cores']} cores; Python {m['python']}; {versions}; {m['date']}.",
        f"{m['runs']} rounds; 1-min load average {load} at start-end. Medians over rounds;"
        " / bare fork: median of the per-round ratios. Memory:"
        " sample with the most worker PSS while both workers were alive (fresh process); tree ="
        " launching process + fork server + workers.",
        "",
        f"| {head} |",
        "|---|" + "---:|" * 10,
    ]
    for name, t in results["launch"].items():
        mem = results["memory"][name]
        cells = [f"{t[k]:.3f}" for k in ("median", "min", "max")]
        cells += [f"{t['per_round_ratio']:.2f}", f"{results['first'][name]['median']:.3f}"]
        keys = ("workers_pss", "workers_uss", "server_pss", "server_uss", "tree_pss")
        cells += [f"{mem[k]['median']:.0f}" if mem[k]["max"] else "" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Memory again, the workers having trained (`work`: 20 steps of a small model, then a "
        "full garbage collection) before the same sample.",
        "",
        "| variant | worker PSS MiB | worker USS MiB | server PSS MiB | server USS MiB"
        " | tree PSS MiB |",
        "|---|" + "---:|" * 5,
    ]
    for name, mem in results["trained"].items():
        cells = [f"{mem[k]['median']:.0f}" if mem[k]["max"] else "" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="rounds (each variant once per round)")
    parser.add_argument("--out", type=Path, default=None, help="write JSON here, Markdown beside")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        return child(opts.child)
    start_load = os.getloadavg()[0]
    names = [n for n, v in VARIANTS.items() if importlib.util.find_spec(v[1].split(".")[0])]
    for name in names:  # warm-up round, not recorded: imports, caches, nbaccel's server
        timed(VARIANTS[name][0])
    times, fresh_runs = {n: [] for n in names}, {n: [] for n in names}
    for i in range(opts.runs):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            times[name].append(timed(VARIANTS[name][0]))
        for name in order:
            fresh_runs[name].append(fresh(name))
        print(f"round {i + 1}/{opts.runs} done", file=sys.stderr)
    firsts = {n: [r["first"] for r in runs] for n, runs in fresh_runs.items()}
    results = {
        "machine": machine(opts.runs, start_load),
        "calls": {n: VARIANTS[n][2] for n in names},
        "launch": {
            n: summary(v) | {"per_round_ratio": ratio(v, times["bare fork"]), "all": v}
            for n, v in times.items()
        },
        "first": {n: summary(v) | {"all": v} for n, v in firsts.items()},
        **{
            part: {
                n: {k: summary([r[part][k] for r in runs]) for k in runs[0][part]}
                for n, runs in fresh_runs.items()
            }
            for part in ("memory", "trained")
        },
    }
    text = report(results)
    print(text)
    if opts.out:
        write(opts.out, results, text + "\n", indent=1)


def write(out: Path, results: dict, text: str, indent: int = 2) -> None:
    """The results as JSON at ``out`` and their table as Markdown beside it (``.md``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=indent) + "\n")
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
