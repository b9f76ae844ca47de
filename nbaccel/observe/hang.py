"""Why a launch hangs, in words: which rank is where, which collective it waits in, and desyncs.

The launcher asks every unfinished rank for its stacks (``stacks.collect``) before it stops
them (a timeout, the stop button, Ctrl-C) or while they run on (a stall), and ``report`` turns
the answers into a summary line, what looks like a desync, and each rank's innermost frames:

    rank 1 is in `wait_for_the_moon` (cell 3, line 8); rank 0 waits in `all_reduce` called
    from `train` (cell 3, line 10)

A rank *waits in* a collective when its innermost frame inside ``torch.distributed`` has a
collective's name, or when the library said so (``stacks.waiting``, e.g. inside DDP's
backward); the place it was *called from* is the innermost frame outside torch, nbaccel and the
standard library: the user's. Cells are named as IPython numbers them; source lines come from
this process's line cache, which holds the cells' source (the workers' does not).
"""

from __future__ import annotations

import importlib.util
import linecache
import math
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

from ..config import check_seconds
from .channel import STEPS
from .records import Run
from .stacks import COLLECT_SECONDS, Frame, RankStack, collect, socket_path

COLLECTIVES = frozenset(
    {
        *("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list"),
        *("barrier", "monitored_barrier", "init_process_group", "new_group"),
        *("all_gather", "all_gather_into_tensor", "all_gather_coalesced", "_all_gather_base"),
        *("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_object"),
        *("gather", "gather_object", "scatter", "scatter_object_list", "all_to_all"),
        *("all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv"),
        *("send_object_list", "recv_object_list"),
    }
)
MAIN_FRAMES, OTHER_FRAMES = 10, 3  # innermost frames shown of the main thread, of the others
#: nbaccel's own folder: its frames are library frames, not the user's.
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The launched worker's own runners (the fork server's, a cluster node's): the frames above
#: them are the launcher's, not the user's.
RUNNERS = (
    os.path.join(PACKAGE, "launch", "forkserver.py"),
    os.path.join(PACKAGE, "launch", "slurm", "node.py"),
    os.path.join(PACKAGE, "launch", "cells.py"),  # a ranks session's rank
)
RECORD_LAG = 0.5  # seconds of steps a rank may have made but not yet sent (two record paces)


# -- one rank: where it is ------------------------------------------------------------------------
@dataclass(frozen=True)
class Where:
    """One rank's place: the user's frame it is in, and the collective it waits in, if any."""

    rank: int
    frame: Frame | None  # the user's innermost frame (the call site of the collective)
    collective: str | None = None  # "`all_reduce`", or a label from stacks.waiting

    def place(self) -> str:
        return "" if self.frame is None else location(self.frame)

    def said(self) -> str:
        """ "rank 0 waits in `all_reduce` called from `train` (cell 3, line 10)"."""
        at = f"`{self.frame.function}` ({self.place()})" if self.frame else "no Python frame"
        if self.collective is None:
            return f"rank {self.rank} is in {at}"
        called = f" called from {at}" if self.frame else ""
        return f"rank {self.rank} waits in {self.collective}{called}"

    def site(self) -> str:
        """ "train, cell 3, line 10": where the collective was called from."""
        return f"{self.frame.function}, {self.place()}" if self.frame else "in the library"


def where(stack: RankStack) -> Where:
    main = stack.main
    frames = main.frames if main is not None else ()
    index = next((i for i in reversed(range(len(frames))) if _is_collective(frames[i])), None)
    collective = f"`{frames[index].function}`" if index is not None else stack.waiting
    outer = frames if index is None else frames[:index]
    user = next((f for f in reversed(outer) if not is_library(f.filename)), None)
    if user is None and collective is None and frames:
        user = frames[-1]
    return Where(stack.rank, user, collective)


def _is_collective(frame: Frame) -> bool:
    path = frame.filename.replace(os.sep, "/")
    return frame.function in COLLECTIVES and "/torch/distributed/" in path


@cache
def _library_dirs() -> tuple[str, ...]:
    torch = importlib.util.find_spec("torch")
    dirs = [PACKAGE, sysconfig.get_paths()["stdlib"]]
    dirs += list(torch.submodule_search_locations or []) if torch else []
    return tuple(os.path.join(d, "") for d in dirs)


