"""What runs on each node of a SLURM job that ``notebook_launcher(cluster=...)`` submitted.

One SLURM task per node (``srun``, through submitit) runs ``run_node``, which starts torch's
elastic agent (``elastic_launch``, torchrun's engine) for that node's processes. The agents meet
at the rendezvous ``torchrun --node-rank`` uses (static: each agent's node rank is SLURM's node
id, so global ranks follow SLURM's node order and rank 0 runs on the job's first node), hosted
by the first node's agent on the address SLURM knows that node by (``scontrol show node``'s
NodeAddr) and a port the first node picks and writes to the job folder; the other nodes read it
there. The agent starts, watches and stops the node's workers,
gives them torchrun's variables (``RANK``, ``WORLD_SIZE``, ...), and raises torch's
``ChildFailedError`` when one fails.

Each worker (``work``) prefixes its output lines with its rank, writes its own error (rank,
node, traceback, as JSON) to the job folder before it fails, so that the notebook can name it
the moment it happens, and returns its value cloudpickled. ``run_node`` returns
{global rank: pickled value}; submitit carries it back through the job folder.

The job folder is the trusted channel: only the user can read and write it (0700), and nothing
listens on the network for the notebook. torch's own rendezvous is the only traffic between
nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from ...env import METRICS_DIR_VAR, STACKS_VAR

RENDEZVOUS_WAIT_S = 300  # for the first node's port, while SLURM starts the job's tasks


def error_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.error.json"


def node_address(name: str) -> str:
    """The address SLURM reaches node ``name`` at (NodeAddr; NodeName on most clusters)."""
    shown = subprocess.run(
        ["scontrol", "show", "node", name, "-o"], capture_output=True, text=True, check=True
    ).stdout
    fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
    return fields.get("NodeAddr") or name


def _first_node() -> str:
    names = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return names[0]


def _endpoint(folder: Path, node_id: int) -> str:
    """The first node picks a free port and writes ``addr:port``; the others wait for it."""
    path = folder / "rendezvous"
    if node_id == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        endpoint = f"{node_address(_first_node())}:{port}"
        partial = folder / ".rendezvous.partial"
        partial.write_text(endpoint)
        os.replace(partial, path)
        return endpoint
    deadline = time.monotonic() + RENDEZVOUS_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the first node never wrote {path}")
        time.sleep(0.1)
    return path.read_text().strip()


def run_node(payload: bytes, nproc: int, environ: dict, folder: str) -> dict[int, bytes]:
    """This node's part of the job: its ``nproc`` workers under torch's elastic agent."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    folder = Path(folder.replace("%j", os.environ["SLURM_JOB_ID"]))  # sbatch's %j, or a step's
    node_id, nodes = int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_JOB_NUM_NODES"])
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE", os.cpu_count() or 1))
    os.environ.update(environ)
    os.environ[METRICS_DIR_VAR] = str(folder)  # each rank's records, for the notebook's view
    stacks_dir = tempfile.mkdtemp(prefix="nbaccel-stacks-")  # this node's ranks' sockets
    os.environ[STACKS_VAR] = stacks_dir
    threading.Thread(
        target=_answer_requests, args=(folder, stacks_dir, node_id), daemon=True
    ).start()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpus // nproc)))
    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id=os.environ["SLURM_JOB_ID"],
        rdzv_backend="static",  # node ranks are SLURM's: rank 0 runs on the first node
        rdzv_endpoint=_endpoint(folder, node_id),
        rdzv_configs={"rank": node_id, "timeout": RENDEZVOUS_WAIT_S},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        values = elastic_launch(config, work)(payload, str(folder))
    except ChildFailedError:
        return {}  # each failed worker wrote its own error; the notebook reads them
    finally:
        shutil.rmtree(stacks_dir, ignore_errors=True)
    return dict(values.values())


def stacks_answer(folder: Path, request: str, node_id: int) -> Path:
    return folder / f"stacks-{request}-node{node_id}.json"


def _answer_requests(folder: Path, stacks_dir: str, node_id: int) -> None:
    """The notebook asks "where is every rank?" by writing ``stacks.request`` (a new id each
    time) to the job folder; this node asks its ranks at their sockets, as a local launch does
    (``observe/stacks.py``), and writes their answers beside it."""
    from ...observe.stacks import collect, socket_path

    answered = None
    while True:
        time.sleep(0.2)
        try:
            request = (folder / "stacks.request").read_text().strip()
        except OSError:
            continue
        if not request or request == answered:
            continue
        answered = request
        ranks = [int(name) for name in os.listdir(stacks_dir) if name.isdigit()]
        stacks = collect({rank: socket_path(stacks_dir, rank) for rank in ranks})
        data = {rank: None if s is None else s.to_json().decode() for rank, s in stacks.items()}
        path = stacks_answer(folder, request, node_id)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(data))
        os.replace(partial, path)


class _Prefixed:
    """A text stream that starts every line with ``[rank R] `` (as local launches show)."""

    def __init__(self, stream, prefix: str) -> None:
        self.stream, self.prefix, self.start = stream, prefix, True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            self.stream.write(self.prefix + piece if self.start else piece)
            self.start = piece.endswith("\n")
        if "\n" in text:
            self.stream.flush()
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def work(payload: bytes, folder: str) -> tuple[int, bytes]:
    """One worker: the launched function, its value pickled, its error written down."""
    import cloudpickle

    from ...observe.stacks import listen_from_environ

    rank = int(os.environ["RANK"])
    listen_from_environ()  # answers "where are you?" (the node asks for the notebook)
    sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")
    try:
        function, args, kwargs = cloudpickle.loads(payload)
        return rank, cloudpickle.dumps(function(*args, **kwargs))
    except BaseException as exc:
        from ..forkserver import _is_collective_failure

        report = {
            "rank": rank,
            "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
            "pid": os.getpid(),
            "exc_type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
            "secondary": _is_collective_failure(exc, str(exc)),  # a peer died: not the cause
        }
        path = error_path(Path(folder), rank)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(report))
        os.replace(partial, path)
        raise
