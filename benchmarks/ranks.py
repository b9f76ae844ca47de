"""Ranks that stay across cells, from a real Jupyter kernel: nbaccel's ``%ranks``/``%%ranks``
against ipyparallel's ``%%px`` and nbdistributed's ``%%distributed``, on 2 CPU ranks.

Timed from the client (jupyter_client): a cell's time is from sending it to its
``execute_reply``. A round starts each tool in a fresh kernel of its own, one after the other
(the first tool rotates each round): the tool's import cell, a pause (the user writing the next
cells), the start cell, a first cell on every rank. Then the tools take turns, their kernels all
up: ``--cells`` turns, in each of which every tool's kernel runs its cell once, in an order
shuffled anew each turn, so that a busy moment of a shared machine falls on all tools alike.
The median of a tool's cells in a round is its round trip, and nbaccel's over ipyparallel's,
round by round, the ratio. IPython refuses a cell magic with an empty body, so the "empty"
cell is ``pass``: ``%%ranks\\npass``, ``%%px\\npass``, ``%%distributed\\npass``. Other
programs' CPU during each round is measured (``lessonbuild.load``) and reported.

- nbaccel: ``%load_ext nbaccel`` imports the launcher, which starts the fork server in the
  kernel (``client.prestart``); the pause lets it import torch, so ``%ranks start 2 --cpu`` forks
  from a warm server. ``nbaccel, no pause`` sends the start right after ``%load_ext`` (its start
  and first cell only). The start cell returns once both ranks joined their gloo group: it is
  the ready time.
- ipyparallel: ``ipp.Cluster(n=2).start_and_connect_sync()`` (a controller and 2 engines; the
  client activates ``%px`` on all engines, blocking) returns once the engines registered. Its
  engines have not imported torch nor joined a group; a second cell does both (as nbaccel's
  ranks have), and "ready" is the two cells together.
- nbdistributed: ``%dist_init -n 2`` starts 2 ``python worker.py`` processes and returns after a
  fixed 2 s sleep, whether they are ready or not; a cell sent before a worker connected waits
  out its 30 s timeout. Its ready time is when both workers' sockets connected to the kernel's
  (this script polls them). Its ``%dist_shutdown`` and ``%dist_reset`` may run ``pkill -f`` on
  patterns (``worker.py``, ``python.*worker``) that match other programs on a shared machine, so
  this script never calls them: it ends the workers itself, by pid.

Every process below each kernel is ended by pid after the tool's stop and the kernel's shutdown
(the number each tool left behind is reported). The kernels get ``.venv/bin`` first on PATH
(nbdistributed starts ``python`` from PATH) and a temporary IPYTHONDIR (ipyparallel writes its
cluster files there).

    python benchmarks/ranks.py [--rounds 5] [--cells 50] [--pause 5] \\
        [--out benchmarks/results/ranks-cpu.json]

ipyparallel and nbdistributed come with the bench extra:
``.venv/bin/python -m pip install -c constraints.txt -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from jupyter_client.manager import start_new_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.launch import machine, machine_line, summary, write  # noqa: E402  (shared)
from lessonbuild.load import LoadMeter  # noqa: E402  (other programs' CPU during a round)

INSTALL = ".venv/bin/python -m pip install -c constraints.txt -e '.[bench]'"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in a traceback
WORKER = "nbdistributed/worker.py"  # in nbdistributed's workers' command lines

IPP_GROUP = """
import socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
rc[:].scatter("rank", [0, 1], flatten=True, block=True)
rc[:].push({"port": port}, block=True)
rc[:].execute("import torch, torch.distributed as dist\\n"
              "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}',"
              " rank=rank, world_size=2)", block=True)