def is_library(filename: str) -> bool:
    """torch's, nbaccel's or the standard library's code, not the user's."""
    return filename.startswith(_library_dirs()) or filename.startswith("<frozen")


@cache
def _install_dirs() -> tuple[str, ...]:
    """Where this environment's modules live, longest first: site-packages and the standard
    library."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return tuple(os.path.join(d, "") for d in sorted(dirs, key=len, reverse=True))


def shown_path(filename: str) -> str:
    """A library's file as its import path reads (``torch/distributed/distributed_c10d.py``,
    ``threading.py``, ``nbaccel/...`` from a source checkout too): the report names no folder of
    the machine it ran on. Other files whole."""
    if filename.startswith(os.path.join(PACKAGE, "")):
        return os.path.join("nbaccel", filename[len(PACKAGE) + 1 :])
    for folder in _install_dirs():
        if filename.startswith(folder):
            return filename[len(folder) :]
    return filename


def location(frame: Frame) -> str:
    """ "cell 3, line 8" for a notebook cell, else "train.py, line 8"."""
    cell = cell_number(frame.filename)
    name = f"cell {cell}" if cell is not None else os.path.basename(frame.filename)
    return f"{name}, line {frame.lineno}"


def cell_number(filename: str) -> int | None:
    """The execution count of the cell whose code IPython compiled under ``filename``."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    compiler = getattr(shell, "compile", None)
    number = getattr(compiler, "_filename_map", {}).get(filename)
    return number if isinstance(number, int) else None


# -- all ranks: desyncs -------------------------------------------------------------------------
def desyncs(places: list[Where], returned: list[int], run: Run | None = None) -> list[str]:
    """What no rank can leave on its own: ranks that wait for a peer that will never come."""
    waiting = [w for w in places if w.collective]
    free = [w for w in places if not w.collective]
    lines = []
    if waiting and returned:
        w = waiting[0]
        lines.append(
            f"desync: rank {w.rank} waits in {w.collective} ({w.site()}) but "
            f"{_ranks(returned)} had already returned: the ranks ran different numbers of "
            "steps (a different number of batches, or a loop that stops on one rank's clock "
            "or data). Make every rank stop at the same step."
        )
    kinds = {w.collective for w in waiting}
    if len(kinds) > 1:
        each = ", ".join(f"rank {w.rank} in {w.collective} ({w.site()})" for w in waiting)
        lines.append(
            f"desync: the ranks wait in different collectives: {each}. Every rank must call "
            "the same collectives in the same order; one of them skipped or added one."
        )
    elif len({w.site() for w in waiting}) > 1:
        each = "; ".join(f"rank {w.rank} at {w.site()}" for w in waiting)
        lines.append(
            f"desync: the ranks wait in {waiting[0].collective} called from different places: "
            f"{each}. They match up the wrong calls; make every rank run the same ones."
        )
    if waiting and free:
        w, f = waiting[0], free[0]
        lines.append(
            f"desync: rank {w.rank} waits in {w.collective} ({w.site()}) while rank {f.rank} "
            f"is in no collective (it is in `{f.frame.function if f.frame else '?'}`, "
            f"{f.place()}): rank {f.rank} is stuck or slow there, or it skipped that "
            "collective."
        )
    steps = steps_apart(run, [w.rank for w in places]) if run is not None else None
    if steps:
        name, latest = steps
        each = ", ".join(f"rank {rank} at step {step}" for rank, step in sorted(latest.items()))
        lines.append(f"desync: the ranks are at different steps of {name}: {each}.")
    return lines


def steps_apart(run: Run, ranks: list[int]) -> tuple[str, dict[int, int]] | None:
    """A metric whose latest step differs between ``ranks`` by more than their unsent records
    can explain (a blocked rank's last quarter second never left its buffer)."""
    names = [n for n in run.names() if set(ranks) <= set(run.latest_step(n))] + [STEPS]
    for name in names:
        latest = {r: s for r, s in run.latest_step(name).items() if r in ranks}
        if len(latest) < max(len(ranks), 2):
            continue
        pace = max(_pace(run, name, rank) for rank in latest)
        slack = 1 + math.ceil(max(pace, 0.0) * RECORD_LAG)
        if max(latest.values()) - min(latest.values()) > slack:
            return name, latest
    return None


