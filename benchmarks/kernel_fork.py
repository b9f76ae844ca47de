"""What would forking the worker server from the kernel save? A measurement for a decision.

nbaccel's fork server is a fresh interpreter that imports torch itself (``forkserver.py``), so
its heap is its own: the tree of a notebook's launch (kernel, server, 2 idle workers) held 429
MiB (PSS) against 186 for a bare fork of the kernel (``results/launch-cpu.md``); issue 36 asks
for 250. The only way to share the kernel's torch with the server is to fork the server from
the kernel while the kernel is still safe to fork: before it has run parallel work (a forked
OpenMP pool deadlocks the children, checked here: ``DESIGN.md``) or touched CUDA.

This script measures that design without building it. Each round, in two fresh processes
standing in for a kernel that imported torch and nbaccel (the order alternating):

- "server from a fresh interpreter" (nbaccel as it is): a launch of ``launch.py``'s job on 2
  CPU workers that hold 1 s, its tree sampled while both are alive;
- "server forked from the kernel" (the prototype): the process forks a server that ignores
  SIGINT, freezes what it inherited (``gc.freeze``), imports what nbaccel's server preloads
  (``torch._dynamo`` the largest) and freezes again; the server forks 2 workers running the same
  job through ``torch.distributed``.

Then, in each process, the kernel trains (``launch.work``: 20 steps of a small model and a full
garbage collection, in the kernel itself), and the same launch runs again through the same
server: the pages the kernel wrote since the fork are no longer shared.

    python benchmarks/kernel_fork.py [--rounds 3] [--out benchmarks/results/kernel-fork-cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import launch

VARIANTS = ("server from a fresh interpreter", "server forked from the kernel")


def tree(run) -> float:
    """The largest PSS (MiB) of this process and all its descendants while there are 3 of them
    (the server and 2 workers)."""
    samples, done, me = [], threading.Event(), psutil.Process()

    def sample() -> None:
        while not done.wait(0.05):
            with contextlib.suppress(psutil.Error):
                them = me.children(recursive=True)
                if len(them) == 3:
                    pss = [p.memory_full_info().pss for p in [me, *them]]
                    samples.append(sum(pss) / 2**20)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with launch.isolated():
            run()
    finally:
        done.set()
        sampler.join()
    if not samples:
        raise RuntimeError("no sample saw the server and 2 workers alive")
    return max(samples)


class ForkedServer:
    """The prototype: a server forked from this process, forking workers on request."""

    def __init__(self) -> None:
        requests, self.requests = os.pipe()  # the server reads ports; this process writes
        self.replies, replies = os.pipe()  # the server says each launch ended
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.close(self.requests)
                os.close(self.replies)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                gc.freeze()  # inherited objects: never visited by the server's collections
                self._preload()  # after the fork: the kernel's import cell does not wait
                gc.freeze()
                self._serve(requests, replies)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(requests)
        os.close(replies)

    @staticmethod
    def _preload() -> None:
        """What nbaccel's server imports (``forkserver.serve``)."""
        import cloudpickle  # noqa: F401
        import torch._dynamo
        import torch.distributed  # noqa: F401

        import nbaccel.accelerator.accelerator  # noqa: F401

    @staticmethod
    def _serve(requests: int, replies: int) -> None:
        while data := os.read(requests, 64):
            port = int(data)
            pids = []
            for rank in range(2):
                pid = os.fork()
                if pid == 0:
                    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                    try:
                        launch.fork_job(rank, launch.HOLD, False)
                    finally:
                        os._exit(0)
                pids.append(pid)
            for pid in pids:
                os.waitpid(pid, 0)
            os.write(replies, b"x")

    def launch(self) -> None:
        os.write(self.requests, str(launch.free_port()).encode())
        if os.read(self.replies, 1) != b"x":
            raise RuntimeError("the forked server ended")

    def close(self) -> None:
        os.close(self.requests)  # the server reads the end and exits
        os.waitpid(self.pid, 0)
        os.close(self.replies)


def child(name: str) -> None:
    """One fresh process: the tree idle, then after the kernel trained."""
    import torch  # noqa: F401

    import nbaccel  # noqa: F401  # as the notebook has, before it launches

    if name == VARIANTS[0]:
        run, close = (lambda: launch.run_nbaccel(launch.HOLD)), (lambda: None)
    else:
        server = ForkedServer()
        run, close = server.launch, server.close
    idle = tree(run)
    launch.work()  # the kernel trains, then collects its garbage
    trained = tree(run)
    close()
    print(json.dumps({"idle": idle, "kernel trained": trained}))


def fresh(name: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", name], capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# The tree's memory if the worker server were forked from the kernel, on CPU",
        "",
        f"{launch.machine_line(m)}; {results['rounds']} rounds, each variant in a fresh "
        "process, alternating.",
        "",
        "PSS (MiB) of the launching process, the server and 2 idle workers of `launch.py`'s job, "
        "the largest sample while all were alive. Median (min-max) over rounds.",
        "",
        "| variant | tree PSS, idle kernel | tree PSS, after the kernel trained |",
        "|---|---:|---:|",
    ]
    for name, r in results["variants"].items():
        cells = [
            f"{r[k]['median']:.0f} ({r[k]['min']:.0f}-{r[k]['max']:.0f})"
            for k in ("idle", "kernel trained")
        ]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernel-fork-cpu.json"))
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    start_load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            runs[name].append(fresh(name))
            print(f"round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    results = {
        "machine": launch.machine(args.rounds, start_load),
        "rounds": args.rounds,
        "variants": {
            name: {key: launch.summary([x[key] for x in xs]) for key in ("idle", "kernel trained")}
            | {"all": xs}
            for name, xs in runs.items()
        },
    }
    launch.write(args.out, results, report(results))
    print(report(results))


if __name__ == "__main__":
    main()
