"""The job folder, the cluster path's one channel between the notebook and the nodes.

``folder/<job id>-<launch tag>`` is created readable and writable by the user alone (0700).
Besides submitit's files (the batch script, the pickled call, each node task's log and
result), the launch's processes exchange these there while the job runs:

- ``metrics-<rank>.bin``: each rank's records, appended batch by batch (``observe/channel.py``);
- ``rank-<rank>.error.json``: a failed rank's error (rank, node, traceback), or its node
  agent's word on a rank that died without one (killed by a signal);
- ``node-<K>.alive``: node K's heartbeat, a counter it rewrites every second;
- ``stacks.request`` and ``stacks-<request>-node<K>.json``: "where is every rank?" and each
  node's answer;
- ``rendezvous``: the first node's ``addr:port``, which the other nodes read.

Each of the first four is JSON sealed with the launch's own secret (``channel.seal``: an
HMAC-SHA256 under ``NBACCEL_JOB_KEY``, made by the notebook for this launch and carried to the
nodes inside submitit's pickled call in this folder). The reader drops what lacks the seal and
logs it: a file written by something other than this launch's processes (or left by another
launch) adds nothing and is never unpickled. The values and the call are submitit's pickles,
trusted as the folder is.

``JobFolder`` is the notebook's reader: it relays the ranks' output lines and records, and
reads their errors. It prints lines from this job's own task logs alone (``logs``), so a file
named like a log adds no line to a rank's output; and an entry that cannot be read as a file
(a directory named like an error file) is refused like a forged one, never a crash of the
watch that would cancel a healthy job.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from ...errors import RankFailure, by_priority
from ...observe.channel import decode_sealed, read_frames, seal, unseal

logger = logging.getLogger(__name__)

#: A record this far ahead of the notebook's clock says a node's clock is off (a record is at
#: most a poll old when read, so a clock behind cannot be told from a slow filesystem as surely).
SKEW_S = 1.0


class Forged(ValueError):
    """A file in the job folder that this launch's processes did not write."""


def error_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.error.json"


def heartbeat_path(folder: Path, node_id: int) -> Path:
    return Path(folder) / f"node-{node_id}.alive"


def stacks_answer(folder: Path, request: str, node_id: int) -> Path:
    return Path(folder) / f"stacks-{request}-node{node_id}.json"


