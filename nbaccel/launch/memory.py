"""Was it memory? What the report of a rank killed by a SIGKILL nbaccel did not send says.

A rank that dies of SIGKILL leaves no traceback: the signal cannot be caught. On Linux the
commonest sender is the kernel's out-of-memory killer, and the next a person or a job scheduler.
The supervisor takes a ``snapshot()`` as a launch starts, and ``killed_hint`` weighs what is
known when a rank is found killed:

- the cgroup's count of OOM kills (cgroup v2 ``memory.events``, v1 ``memory.oom_control``): if
  it rose during the launch, the kernel killed a process for memory;
- each rank's last recorded CPU memory (``channel.RSS``, the recorder's resident set size, in
  MiB) against the cgroup's limit or, without one, the machine's total memory;
- the memory available now, said for the reader (the kill has freed the rank's memory, so it
  is no verdict).

Every read may fail (another platform, a container that hides the files): a part that cannot
be read is left out, and ``killed_hint`` never raises. Amounts are MiB (2**20 bytes), as on the
live panel.

    start = memory.snapshot()                    # as the launch starts
    ...
    hint = memory.killed_hint(rank, run, start)  # "likely out of memory: ..."
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..observe.channel import RSS

if TYPE_CHECKING:
    from ..observe.records import Run

log = logging.getLogger(__name__)

#: Where Linux mounts the cgroup file system (v2 alone, or v1 with a ``memory`` controller).
CGROUP = Path("/sys/fs/cgroup")
#: The ranks' memory together above this share of the limit (or of the machine) is the likely
#: cause: the OOM killer acts before 100%, and the recorder last read it up to 0.25 s earlier.
LIKELY_SHARE = 0.8
#: How to check, and what to change if it was memory.
CHECK = (
    "to check: `dmesg | grep -i kill` (or `journalctl -k | grep -i oom`) lists the kernel's "
    "OOM kills; if it was memory, lower the batch size or num_processes"
)
_MIB = 2**20


@dataclass(frozen=True)
class Snapshot:
    """What ``killed_hint`` compares against, taken as a launch starts."""

    oom_kills: int | None  # the cgroup's OOM-kill count; None where it cannot be read


def snapshot(*, cgroup: Path = CGROUP) -> Snapshot:
    """The cgroup's OOM-kill count now (None where it cannot be read). Never raises."""
    return Snapshot(oom_kills=_oom_kills(cgroup))


def killed_hint(
    rank: int,
    run: Run,
    start: Snapshot,
    *,
    cgroup: Path = CGROUP,
    machine: Callable[[], tuple[float, float] | None] | None = None,
) -> str:
    """One to three short lines for the report of a rank killed by a SIGKILL that nbaccel did
    not send: the verdict, ``rank``'s last recorded CPU memory (from ``run``), the memory
    available and the limit, and how to check. ``machine`` (tests pass their own) gives the
    machine's (available, total) memory in MiB. Never raises."""
    try:
        return _hint(rank, run, start, cgroup, machine or _machine)
    except Exception:  # a report must never break on its hint
        log.debug("no memory hint for rank %s", rank, exc_info=True)
        return f"{CHECK}."


def _hint(
    rank: int,
    run: Run,
    start: Snapshot,
    cgroup: Path,
    machine: Callable[[], tuple[float, float] | None],
) -> str:
    rss = _latest_rss(run)
    limit = _limit_mib(cgroup)
    now = _guarded(machine)
    kills = _oom_kills(cgroup)
    if rank in rss:
        mine = f"its last recorded CPU memory was {rss[rank]:,.0f} MiB"
        if len(rss) > 1:
            mine += f" ({sum(rss.values()):,.0f} MiB for all {len(rss)} ranks)"
    else:
        mine = "it recorded no CPU memory before it died (an Accelerator records it every 0.25 s)"
    facts = [mine]
    if now is not None:
        facts.append(f"the machine has {now[0]:,.0f} MiB available now of {now[1]:,.0f} MiB")
    if limit is not None:
        facts.append(f"the cgroup's memory limit is {limit:,.0f} MiB")
    ceiling = limit if limit is not None else (now[1] if now is not None else None)
    # RSS counts the pages a rank shares with the fork server (torch's code, some 200 MiB) once
    # per rank: the sum overstates a little, which the 80% line leaves room for
    share = sum(rss.values()) / ceiling if rss and ceiling else None
    if kills is not None and start.oom_kills is not None and kills > start.oom_kills:
        n = kills - start.oom_kills
        verdict = (
            f"likely out of memory: the kernel's OOM killer ended {n} process"
            f"{'es' if n > 1 else ''} in this cgroup during the launch"
        )
    elif share is not None and share > LIKELY_SHARE:
        of = "the cgroup's memory limit" if limit is not None else "the machine's memory"
        verdict = f"likely out of memory: the ranks last held {share:.0%} of {of}"
    elif share is None and (kills is None or start.oom_kills is None):
        verdict = "whether memory was the cause cannot be told from here"
    else:
        verdict = "memory is not the evident cause; something else sent SIGKILL"
    return f"{verdict}.\n{'; '.join(facts)}.\n{CHECK}."


def _latest_rss(run: Run) -> dict[int, float]:
    try:
        return run.latest(RSS)
    except Exception:
        return {}


def _guarded(read: Callable[[], tuple[float, float] | None]) -> tuple[float, float] | None:
    try:
        return read()
    except Exception:
        return None


def _machine() -> tuple[float, float] | None:
    """The machine's (available, total) memory in MiB: what a new allocation could still get
    without swapping (``MemAvailable``), and all of it."""
    import psutil

    memory = psutil.virtual_memory()
    return memory.available / _MIB, memory.total / _MIB


def _dirs(cgroup: Path) -> list[Path]:
    """The directories that may hold this process's memory cgroup files, its own first: v2's
    unified hierarchy, then v1's ``memory`` controller; each at the process's path (from
    ``/proc/self/cgroup``) and at the root (inside a container, the root is the container's)."""
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers in ("", "memory"):
                own[controllers] = path.lstrip("/")
    except (OSError, ValueError):
        pass
    v1 = cgroup / "memory"
    candidates = [cgroup / own.get("", ""), cgroup, v1 / own.get("memory", ""), v1]
    return list(dict.fromkeys(candidates))  # in order, each once


def _read(cgroup: Path, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` found in this process's memory cgroup; None if none is."""
    for directory in _dirs(cgroup):
        for name in names:
            try:
                return (directory / name).read_text()
            except OSError:
                continue
    return None


def _oom_kills(cgroup: Path) -> int | None:
    """The cgroup's count of processes the OOM killer ended: the ``oom_kill`` line of v2's
    ``memory.events`` or v1's ``memory.oom_control`` (the same line in both)."""
    text = _read(cgroup, ("memory.events", "memory.oom_control"))
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _limit_mib(cgroup: Path) -> float | None:
    """The cgroup's memory limit in MiB; None without one (v2 ``max``, v1's huge default)."""
    text = _read(cgroup, ("memory.max", "memory.limit_in_bytes"))
    if text is None or not text.strip().isdigit():
        return None
    limit = int(text)
    return None if limit >= 2**60 else limit / _MIB
