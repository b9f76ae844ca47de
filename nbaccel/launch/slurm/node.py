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
the moment it happens, and returns its value cloudpickled (``protocol.Result``, as a local
worker does). ``run_node`` returns {global rank: (pid, Result)}; submitit carries it back
through the job folder.

The job folder is the only link to the notebook, and nothing listens on the network for the
notebook: torch's rendezvous store on the first node (which hosts it as torchrun does) and the
process group's own connections are the only traffic, between the nodes. Only the user can read and
write the folder (0700), and what the notebook and the nodes exchange there while the job runs is
sealed with the launch's own secret; each side drops and logs what lacks the seal (``folder.py``).
"""

from __future__ import annotations

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

from ...env import JOB_KEY_VAR, METRICS_DIR_VAR, STACKS_VAR
from .folder import error_path, heartbeat_path, read_sealed, stacks_answer, write_sealed

RENDEZVOUS_WAIT_S = 300  # for the first node's port, while SLURM starts the job's tasks
#: A node's folder of its ranks' sockets, in its temporary directory: the job step's id follows.
STACKS_PREFIX = "nbaccel-node-stacks-"
#: How often each node says it is alive (``heartbeat``), for the notebook to tell a dead node.
HEARTBEAT_S = 1.0
#: What a rank killed by a SIGKILL that neither its agent nor SLURM's cancel sent most often
#: means, and how to check it on a cluster.
KILLED_HINT = (
    "out of memory? The kernel's or SLURM's OOM killer sends SIGKILL. To check: the node's "
    "`dmesg`, or `sacct -j {job} -o JobID,State,MaxRSS` where SLURM keeps accounting; if it "
    "was memory, ask for more with SlurmCluster(mem=...) or lower the batch size"
)


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


def _endpoint(folder: Path, node_id: int):
    """``(addr:port, store)``: the first node starts the rendezvous store on a port the system
    picks (no window in which another process could take it: torch's static rendezvous finds
    this store in its process by its port) and writes ``addr:port``; the others wait for it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    path = folder / "rendezvous"
    if node_id == 0:
        wait = timedelta(seconds=RENDEZVOUS_WAIT_S)
        store = TCPStore("0.0.0.0", 0, None, True, wait, wait_for_workers=False, multi_tenant=True)
        endpoint = f"{node_address(_first_node())}:{store.port}"
        partial = folder / ".rendezvous.partial"
        partial.write_text(endpoint)
        os.replace(partial, path)
        return endpoint, store
    deadline = time.monotonic() + RENDEZVOUS_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the first node never wrote {path}")
        time.sleep(0.1)
    return path.read_text().strip(), None


