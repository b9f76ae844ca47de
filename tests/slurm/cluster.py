"""A real two-node SLURM cluster on this one machine, for the tests (Debian 12's packages).

``start()`` writes a slurm.conf of its own into a fresh folder (nodes n1 and n2, each with its
own port, spool folder and pid file, 2 CPUs each) and starts one supervisor process, which runs
munge (its own, on a socket in that folder: another cluster's munge or a system one cannot
come and go under it), slurmctld and one slurmd per node in the foreground as its children; it
waits until ``sinfo`` shows both nodes idle. The supervisor is a child subreaper (Linux's
PR_SET_CHILD_SUBREAPER), so the job steps' processes that slurmd leaves behind become its
children too: ``Cluster.stop()`` cancels what is still queued, then ends the supervisor by its
pid, which ends and reaps every process below it. Nothing here writes to /etc: commands find
the configuration (and munge's socket) through ``SLURM_CONF``, which ``Cluster.env`` holds.

Only root can run it (slurmd and munge need it), as CI does; ``make test`` installs the packages
as root (``make slurm``). Elsewhere ``why_not()`` says how to get it.

``python tests/slurm/cluster.py`` starts one and keeps it until Enter is pressed (to try the
cluster path by hand from a notebook started with the printed ``SLURM_CONF``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = "slurmctld slurmd slurm-client munge"
NODES = ("n1", "n2")
CPUS_PER_NODE = 2
#: How long slurmctld waits for a silent slurmd before it marks the node DOWN (a real cluster's
#: default is 300 s; the dead-node tests kill one, and it need not take that long).
SLURMD_TIMEOUT_S = 20
COMMANDS = ("sbatch", "squeue", "scancel", "srun", "slurmctld", "slurmd", "munged")


def why_not() -> str | None:
    """Why this machine cannot run the test cluster, or None when it can."""
    missing = [c for c in COMMANDS if not shutil.which(c, path=os.environ["PATH"] + ":/usr/sbin")]
    if missing:
        return (
            f"no SLURM here ({', '.join(missing)} missing): as root, `make slurm` or "
            f"`apt-get install -y --no-install-recommends {PACKAGES}` installs it"
        )
    if os.geteuid() != 0:
        return "the test cluster's daemons (slurmd, munged) need root: run `make test` as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(folder: Path, host: str, ports: dict) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={CPUS_PER_NODE} "
        f"RealMemory=4000 Port={ports[n]}"
        for n in NODES
    )
    return f"""\
ClusterName=nbaccel-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports["ctld"]}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ReturnToService=2
MinJobAge=600
KillWait=5
SlurmdTimeout={SLURMD_TIMEOUT_S}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    folder: Path
    env: dict  # SLURM_CONF and PATH for the cluster's commands
    supervisor: subprocess.Popen | None = None

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            command,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def queue(self) -> list[str]:
        """Job ids still in the queue (pending, running or completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def drained(self, timeout: float = 60) -> bool:
        """Whether the queue is empty, or empties within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.queue() and time.monotonic() < deadline:
            time.sleep(0.5)
        return not self.queue()

    def kill_node(self, name: str) -> list[int]:
        """What a node's power cut does to the test cluster: node ``name``'s slurmd, its job
        steps' slurmstepd and every task process on it (those whose environment says
        ``SLURMD_NODENAME=name`` and this cluster's ``SLURM_CONF``, and all below them) stop at
        once (SIGSTOP: none of them can react to another's death, as slurmstepd's tasks would),
        then die (SIGKILL). Returns the pids killed."""
        import psutil

        marks = {"SLURMD_NODENAME": name, "SLURM_CONF": self.env["SLURM_CONF"]}
        found = {psutil.Process(int((self.folder / f"slurmd-{name}.pid").read_text()))}
        for process in psutil.process_iter():
            try:
                environ = process.environ()
                if all(environ.get(k) == v for k, v in marks.items()):  # this cluster's node
                    found |= {process, *process.children(recursive=True)}
                    parent = process.parent()
                    if parent is not None and parent.name() == "slurmstepd":
                        found.add(parent)
            except psutil.Error:
                continue
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for process in found:
                with contextlib.suppress(psutil.Error):
                    process.send_signal(sig)
        return sorted(p.pid for p in found)

    def revive(self, name: str, timeout: float = 120) -> None:
        """Start node ``name``'s slurmd again (the supervisor does: it owns the daemons) and
        wait until SLURM has it idle again. First the node is marked down, as SLURM does after
        ``SlurmdTimeout`` and an administrator does at once: that frees what the dead node's
        job held (without it, a slurmd back within seconds can leave its CPUs counted as used,
        "mix" with no job), and ``ReturnToService=2`` returns the node when it registers."""
        self.run("scontrol", "update", f"nodename={name}", "state=down", "reason=test-killed")
        (self.folder / f"revive-{name}").touch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            node = self.run("scontrol", "show", "node", name, "-o", check=False).stdout
            shown = dict(f.split("=", 1) for f in node.split() if "=" in f).get("State")
            if shown == "IDLE" and not self.job_processes():
                return
            time.sleep(0.5)
        queue = self.run("squeue", "-h", "-o", "%i %T %N %r", check=False).stdout
        log = self.run("scontrol", "show", "node", name, check=False).stdout
        log += (self.folder / "slurmctld.log").read_text(errors="replace")[-2500:]
        raise RuntimeError(f"node {name} did not come back: SLURM says {shown!r}, job "
                           f"processes {self.job_processes()}; queue: "
                           f"{queue!r}; the node and slurmctld's log:\n{log}")  # fmt: skip

    def job_processes(self) -> list:
        """The processes of jobs below the cluster's daemons (a killed node's job ends on the
        other node only once its srun notices)."""
        import psutil

        daemons = ("slurmctld", "slurmscriptd", "slurmd", "munged", "runuser")
        below = psutil.Process(self.supervisor.pid).children(recursive=True)
        return [p for p in below if _name(p) not in daemons]

    def stop(self) -> None:
        if self.supervisor is None:
            return
        if self.supervisor.poll() is None:
            ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if ids:
                self.run("scancel", *ids, check=False)
            self.supervisor.send_signal(signal.SIGTERM)
            try:
                self.supervisor.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.supervisor.kill()
                self.supervisor.wait()
        self.supervisor = None
        shutil.rmtree(self.folder, ignore_errors=True)