"""


@dataclass(frozen=True)
class Tool:
    package: str  # where it is installed, this is importable
    load: str  # the import cell
    start: str  # the start cell
    cell: str  # the round trip's cell
    stop: str | None = None  # None: this script ends the workers by pid
    same_state: str | None = None  # a cell to nbaccel's ranks' state: torch, a gloo group


RANKS = Tool("nbaccel", "%load_ext nbaccel", "%ranks start 2 --cpu", "%%ranks\npass", "%ranks stop")
TOOLS = {
    "nbaccel": RANKS,
    "nbaccel, no pause": RANKS,
    "ipyparallel": Tool(
        "ipyparallel",
        "import ipyparallel as ipp",
        "cluster = ipp.Cluster(n=2)\nrc = cluster.start_and_connect_sync()",
        "%%px\npass",
        "cluster.stop_cluster_sync()",
        IPP_GROUP,
    ),
    "nbdistributed": Tool(
        "nbdistributed", "%load_ext nbdistributed", "%dist_init -n 2", "%%distributed\npass"
    ),
}


class Kernel:
    """A fresh kernel, cells timed from the client: send to ``execute_reply``."""

    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        self.manager, self.client = start_new_kernel(
            kernel_name="python3", cwd=cwd, env={**os.environ, **env}
        )
        self.pid = self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 120) -> tuple[float, str]:
        """Seconds from send to reply, and the cell's stdout; raise on any error."""
        began = time.perf_counter()
        msg_id = self.client.execute(code)
        while True:
            reply = self.client.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        elapsed = time.perf_counter() - began
        stdout, errors = "", []
        while True:  # the cell's outputs, up to its idle status (not timed)
            msg = self.client.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                stdout += content["text"] if content["name"] == "stdout" else ""
                if content["name"] == "stderr" and "Error" in content["text"]:
                    errors.append(content["text"])
            elif kind == "error":
                errors.append(ANSI.sub("", "\n".join(content["traceback"])))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        if reply["content"]["status"] != "ok" or errors or "Error executing" in stdout:
            raise RuntimeError(f"{code!r} failed:\n" + ("\n".join(errors) or stdout[-500:]))
        return elapsed, stdout

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).children(recursive=True)
        return []

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


def end(processes: list[psutil.Process], timeout: float = 10) -> int:
    """Wait for ``processes`` to exit; kill by pid those that do not. Returns how many were left."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=timeout)
    return len(alive)


def workers_connected(kernel: Kernel) -> bool:
    """Both nbdistributed workers hold a connection to the kernel's port (the last argument)."""
    workers = [p for p in kernel.descendants() if WORKER in " ".join(p.cmdline())]
    if len(workers) < 2:
        return False
    for worker in workers:
        port = int(worker.cmdline()[-1])
        links = worker.net_connections(kind="tcp")
        if not any(c.raddr and c.raddr.port == port and c.status == "ESTABLISHED" for c in links):
            return False
    return True


def when_connected(kernel: Kernel, began: float, done: threading.Event, out: list) -> None:
    """Append the seconds since ``began`` at which nbdistributed's workers connected."""
    while not done.is_set():
        with contextlib.suppress(psutil.Error, ValueError, IndexError):
            if workers_connected(kernel):
                out.append(time.perf_counter() - began)
                return
        time.sleep(0.005)


def server_age(kernel: Kernel) -> float | None:
    """Seconds the kernel's fork server has been running (None: it has none)."""
    for child in kernel.descendants():
        with contextlib.suppress(psutil.Error):
            if "nbaccel.launch.forkserver" in " ".join(child.cmdline()):
                return time.time() - child.create_time()
    return None


@contextlib.contextmanager
def started(name: str, pause: float) -> Iterator[tuple[Kernel, dict]]:
    """A fresh kernel whose tool started its 2 ranks and ran a first cell on them; on leaving,
    the tool stopped, the kernel shut down and every process it had ended."""
    tool = TOOLS[name]
    row: dict = {"round_trips_s": []}
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as ipython_dir:
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        kernel = Kernel(cwd, {"IPYTHONDIR": ipython_dir, "PATH": path})
        seen: set[psutil.Process] = set()
        try:
            kernel.run(tool.load)
            if name != "nbaccel, no pause":
                kernel.run(f"import time; time.sleep({pause})", timeout=pause + 60)
            if tool is RANKS:
                row["server_age_s"] = server_age(kernel)
            began, connected, done = time.perf_counter(), [], threading.Event()
            if tool.package == "nbdistributed":
                watch = (kernel, began, done, connected)
                threading.Thread(target=when_connected, args=watch, daemon=True).start()
            row["start_s"], _ = kernel.run(tool.start, timeout=300)
            row["ready_s"] = row["start_s"]
            if tool.same_state:
                row["same_state_s"], _ = kernel.run(tool.same_state, timeout=300)
                row["ready_s"] += row["same_state_s"]
            if tool.package == "nbdistributed":
                row["ready_s"] = max(row["start_s"], wait_for(connected, done))
            seen.update(kernel.descendants())
            row["first_cell_s"], _ = kernel.run(tool.cell)
            yield kernel, row
            if tool.stop and "failed" not in row:
                try:
                    kernel.run(tool.stop)
                except Exception as err:  # the kernel's shutdown and ``end`` still clean up
                    row["failed"] = f"{tool.stop!r}: {err}"
            elif not tool.stop:  # nbdistributed's own stop may pkill others' processes
                for worker in kernel.descendants():
                    with contextlib.suppress(psutil.Error):
                        worker.terminate()
        finally:
            seen.update(kernel.descendants())
            kernel.shutdown()
            row["left_after_shutdown"] = end(list(seen))  # and ended here, by pid