def _pace(run: Run, name: str, rank: int) -> float:
    """Steps per second between this rank's last two records of ``name``."""
    last = []
    for record in reversed(run.records):
        if record.name == name and record.rank == rank:
            last.append(record)
            if len(last) == 2:
                newer, older = last
                if newer.time > older.time:
                    return (newer.step - older.step) / (newer.time - older.time)
                break
    return 0.0


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"


# -- the report ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Report:
    """What ``report`` found: the summary line, the desyncs, and every rank's frames."""

    summary: str
    desyncs: list[str] = field(default_factory=list)
    details: str = ""
    stacks: dict[int, RankStack | None] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [self.summary + ".", *self.desyncs]
        if self.details:
            parts += ["", "Where each rank was (innermost frame last):", self.details]
        return "\n".join(parts)


def ask(folder: str, ranks: list[int], returned: list[int], run: Run | None = None) -> Report:
    """Ask ``ranks`` where they are, at their sockets in ``folder``, and say it."""
    answers = collect({rank: socket_path(folder, rank) for rank in ranks})
    return report(answers, ranks, returned, run)


def report(
    stacks: dict[int, RankStack | None],
    asked: list[int],
    returned: Sequence[int] = (),
    run: Run | None = None,
) -> Report:
    """Describe the ranks ``asked`` (``stacks``: their answers) and the ranks that had
    ``returned``; ``run`` gives their step counts."""
    answered = {r: s for r, s in stacks.items() if s is not None}
    places = [where(answered[r]) for r in sorted(answered)]
    said = [w.said() for w in places if not w.collective]  # the ones not waiting first
    said += [w.said() for w in places if w.collective]
    for rank in asked:
        if rank not in stacks:
            said.append(f"rank {rank} was not listening (not started yet, or already gone)")
        elif stacks[rank] is None:
            said.append(
                f"rank {rank} did not answer within {COLLECT_SECONDS} s (busy in C code that "
                "holds Python's lock, or overloaded)"
            )
    details = "\n".join(_frames(answered[r]) for r in sorted(answered))
    summary = "; ".join(said) or "no rank was left to ask"
    return Report(summary, desyncs(places, list(returned), run), details, dict(stacks))


def _frames(stack: RankStack) -> str:
    lines = [f"rank {stack.rank} (pid {stack.pid}):"]
    if stack.waiting:
        lines[0] = lines[0][:-1] + f", waiting in {stack.waiting} by its own account:"
    for thread in stack.threads:
        frames = _own(thread.frames)
        keep = MAIN_FRAMES if thread.main else OTHER_FRAMES
        hidden = len(frames) - keep
        left_out = f" ({hidden} outer frames left out)" if hidden > 0 else ""
        lines.append(f"  thread {thread.name}{left_out}:")
        for frame in frames[-keep:]:
            cell = cell_number(frame.filename)
            at = f"cell {cell}" if cell is not None else f'File "{shown_path(frame.filename)}"'
            lines.append(f"    {at}, line {frame.lineno}, in {frame.function}")
            source = linecache.getline(frame.filename, frame.lineno).strip()
            if source:
                lines.append(f"      {source}")
    return "\n".join(lines)


def _own(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """The frames below the launched worker's own runner (``RUNNERS``): the user's call
    and what it called. Other stacks (a script under torchrun) are kept whole."""
    ours = [i for i, f in enumerate(frames) if f.filename in RUNNERS]
    return frames[ours[-1] + 1 :] if ours else frames


# -- a launch that stopped making progress -------------------------------------------------------
def check_stall_warning(seconds: object) -> float | None:
    """``notebook_launcher(stall_warning=...)``: a positive number of seconds, or None."""
    return check_seconds("stall_warning", seconds, "60", none="never warn")


class Stall:
    """When to warn that ranks stopped making progress: no record from a rank that has not
    finished for ``seconds``, once records had been seen; once per stall, until those ranks
    record again."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.heard: dict[int, float] = {}  # rank -> when its last record arrived (monotonic)
        self.first: float | None = None
        self.warned: set[int] = set()

    def heard_from(self, rank: int, now: float) -> None:
        self.first = now if self.first is None else self.first
        self.heard[rank] = now
        self.warned.discard(rank)

    def quiet(self, running: list[int], now: float) -> list[int]:
        """The ranks to warn about now (usually none)."""
        self.warned &= set(running)
        if self.seconds is None or self.first is None or self.warned:
            return []
        quiet = [r for r in running if now - self.heard.get(r, self.first) > self.seconds]
        self.warned = set(quiet)
        return quiet