_shared: list[tuple[Cluster, str | None]] = []  # the session's cluster, SLURM_CONF before it
_failed: list[str] = []  # why the session's cluster did not start, once it failed


def shared() -> Cluster:
    """The session's one cluster (the cluster tests and lesson 5 share it): started on first
    use, with ``SLURM_CONF`` pointing at it in this process and the kernels started after. A
    start that failed is not tried again in the session (each lesson cell would wait for it):
    the same RuntimeError is raised."""
    if _failed:
        raise RuntimeError(_failed[0])
    if not _shared:
        try:
            cluster = start()
        except Exception as e:
            _failed.append(f"the test cluster did not start: {e}")
            raise RuntimeError(_failed[0]) from e
        _shared.append((cluster, os.environ.get("SLURM_CONF")))
        os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    return _shared[0][0]


def stop_shared() -> None:
    """Stop the session's cluster, if one started, and put ``SLURM_CONF`` back."""
    if _shared:
        cluster, before = _shared.pop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()


def start(timeout: float = 120) -> Cluster:
    """Start the cluster; return once both nodes are idle."""
    if reason := why_not():
        raise RuntimeError(reason)
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-slurm-"))
    host = socket.gethostname()
    ports = {"ctld": _free_port(), **{n: _free_port() for n in NODES}}
    (folder / "state").mkdir()
    for n in NODES:
        (folder / "spool" / n).mkdir(parents=True)
    folder.chmod(0o711)  # munge's own user reaches its folder below
    (folder / "munge").mkdir()
    (folder / "munge").chmod(0o711)  # munged wants its socket's folder reachable by all
    shutil.chown(folder / "munge", "munge", "munge")
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, host, ports))
    env = {"SLURM_CONF": str(conf), "PATH": os.environ["PATH"] + ":/usr/sbin"}
    cluster = Cluster(folder, env)
    log = open(folder / "supervisor.log", "wb")  # noqa: SIM115 (the child keeps it)
    cluster.supervisor = subprocess.Popen(
        [sys.executable, __file__, "--supervise"],
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if cluster.supervisor.poll() is not None:
                break
            states = cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.split()
            if states.count("idle") == len(NODES):
                return cluster
            time.sleep(0.3)
        states = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        logs = [f"sinfo: {states.stdout or states.stderr}"]
        for name in ("supervisor.log", "slurmctld.log", *(f"slurmd-{n}.log" for n in NODES)):
            path = folder / name
            text = path.read_text(errors="replace") if path.exists() else "(none)"
            logs.append(f"--- {name}:\n{text[-1500:]}")
        raise RuntimeError("the test cluster did not start:\n" + "\n".join(logs))
    except BaseException:
        cluster.stop()
        raise


def _supervise() -> None:
    """The supervisor: the daemons in the foreground as children, every orphan below reaped."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    folder = Path(os.environ["SLURM_CONF"]).parent
    munge = folder / "munge"  # this cluster's own munged, on a socket of its own
    socket_path = munge / "munge.sock"
    files = {"socket": socket_path, "pid-file": munge / "munged.pid"}
    files |= {"log-file": munge / "munged.log", "seed-file": munge / "munged.seed"}
    command = ["runuser", "-u", "munge", "--", "munged", "-F"]
    command += [f"--{option}={path}" for option, path in files.items()]
    daemons = [subprocess.Popen(command)]
    for _ in range(200):  # its socket, before slurmctld asks munge for a credential
        if socket_path.exists():
            break
        time.sleep(0.05)
    daemons.append(subprocess.Popen(["slurmctld", "-D"]))
    daemons += [subprocess.Popen(["slurmd", "-D", "-N", n]) for n in NODES]
    while not stopping:
        time.sleep(0.2)
        for revive in folder.glob("revive-*"):  # Cluster.revive: a killed node's slurmd again
            revive.unlink()
            daemons.append(subprocess.Popen(["slurmd", "-D", "-N", revive.name[len("revive-") :]]))
        try:  # reap orphans (job steps) as they end
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            break
    for d in reversed(daemons):
        d.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while True:  # every descendant, daemons and orphans, ended and reaped
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0 and time.monotonic() > deadline:
            for child in _children():
                os.kill(child, signal.SIGKILL)
        if pid == 0:
            time.sleep(0.05)


def _name(process) -> str:
    try:
        return process.name()
    except Exception:  # gone meanwhile
        return "slurmd"


def _children() -> list[int]:
    me = str(os.getpid())
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            found.append(int(stat.parent.name))
    return found


if __name__ == "__main__":
    if sys.argv[1:] == ["--supervise"]:
        _supervise()
    else:
        c = start()
        print(f"two nodes up; export SLURM_CONF={c.env['SLURM_CONF']}")
        try:
            input("Enter stops the cluster ")
        finally:
            c.stop()