def one_round(names: list[str], cells: int, pause: float, seed: int) -> dict[str, dict]:
    """Each tool started in its own fresh kernel, one after the other; then ``cells`` turns in
    which every tool's kernel runs its cell once, in an order shuffled anew each turn."""
    rows: dict[str, dict] = {}
    live: dict[str, Kernel] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            try:
                if name == "nbaccel, no pause":  # its start only: the round trips are nbaccel's
                    with started(name, pause) as (_, rows[name]):
                        pass
                else:
                    live[name], rows[name] = stack.enter_context(started(name, pause))
            except Exception as err:  # said in the report; the other tools go on
                rows[name] = {"failed": str(err)}
        shuffled = random.Random(seed)
        for _ in range(cells):
            turn = list(live)
            shuffled.shuffle(turn)
            for name in turn:
                try:
                    rows[name]["round_trips_s"].append(live[name].run(TOOLS[name].cell)[0])
                except Exception as err:
                    rows[name]["failed"] = str(err)
                    del live[name]
    for row in rows.values():
        if "failed" not in row and row["round_trips_s"]:
            row["round_trip_s"] = statistics.median(row["round_trips_s"])
    return rows


def wait_for(connected: list[float], done: threading.Event, limit: float = 120) -> float:
    deadline = time.monotonic() + limit
    while not connected and time.monotonic() < deadline:
        time.sleep(0.01)
    done.set()
    if not connected:
        raise RuntimeError(f"nbdistributed's workers never connected in {limit:g} s")
    return connected[0]


def available() -> tuple[list[str], dict[str, str]]:
    """The tools that can run here, and why each other one cannot."""
    names, missing = [], {}
    for name, tool in TOOLS.items():
        if importlib.util.find_spec(tool.package) is None:
            missing[name] = f"{tool.package} is not installed here: {INSTALL}"
        else:
            names.append(name)
    return names, missing


def verdict(ratios: list[float]) -> str:
    """The target in words chosen by the per-round ratios (nbaccel over ipyparallel)."""
    median = statistics.median(ratios)
    spread = f"per-round {min(ratios):.2f}-{max(ratios):.2f}"
    if max(ratios) <= 1:
        return (f"met: an empty `%%ranks` cell takes {median:.2f} of `%%px`'s time, faster in "
                f"every round ({spread})")  # fmt: skip
    if median <= 1:
        return (f"met at the median ({median:.2f} of `%%px`'s time), not in every round "
                f"({spread})")  # fmt: skip
    return f"not met: an empty `%%ranks` cell takes {median:.2f} times `%%px`'s ({spread})"


