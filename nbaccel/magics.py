"""The IPython extension: ``%load_ext nbaccel`` gives ``%ranks`` and ``%%ranks``.

Thin over ``Ranks`` (``launch/session.py``): it parses and displays, nothing else.

    %ranks start 2 --cpu          # fork 2 ranks; they join their process group once
    %%ranks                       # this cell on every rank (``%%ranks 1``, ``%%ranks 0,1``)
    x = torch.tensor([rank + 1.0])
    %ranks status                 # each rank: pid, alive, busy or idle, the last cell it ran
    %ranks pull x                 # the value on each rank, back here (a list)
    %ranks push lr model_config   # these names of the notebook, into every rank
    %ranks restart                # fresh ranks and group;  %ranks stop: none left

``%ranks start`` takes ``notebook_launcher``'s options where they apply (``--cpu``,
``--mixed-precision``, ``--fsdp``, ``--deepspeed``, ``--zero-stage``, ``--timeout``,
``--output``) and the session's own (``--stall-timeout``, ``--on-hang keep|restart``,
``--no-live``); ``%%ranks`` takes ranks and ``--output``.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .errors import NbaccelError
from .launch.session import Ranks


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a usage error in a cell, not SystemExit
        raise NbaccelError(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def _start_parser() -> _Parser:
    parser = _Parser(prog="%ranks start", add_help=False)
    parser.add_argument("num_processes", type=int, nargs="?")
    parser.add_argument("--cpu", action="store_true", default=None)
    parser.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"))
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--output", choices=("all", "main"), default="all")
    parser.add_argument("--stall-timeout", type=float, default=10.0)
    parser.add_argument("--on-hang", choices=("keep", "restart"), default="keep")
    parser.add_argument("--no-live", dest="live", action="store_false")
    parser.add_argument("--fsdp", action="store_true", default=None)
    parser.add_argument("--deepspeed", action="store_true", default=None)
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    return parser


def _cell_parser() -> _Parser:
    parser = _Parser(prog="%%ranks", add_help=False)
    parser.add_argument("ranks", nargs="?", help="0,1 or 1 or 0-3; default every rank")
    parser.add_argument("--output", choices=("all", "main"))
    return parser


def parse_ranks(text: str | None) -> list[int] | None:
    """``"0,1"``, ``"1"``, ``"0-3"`` or ``"all"`` as a list of ranks (None: every rank)."""
    if text is None or text == "all":
        return None
    chosen = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            chosen += range(int(first), int(last or first) + 1)
    except ValueError:
        raise NbaccelError(f"%%ranks {text}: give ranks as 1, 0,1 or 0-3") from None
    return chosen


class RanksMagics:
    """The session of one kernel, and the magics that drive it."""

    def __init__(self, shell) -> None:
        self.shell = shell
        self.session: Ranks | None = None

    def line(self, line: str):
        words = shlex.split(line, comments=True)  # "%ranks push lr  # why" pushes lr
        command, rest = (words[0], words[1:]) if words else ("status", [])
        usable = command in ("start", "stop", "restart", "status") or (
            (command == "pull" and len(rest) == 1) or (command == "push" and rest)
        )
        if not usable:
            raise NbaccelError(
                f"%ranks {line}: use start N, stop, restart, status, pull NAME or push NAME..."
            )
        if command == "start":
            if self.session is not None and self.session.ranks:
                raise NbaccelError("ranks are running already: %ranks restart, or %ranks stop")
            options = vars(_start_parser().parse_args(rest))
            self.session = None
            self.session = Ranks(options.pop("num_processes"), **options)
            print(
                f"nbaccel: {len(self.session.ranks)} ranks ready ({_device(self.session)}); "
                "%%ranks runs a cell on them."
            )
            return None
        if command == "stop":
            if self.session is not None:
                self.session.stop()
            self.session = None
            return None
        if command == "status" and self.session is None:
            print("no ranks are running: %ranks start N (e.g. %ranks start 2 --cpu) starts them.")
            return None
        session = self._session()
        if command == "restart":
            session.restart()
            print(
                f"nbaccel: {len(session.ranks)} fresh ranks ready (pids "
                f"{', '.join(str(r.pid) for r in session.ranks)})."
            )
        elif command == "status":
            print(_table(session))
        elif command == "pull":
            return session.pull(rest[0])
        else:
            missing = [name for name in rest if name not in self.shell.user_ns]
            if missing:
                raise NbaccelError(f"%ranks push: {missing} not defined in this notebook")
            session.push(**{name: self.shell.user_ns[name] for name in rest})
        return None

    def cell(self, line: str, cell: str) -> None:
        options = _cell_parser().parse_args(shlex.split(line, comments=True))
        session = self._session()
        number = _running_cell(self.shell)
        source = "\n" + cell  # line numbers as the notebook shows them: the magic's is line 1
        filename = self.shell.compile.cache(source, number)  # reports say "cell N, line L"
        session.run(
            source,
            parse_ranks(options.ranks),
            output=options.output,
            filename=filename,
            cell=number,
        )

    def _session(self) -> Ranks:
        if self.session is None:
            raise NbaccelError(
                "no ranks yet: start them with %ranks start N (e.g. %ranks start 2 --cpu)"
            )
        return self.session


def _running_cell(shell) -> int:
    """The number of the cell running now, as its prompt shows it: the last one IPython
    compiled (``execution_count`` is already the next one while a cell runs)."""
    numbers = list(getattr(shell.compile, "_filename_map", {}).values())
    return numbers[-1] if numbers else shell.execution_count


def _device(session: Ranks) -> str:
    config = session.config
    return f"{config.gpus} GPUs, NCCL" if config.gpus else "CPU, gloo"


def _table(session: Ranks) -> str:
    rows = session.status()
    if not rows:
        return f"no ranks are running. {session.broken or ''}".strip()
    lines = [f"{'rank':>4}  {'pid':>7}  {'alive':5}  {'state':16}  last cell"]
    for row in rows:
        last = "-" if row["last_cell"] is None else str(row["last_cell"])
        lines.append(
            f"{row['rank']:>4}  {row['pid']:>7}  {'yes' if row['alive'] else 'no':5}  "
            f"{row['state']:16}  {last}"
        )
    if session.broken:
        lines.append(session.broken)
    return "\n".join(lines)


def load_ipython_extension(shell) -> None:
    magics = RanksMagics(shell)
    shell.register_magic_function(magics.line, "line", "ranks")
    shell.register_magic_function(magics.cell, "cell", "ranks")
    shell.user_ns.setdefault("_nbaccel_ranks", magics)  # for code that wants the Ranks object
    if "nbaccel" not in sys.modules:  # pragma: no cover - loaded as nbaccel's own extension
        import nbaccel  # noqa: F401


def unload_ipython_extension(shell) -> None:
    magics = shell.user_ns.pop("_nbaccel_ranks", None)
    if magics is not None and magics.session is not None:
        magics.session.stop()
