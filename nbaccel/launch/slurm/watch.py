"""One SLURM job (or job step) watched from the notebook, from the queue to its verdict.

Each poll (``POLL_S``) asks the queue for the job's state, relays the ranks' output and
records, and reads what went wrong, from three sources, the first the surest:

- a rank's own error (``rank-<r>.error.json``, written by the rank as it fails);
- its node agent's word on a rank that died without one: killed by a signal, or gone with an
  exit code (``node.record_deaths``);
- silence: a node whose heartbeat (``node-<K>.alive``) stopped, while SLURM reports that node
  not responding or a peer's collective lost its connection. Its ranks are lost with it.

A peer's "connection reset" is a consequence, never the culprit (``errors.by_priority``): once
a root cause is known the cell ends after ``GRACE_S`` (for the others' words); with only
consequences known, the watch waits up to ``CAUSE_S`` for the cause, and says what it has.
Then the job is stopped (``queue.cancel``) and the cell says truly what the queue shows.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from ... import errors
from ...errors import RankFailure, by_priority, root_cause_report
from . import queue
from .folder import JobFolder, heartbeat_path, stacks_answer, write_sealed

#: After a root cause is known, how long the other ranks get to say theirs before the stop
#: (what they write after it is read too, before the cell says who failed).
GRACE_S = 1.0
#: With only consequences known (a lost connection), how long to wait for the cause.
CAUSE_S = 15.0
#: A node's heartbeat unchanged this long is silence (it beats every second): its ranks are
#: lost (with a peer's lost connection, or SLURM's word); unchanged ``QUIET_S``, the node is
#: not asked where its ranks are, nor waited for when the job is stopped.
SILENT_S, QUIET_S = 8.0, 3.0
#: How often the nodes' states are asked (``sinfo``), once the job runs.
NODES_S = 2.0
#: How long the notebook waits for every live node's answer to "where are your ranks?" (each
#: node polls the job folder every 0.2 s; a shared filesystem may take a moment more).
ASK_S = 5.0


class Watch:
    """One job (or job step) from the queue to its end: its state shown, its output relayed,
    its errors read, its values back."""

    def __init__(
        self,
        job,
        folder: Path,
        key: bytes,
        step=None,
        run=None,
        view=None,
        nodes: int = 1,
        nproc: int = 1,
    ) -> None:
        self.job, self.folder, self.key, self.step = job, folder, key, step
        self.run, self.view, self.nodes, self.nproc = run, view, nodes, nproc
        self.world_size = nodes * nproc
        self.id = str(job.job_id)
        self.name = f"a job step in SLURM allocation {self.id}" if step else f"SLURM job {self.id}"
        self.shown_state = None
        logs = [Path(job.task(i).paths.stdout) for i in range(nodes)]
        self.files = JobFolder(folder, key, self.name, logs=logs)
        self.ran = False  # the job reached RUNNING: its ranks can be asked where they are
        self.node_list, self.names = "", []  # SLURM's node list, and its names in node order
        self.beats: dict[int, tuple[bytes, float]] = {}  # node: (last heartbeat, seen at)
        self.lost: dict[int, RankFailure] = {}  # ranks lost with their node
        self.unreachable: dict[str, str] = {}  # nodes SLURM cannot reach: their state
        self.asked_nodes_at = 0.0
        self.stopped: tuple[str, str] | None = None  # the queue after this launch's stop

    def _status(self) -> tuple[str, str, str]:
        if self.step is None:
            return queue.state(self.id)
        nodes = os.environ.get("SLURM_JOB_NODELIST", "")
        return ("RUNNING", "", nodes) if self.step.poll() is None else ("GONE", "", "")

    def cancel(self) -> None:
        """Stop the job (or the step: srun forwards SIGTERM to its tasks) and keep what the
        queue showed after (``said_after_stop``)."""
        if self.stopped is not None:
            return
        if self.step is not None:
            import subprocess

            if self.step.poll() is None:
                self.step.terminate()
                try:
                    self.step.wait(timeout=queue.TERM_S + queue.GONE_S)
                except subprocess.TimeoutExpired:
                    self.step.kill()
                    self.step.wait()
            self.stopped = ("GONE", "")
            return
        self.stopped = queue.cancel(self.id, patient=not self.quiet())

    def quiet(self, seconds: float = QUIET_S) -> list[str]:
        """The job's nodes not heard from for ``seconds`` (their heartbeat read now), or that
        SLURM cannot reach, or whose ranks were lost."""
        if not self.ran or self.step is not None:
            return []
        now = self._hear()
        names = {f.node for f in self.lost.values()} | set(self.unreachable)
        for node, name in enumerate(self.names):
            heard = self.beats.get(node)
            if heard is not None and now - heard[1] >= seconds:
                names.add(name)
        return sorted(names)

    def said_after_stop(self) -> str:
        """What the queue showed after this launch's stop, in one sentence."""
        if self.stopped is None or self.stopped[0] not in queue.ACTIVE:
            return f"{self.name} was cancelled."
        return queue.still_queued(self.id, *self.stopped, self.quiet()) + "."

    def until_done(self, timeout: float | None) -> None:
        started = time.monotonic()
        cause_at = consequence_at = None
        while True:
            state, reason, nodes = self._status()
            if state == "RUNNING" and not self.ran:
                self.ran, self.node_list = True, nodes
                self.names = queue.hostnames(nodes) if self.step is None else []
            self._show_state(state, reason, nodes)
            self.files.relay(self.run, self.view)
            if state not in queue.ACTIVE:
                break
            if state == "PENDING" and reason in queue.NEVER_STARTS:
                self.cancel()
                raise errors.LaunchError(queue.never_starts(self.id, reason), run=self.run)
            failures = self.failures()
            now = time.monotonic()
            if any(not f.secondary for f in failures):
                cause_at = cause_at or now
            elif failures:
                consequence_at = consequence_at or now
            if (cause_at and now - cause_at > GRACE_S) or (
                consequence_at and now - consequence_at > CAUSE_S
            ):
                self.cancel()  # the others stay blocked on the failed rank, or wait in vain
                break
            if timeout is not None and now - started > timeout:
                self._timed_out(timeout, reason)
            time.sleep(queue.POLL_S)
        # The loop ends once the job left ACTIVE (COMPLETING included: its nodes are let go),
        # the step's srun exited, or this launch stopped it (the cell says what remains).
        self.files.relay(self.run, self.view)

    def _timed_out(self, timeout: float, reason: str) -> None:
        where = self.where()  # before the ranks are stopped (None: it never ran)
        self.cancel()
        self.files.relay(self.run, self.view)
        gone = self.stopped[0] not in queue.ACTIVE
        ended = " and was cancelled" if gone else f"; {self.said_after_stop()}"
        if not self.ran:
            why = reason if reason and reason != "None" else "queued"
            raise errors.LaunchError(
                f"{self.name} did not start within timeout={timeout:g} s{ended}: it waited in "
                f"the queue ({why}) and never ran",
                run=self.run,
            )
        said = f"{self.name} did not finish within timeout={timeout:g} s{ended}"
        said += f". {where}" if where is not None else ""
        stacks = where.stacks if where is not None else {}
        raise errors.LaunchError(f"{said}\n\nIts logs: {self.folder}", run=self.run, stacks=stacks)

    def failures(self) -> list[RankFailure]:
        """Every rank's failure known now, the root cause first: the ranks' own and their
        agents' words, and the ranks of nodes gone silent (``_listen``)."""
        found = self.files.failures()
        if self.ran and self.step is None:
            self._listen(any(f.secondary for f in found))
        told = {f.rank for f in found}
        found += [f for rank, f in self.lost.items() if rank not in told]
        return by_priority(found, [f.rank for f in found])

    def _listen(self, peer_lost: bool) -> None:
        """Mark the ranks of a node lost when its heartbeat is silent and either SLURM cannot
        reach it or a peer lost its connection to it."""
        now = self._hear()
        if now - self.asked_nodes_at > NODES_S:
            self.asked_nodes_at = now
            self.unreachable = queue.unreachable(self.node_list)
        for node, name in enumerate(self.names):
            heard = self.beats.get(node)
            silent = now - heard[1] if heard else None
            done = self.job.task(node).paths.result_pickle.exists()  # its task returned
            if silent is None or silent < SILENT_S or done:
                continue
            if name not in self.unreachable and not peer_lost:
                continue
            said = self.unreachable.get(name)
            why = (
                f"SLURM reports {name} {said}"
                if said
                else "its peers lost their connections to it, and SLURM has not marked it "
                "unresponsive (yet): the node died, or the task on it was killed (by memory, "
                "most often)"
            )
            said = f"went silent with its node: nothing was heard from {name} for {silent:.0f} s"
            for rank in range(node * self.nproc, (node + 1) * self.nproc):
                failure = RankFailure(rank=rank, node=name, message=f"{said}; {why}")
                self.lost.setdefault(rank, failure)

    def _hear(self) -> float:
        """Read each node's heartbeat; note when it last changed (the notebook's own clock,
        so the nodes' clocks do not matter). Returns now."""
        now = time.monotonic()
        for node in range(self.nodes):
            try:
                beat = heartbeat_path(self.folder, node).read_bytes()
            except OSError:
                beat = b""
            if beat and beat != self.beats.get(node, (b"", 0.0))[0]:
                self.beats[node] = (beat, now)
        return now

    def where(self):
        """Where every rank is (``hang.Report``), asked through the job folder: each node asks
        its own ranks at their sockets (``node.py``). None before the job ran."""
        if not self.ran:
            return None
        import uuid

        from ...observe.hang import report
        from ...observe.stacks import RankStack

        request = uuid.uuid4().hex[:12]
        write_sealed(self.folder / "stacks.request", self.key, request)
        quiet = self.quiet()
        live = [n for n in range(self.nodes) if n >= len(self.names) or self.names[n] not in quiet]
        answers = [stacks_answer(self.folder, request, n) for n in live]
        deadline = time.monotonic() + ASK_S
        while not all(p.exists() for p in answers) and time.monotonic() < deadline:
            time.sleep(0.1)
        stacks = {
            rank: None if text is None else RankStack.from_json(text.encode())
            for rank, text in self.files.answers(answers).items()
        }
        return report(stacks, list(range(self.world_size)), [], self.run)

    def _show_state(self, state: str, reason: str, nodes: str) -> None:
        if state == "PENDING":
            why = reason if reason and reason != "None" else "queued"
            line = f"{self.name}: pending ({why})"
        elif state == "RUNNING":
            line = f"{self.name}: running on {nodes}"
        else:
            return
        if line != self.shown_state:
            print(line, file=sys.stderr, flush=True)
            self.shown_state = line

    def outcome(self, return_all: bool) -> list[Any]:
        from types import SimpleNamespace

        from ..results import collect

        run = self.run
        failures = self.failures()
        tasks = [self.job.task(i) for i in range(self.nodes)]
        missing = [t for t in tasks if not t.paths.result_pickle.exists()]
        fields = queue.final(self.id) if self.step is None else {}
        state = fields.get("JobState", "UNKNOWN")
        # SLURM ended it (its time limit, a cancel from outside, a node failure): the ranks'
        # signals and lost connections are what SLURM's stop did, so SLURM's word comes first
        by_slurm = state in queue.ENDED_BY_SLURM or (state == "CANCELLED" and not self.stopped)
        if failures and not (by_slurm and all(f.secondary for f in failures)):
            if run is not None:
                run.failures = failures
            report = root_cause_report(failures, set(), [])
            after = f"\n\n{self.said_after_stop()}" if self.stopped else ""
            raise errors.LaunchError(
                f"{report}{after}\n\nThe job's logs: {self.folder}", failures, run
            )
        if self.step is None and (missing or by_slurm):
            raise errors.LaunchError(self.ended_by_slurm(state, fields, bool(missing)), run=run)
        if self.step is not None and missing:
            raise errors.LaunchError(self.step_failed(), run=run)
        values: dict[int, tuple] = {}
        for i, task in enumerate(tasks):
            try:
                values.update(task.result())
            except Exception as exc:  # the node's own task failed, outside the function
                raise errors.LaunchError(
                    f"{self.name}: node task {i} failed before or after its ranks ran "
                    f"({state}):\n{exc}",
                    run=run,
                ) from None
        if len(values) != self.world_size:
            raise errors.LaunchError(
                f"{self.name} returned {len(values)} of {self.world_size} ranks' values; see "
                f"{self.folder}",
                run=run,
            )
        ranks = [
            SimpleNamespace(rank=r, pid=values[r][0], result=values[r][1]) for r in sorted(values)
        ]
        return collect(ranks, return_all, run if run is not None else SimpleNamespace())

    def ended_by_slurm(self, state: str, fields: dict, missing: bool) -> str:
        """Why a job ended without every node's value, from SLURM's final state."""
        job, limit, logs = self.id, fields.get("TimeLimit", "?"), self.folder
        ran = self.ran or fields.get("NodeList", "(null)") not in ("", "(null)", "None")
        if state == "CANCELLED" and self.stopped is None:
            nodes = self.node_list or fields.get("NodeList")
            when = f"while it ran on {nodes}" if ran else "before it started"
            return (
                f"SLURM job {job} was cancelled from outside this launch (scancel, or an "
                f"administrator) {when}; its logs: {logs}"
            )
        if state == "TIMEOUT":
            return (
                f"SLURM stopped job {job} at its time limit ({limit}): give SlurmCluster("
                f"time=...) more minutes; its logs: {logs}"
            )
        if state == "OUT_OF_MEMORY":
            return (
                f"SLURM killed job {job} for using more memory than it asked for: ask for more "
                f"with SlurmCluster(mem='32G'); its logs: {logs}"
            )
        if missing and ran and not any(p.exists() for p in self.files.logs):
            return (
                f"SLURM job {job} ran on {self.node_list or fields.get('NodeList')} and ended "
                f"({state}) without writing to {logs}: the nodes cannot see that folder; give "
                "SlurmCluster(folder=...) a folder on a filesystem every node mounts (your home "
                "or the cluster's scratch)"
            )
        started = "" if ran else " before it started"
        return (
            f"SLURM job {job} ended ({state}, {fields.get('Reason', 'no reason given')})"
            f"{started} before every node returned; its logs: {logs}"
        )

    def step_failed(self) -> str:
        """Why a job step ended without every node's value: srun's own words first."""
        said = (self.folder / "srun.err").read_text(errors="replace") if self.step else ""
        errors = [line for line in said.splitlines() if "error" in line.lower()]
        if errors:
            return f"{self.name} did not run: {errors[-1].strip()}; its logs: {self.folder}"
        if not any(p.exists() for p in self.files.logs):
            return (
                f"{self.name} ended without writing to {self.folder}: the nodes cannot see "
                "that folder; give SlurmCluster(folder=...) a folder on a filesystem every node "
                "mounts (your home or the cluster's scratch)"
            )
        return f"{self.name} ended before every node returned; its logs: {self.folder}"