def source_digest() -> str:
    """A digest of nbaccel's source as it is now: a working tree edited during the run would
    mix two versions in one table (the report says so)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "nbaccel").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def ok(rows: list[dict]) -> list[dict]:
    """The rounds a tool completed (a failed round holds only ``failed``)."""
    return [row for row in rows if "failed" not in row]


def spread(values: list[float], digits: int) -> str:
    s = summary(values)
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def report(results: dict) -> str:
    loads = results["load_others_cores"]
    lines = [
        "# Ranks across cells on 2 CPU ranks, from a real kernel: nbaccel, ipyparallel, "
        "nbdistributed",
        "",
        f"{machine_line(results['machine'])}; other programs kept "
        f"{min(loads):.2f}-{max(loads):.2f} cores busy per round (mean "
        f"{statistics.mean(loads):.2f}); {results['rounds']} rounds, each tool in a fresh "
        "kernel per round.",
        "",
        "Timed from the client, cell sent to `execute_reply`. Start: the start cell, after the "
        f"import cell and a {results['pause_s']:g} s pause (none for `no pause`); ready: until "
        "the ranks can run a collective. Round trip: median of "
        f"{results['cells']} cells of `pass` on both ranks after the first, the tools' cells "
        "interleaved in turns shuffled anew. Median over rounds (min-max).",
        "",
        "| tool | start cell, s | ready, s | first cell, ms | round trip, ms | left behind |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results["tools"].items():
        done = ok(rows)
        if not done:
            continue
        trips = all("round_trip_s" in r for r in done)
        lines.append(
            f"| {name} | {spread([r['start_s'] for r in done], 3)} "
            f"| {spread([r['ready_s'] for r in done], 3)} "
            f"| {spread([r['first_cell_s'] * 1e3 for r in done], 1)} "
            f"| {spread([r['round_trip_s'] * 1e3 for r in done], 2) if trips else '-'} "
            f"| {max(r['left_after_shutdown'] for r in done)} |"
        )
    lines.append("")
    ages = {n: [r["server_age_s"] for r in ok(results["tools"].get(n, []))]
            for n in ("nbaccel", "nbaccel, no pause")}  # fmt: skip
    if all(age is not None for v in ages.values() for age in v):
        lines.append(
            "nbaccel's fork server was running when the start cell was sent (started by "
            "`%load_ext nbaccel`), for "
            + "; ".join(f"{min(v):.1f}-{max(v):.1f} s ({n})" for n, v in ages.items() if v)
            + "."
        )
    before, after = results["nbaccel_source"]
    if before != after:
        lines.append(f"nbaccel's source changed during the run ({before} -> {after}).")
    for name, why in results["not_run"].items():
        lines.append(f"{name}: not run. {why}")
    for name, rows in results["tools"].items():
        for i, row in enumerate(rows):
            if "failed" in row:
                first = row["failed"].strip().splitlines()[-1]
                lines.append(f"{name} failed in round {i + 1}: `{first}` (the JSON has all).")
    if results.get("ratio") is not None:
        lines += [
            "",
            "**Target** (an empty `%%ranks` cell's round trip no slower than ipyparallel's "
            "`%%px`): nbaccel over ipyparallel, median of per-round ratios, "
            f"**{results['ratio']:.2f}**: {results['verdict']}.",
        ]
    names = [n for n in results["tools"] if n != "nbaccel, no pause"]
    lines += [
        "",
        "Per round, round-trip medians in ms:",
        "",
        "| round | " + " | ".join(names) + " | others' cores |",
        "|---:|" + "---:|" * (len(names) + 1),
    ]
    for i in range(results["rounds"]):
        rows = [results["tools"][n][i] for n in names]
        cells = ["failed" if "failed" in r else f"{r['round_trip_s'] * 1e3:.2f}" for r in rows]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + f" | {loads[i]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", type=int, default=50)
    parser.add_argument("--pause", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ranks-cpu.json"))
    args = parser.parse_args()
    names, missing = available()
    for name, why in missing.items():
        print(f"{name}: skipped. {why}", file=sys.stderr)
    start_load, source = os.getloadavg()[0], source_digest()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    loads = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        with LoadMeter(interval=1.0) as meter:
            rows = one_round(order, args.cells, args.pause, seed=r)
        loads.append(meter.load.others)
        for name in names:
            got = rows[name]
            runs[name].append(got)
            said = (f"FAILED: {got['failed']}" if "failed" in got else
                    f"start {got['start_s']:.3f} s, ready {got['ready_s']:.3f} s" +
                    (f", round trip {got['round_trip_s'] * 1e3:.2f} ms" if "round_trip_s" in got
                     else ""))  # fmt: skip
            print(f"round {r + 1}: {name}: {said}", file=sys.stderr, flush=True)
    m = machine(args.rounds, start_load)
    m.pop("hold_s", None)  # launch.py's own setting
    for package in ("ipyparallel", "nbdistributed", "ipykernel", "jupyter_client"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            m["versions"][package] = importlib.metadata.version(package)
    results = {
        "machine": m,
        "rounds": args.rounds,
        "cells": args.cells,
        "pause_s": args.pause,
        "load_others_cores": loads,
        "cells_sent": {name: asdict(tool) for name, tool in TOOLS.items()},
        "not_run": missing,
        "nbaccel_source": [source, source_digest()],  # before and after: equal unless edited
        "tools": runs,
    }
    if "ipyparallel" in runs:  # paired round by round: seconds apart, under the same load
        both = zip(runs["nbaccel"], runs["ipyparallel"], strict=True)
        ratios = [a["round_trip_s"] / b["round_trip_s"] for a, b in both
                  if "failed" not in a and "failed" not in b]  # fmt: skip
        if ratios:
            results["ratios"] = ratios
            results["ratio"] = statistics.median(ratios)
            results["verdict"] = verdict(ratios)
    write(args.out, results, report(results))
    print(report(results))
    left = psutil.Process().children(recursive=True)
    if left:
        print(f"still running below this script: {[p.pid for p in left]}", file=sys.stderr)
    if any("failed" in row for rows in runs.values() for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