def run_node(payload: bytes, nproc: int, environ: dict, folder: str) -> dict[int, tuple]:
    """This node's part of the job: its ``nproc`` workers under torch's elastic agent."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    folder = Path(folder.replace("%j", os.environ["SLURM_JOB_ID"]))  # sbatch's %j, or a step's
    node_id, nodes = int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_JOB_NUM_NODES"])
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE", os.cpu_count() or 1))
    os.environ.update(environ)
    os.environ[METRICS_DIR_VAR] = str(folder)  # each rank's records, for the notebook's view
    step = f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    sweep_stacks_dirs()  # what a SIGKILLed or cancelled step left on this node
    stacks_dir = tempfile.mkdtemp(prefix=f"{STACKS_PREFIX}{step}-")  # this node's ranks' sockets
    os.environ[STACKS_VAR] = stacks_dir
    key = bytes.fromhex(environ[JOB_KEY_VAR])
    threading.Thread(
        target=_answer_requests, args=(folder, stacks_dir, node_id, key), daemon=True
    ).start()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpus // nproc)))
    endpoint, store = _endpoint(folder, node_id)  # the store lives until the agent is done
    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id=os.environ["SLURM_JOB_ID"],
        rdzv_backend="static",  # node ranks are SLURM's: rank 0 runs on the first node
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": node_id, "timeout": RENDEZVOUS_WAIT_S},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        values = elastic_launch(config, work)(payload, str(folder))
    except ChildFailedError as failed:  # the agent's word on each failed rank
        record_deaths(folder, key, failed.failures)
        return {}
    finally:
        shutil.rmtree(stacks_dir, ignore_errors=True)
        del store
    return dict(values.values())


def record_deaths(folder: Path, key: bytes, failures: dict) -> None:
    """Write down each rank the agent saw fail that wrote no error of its own: killed by a
    signal, or gone with an exit code and no Python error. A SIGKILL is the root cause (out of
    memory, most often); a SIGTERM or SIGINT came from a stop (scancel, the job's end), so its
    rank is only a consequence (``secondary``), as a peer's lost connection is."""
    import signal

    for rank, failure in failures.items():
        if rank < 0 or error_path(folder, rank).exists():
            continue  # the rank's own words (its traceback) say more than its exit code
        code = failure.exitcode
        stopped = code in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
        if code == -signal.SIGKILL:
            message = KILLED_HINT.format(job=os.environ.get("SLURM_JOB_ID", "<job>"))
        elif stopped:
            message = "a stop: scancel, or SLURM's at the job's time limit or end"
        else:
            message = "without a Python error (a crash in native code, or os._exit)"
        report = {"rank": rank, "node": os.environ.get("SLURMD_NODENAME", socket.gethostname())}
        report |= {"pid": failure.pid, "exit_code": code, "exc_type": None, "message": message}
        report |= {"traceback": "", "secondary": stopped}
        write_sealed(error_path(folder, rank), key, report)


def sweep_stacks_dirs() -> None:
    """Remove this user's ``nbaccel-node-stacks-<job>.<step>-*`` folders whose job step SLURM no
    longer runs: a step ended by SIGKILL (or a cancel that SIGKILL finished) cannot remove its
    own. Nothing is removed when ``squeue`` cannot say which steps run."""
    done = subprocess.run(
        ["squeue", "-h", "-s", "-u", str(os.getuid()), "-o", "%i"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        return
    running = set(done.stdout.split())
    for path in Path(tempfile.gettempdir()).glob(f"{STACKS_PREFIX}*-*"):
        step = path.name[len(STACKS_PREFIX) :].rsplit("-", 1)[0]
        if step not in running and path.is_dir() and path.stat().st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def _answer_requests(folder: Path, stacks_dir: str, node_id: int, key: bytes) -> None:
    """The node's side of the job folder while the job runs. It beats (``node-<K>.alive``: a
    counter, sealed, every ``HEARTBEAT_S``), so that the notebook can tell a node that died from
    one that is busy. And it answers "where is every rank?": the notebook writes
    ``stacks.request`` (a new id each time, sealed) to the job folder; this node asks its ranks at
    their sockets, as a local launch does (``observe/stacks.py``), and writes their answers
    beside it, sealed. A request without the launch's seal is refused, and said so in the
    node's log."""
    seen, beats, last = None, 0, 0.0
    while True:
        time.sleep(0.2)
        if time.monotonic() - last >= HEARTBEAT_S:
            beats, last = beats + 1, time.monotonic()
            try:
                write_sealed(heartbeat_path(folder, node_id), key, beats)
            except OSError:
                pass  # a full or read-only folder: the notebook hears silence, and says so
        seen = answer_request(folder, stacks_dir, node_id, key, seen)


def answer_request(folder: Path, stacks_dir: str, node_id: int, key: bytes, seen: bytes | None):
    """Answer ``stacks.request`` if it is new and sealed; return what it held."""
    from ...observe.stacks import collect, socket_path

    try:
        data = (folder / "stacks.request").read_bytes()
    except OSError:
        return seen
    if not data or data == seen:
        return seen
    try:
        request = read_sealed(folder / "stacks.request", key)
    except (OSError, ValueError) as exc:  # Forged, or not JSON
        print(f"nbaccel: refused a stack request: {exc}", file=sys.stderr, flush=True)
        return data
    ranks = [int(name) for name in os.listdir(stacks_dir) if name.isdigit()]
    stacks = collect({rank: socket_path(stacks_dir, rank) for rank in ranks})
    answer = {rank: None if s is None else s.to_json().decode() for rank, s in stacks.items()}
    write_sealed(stacks_answer(folder, str(request), node_id), key, answer)
    return data


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


def work(payload: bytes, folder: str) -> tuple[int, tuple]:
    """One worker: the launched function, its value pickled, its error written down."""
    import cloudpickle

    from ...observe.rank_recorder import close_all
    from ...observe.stacks import listen_from_environ
    from ..protocol import Result, returned

    rank = int(os.environ["RANK"])
    listen_from_environ()  # answers "where are you?" (the node asks for the notebook)
    sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")
    try:
        function, args, kwargs = cloudpickle.loads(payload)
        value = function(*args, **kwargs)
        return rank, (os.getpid(), returned(value))  # as a local worker sends it
    except SystemExit as exc:
        from ..forkserver import _exit_status

        code, shown = _exit_status(exc)
        if code == 0:  # sys.exit(0): a rank that stopped early on purpose
            return rank, (os.getpid(), Result(cloudpickle.dumps(None), "NoneType", exited=True))
        _write_error(rank, folder, exc, exit_code=code, message=shown)
        raise
    except BaseException as exc:
        _write_error(rank, folder, exc)
        raise
    finally:  # the numbers of a function that did not call end_training()
        close_all()


def _write_error(
    rank: int,
    folder: str,
    exc: BaseException,
    exit_code: int | None = None,
    message: str | None = None,
) -> None:
    from ..protocol import is_collective_failure

    report = {
        "rank": rank,
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "pid": os.getpid(),
        "exit_code": exit_code,  # sys.exit(3)'s 3
        "exc_type": type(exc).__name__,
        "message": str(exc) if message is None else message,
        "traceback": traceback.format_exc(),
        "secondary": is_collective_failure(exc, str(exc)),  # a peer died: not the cause
    }
    write_sealed(error_path(Path(folder), rank), bytes.fromhex(os.environ[JOB_KEY_VAR]), report)