def write_sealed(path: Path, key: bytes, obj) -> None:
    """``obj`` as sealed JSON, whole or not at all (written aside, then renamed)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(seal(key, json.dumps(obj).encode()))
    os.replace(partial, path)


def read_sealed(path: Path, key: bytes):
    """What ``write_sealed`` wrote under ``key``; ``Forged`` for anything else."""
    body = unseal(key, path.read_bytes())
    if body is None:
        raise Forged(f"{path.name} does not carry this launch's seal")
    return json.loads(body)


class JobFolder:
    """The notebook's side of one job folder: what the ranks wrote, read as it grows."""

    def __init__(self, path: Path, key: bytes, name: str, logs: list[Path] | None = None) -> None:
        """``logs``: the paths of this job's own task logs (submitit's ``job.task(i).paths
        .stdout``, known at submission, some not yet written); None reads every
        ``*_log.out`` in the folder."""
        self.path, self.key, self.name, self.logs = Path(path), key, name, logs
        self.offsets: dict[Path, int] = {}  # how far each log and metrics file was read
        self.refused: set[str] = set()  # files already said to lack the seal
        self.skewed: set[int] = set()  # ranks whose clock was already said to be off
        self.broken: set[Path] = set()  # metrics files whose stream a false length broke

    def relay(self, run, view) -> None:
        """Print the ranks' new whole lines from each task's log (agent lines stay there), and
        add the ranks' new sealed records to the run and the live view."""
        logs = self.logs if self.logs is not None else sorted(self.path.glob("*_log.out"))
        for log in logs:
            whole = self._read(log, lambda data: data.rfind(b"\n") + 1)
            for line in whole.decode(errors="replace").splitlines():
                if line.startswith("[rank "):
                    print(line, flush=True)
        if run is None:
            return
        for path in sorted(self.path.glob("metrics-*.bin")):
            if path in self.broken:
                continue
            frames, broke = self._frames(path)
            if broke is not None:
                self.broken.add(path)  # nothing after a false length can be read back
                self.refuse(path, f"{broke} and everything after it")
            for frame in frames:
                try:
                    decoded = decode_sealed(self.key, frame)
                except ValueError:
                    decoded = None
                if decoded is None:
                    self.refuse(path, "a batch of records without this launch's seal")
                    continue
                records, rank, dropped = decoded
                self._check_clock(rank, records)
                run.add(records)
                run.dropped[rank] = dropped
        if view is not None:
            view.update(run)

    def failures(self) -> list[RankFailure]:
        """The failed ranks' errors, the root cause first (``errors.by_priority``)."""
        found = []
        for path in self.path.glob("rank-*.error.json"):
            try:
                report = read_sealed(path, self.key)
            except ValueError as exc:  # Forged, or not JSON
                self.refuse(path, exc)
                continue
            except OSError:  # a directory, or a file the ranks (this user) did not write
                self.refuse(path, "an entry that cannot be read as a file")
                continue
            fields = ("rank", "pid", "exc_type", "message", "traceback", "node", "secondary")
            failure = RankFailure(
                **{name: report[name] for name in fields}, exit_code=report.get("exit_code")
            )
            found.append((path.stat().st_mtime_ns, failure))
        arrival = [f.rank for _, f in sorted(found, key=lambda x: (x[0], x[1].rank))]
        return by_priority([f for _, f in found], arrival)

    def answers(self, paths: list[Path]) -> dict[int, str | None]:
        """{rank: its stacks as JSON text, or None} from the nodes' sealed answers."""
        stacks = {}
        for path in (p for p in paths if p.exists()):
            try:
                answer = read_sealed(path, self.key)
            except ValueError as exc:
                self.refuse(path, exc)
                continue
            except OSError:
                self.refuse(path, "an entry that cannot be read as a file")
                continue
            stacks.update({int(rank): text for rank, text in answer.items()})
        return stacks

    def refuse(self, path: Path, what) -> None:
        """Drop what this launch's processes did not write, and say so once per file (in the
        log and on the cell's stderr)."""
        if path.name not in self.refused:
            self.refused.add(path.name)
            logger.warning("%s: refused %s in %s", self.name, what, path.name)
            print(
                f"nbaccel: refused {what} in {path} (something other than this job's ranks "
                "wrote it); the run leaves it out.",
                file=sys.stderr,
                flush=True,
            )

    def _check_clock(self, rank: int, records: list) -> None:
        ahead = max((r.time for r in records), default=0.0) - time.time()
        if ahead > SKEW_S and rank not in self.skewed:
            self.skewed.add(rank)
            print(
                f"nbaccel: rank {rank}'s node clock is at least {ahead:.1f} s ahead of this "
                "machine's, so times compared across nodes (throughput, the time axis) are off "
                "by as much: synchronize the clocks (NTP, chrony), as SLURM expects.",
                file=sys.stderr,
                flush=True,
            )

    def _frames(self, path: Path) -> tuple[list[bytes], str | None]:
        """The whole batches ``path`` gained since the last read, and what broke its stream."""
        parsed: tuple = ([], 0, None)

        def whole(data: bytes) -> int:
            nonlocal parsed
            parsed = read_frames(data)
            return parsed[1]

        self._read(path, whole)
        return parsed[0], parsed[2]

    def _read(self, path: Path, whole) -> bytes:
        """What ``path`` gained since the last read, up to where ``whole(data)`` ends."""
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
        except OSError:
            return b""
        data = data[: whole(data)]
        self.offsets[path] = self.offsets.get(path, 0) + len(data)
        return data
