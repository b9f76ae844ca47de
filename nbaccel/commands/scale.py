"""``nbaccel scale``: run a training function at several process counts; print the table (and
where each count's loop time goes, when the ranks timed it).

TARGET names the function as ``path/to/file.py:train`` or ``package.module:train``; it runs
through ``notebook_launcher`` ``--repeats`` times per count, in turn, at ``--threads`` torch
threads per worker, exactly as ``measure_scaling`` does in a notebook. A row the machine spoiled
(another program busy, repeats that disagree, an efficiency above 1) is flagged under the table.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from ..config import MODES
from . import CommandError, positive_int


def scale_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "scale",
        help="measure throughput and scaling efficiency at several process counts",
        description="Run TARGET (file.py:function or module:function) with 1..N processes and "
        "print samples/s and scaling efficiency; --save writes the figure.",
    )
    parser.add_argument("target", metavar="TARGET", help="file.py:function or module:function")
    parser.add_argument(
        "--counts", type=_counts, help="process counts, e.g. 1,2 (default: 1,2 on CPU, 1..N GPUs)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="launches per count, in turn (default 3)"
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch threads per worker (default: cores / most)"
    )
    parser.add_argument("--cpu", action="store_true", help="use the CPU even if there are GPUs")
    parser.add_argument("--mixed-precision", choices=MODES, help="default for Accelerator()")
    parser.add_argument("--save", metavar="PNG", help="save the scaling figure to this file")
    parser.set_defaults(func=scale_command)
    return parser


def scale_command(args: argparse.Namespace) -> int:
    from ..lab.scaling import measure_scaling

    function = load_target(args.target)
    result = measure_scaling(
        function,
        counts=args.counts,
        repeats=args.repeats,
        threads=args.threads,
        cpu=args.cpu or None,
        mixed_precision=args.mixed_precision,
        live=False,
    )
    table = result.table()
    print(table)
    if "comm %" in table.splitlines()[0]:
        print(SHARES)
    if args.save:
        result.save_png(args.save)
        print(f"figure saved to {args.save}")
    return 0


SHARES = """\
The % columns: shares of each rank's training loop, averaged over the ranks. data = waiting
for the next batch, compute = forward, backward and optimizer step, comm = blocked in gradient
synchronisation and other collectives, other = the loop's own Python (logging, evaluation)."""


def load_target(target: str):
    """The function that ``file.py:name`` or ``module:name`` names."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise CommandError(
            f"{target!r} does not name a function: write file.py:train or pkg.mod:train"
        )
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise CommandError(f"{path!r} is not a file")
        spec = importlib.util.spec_from_file_location(f"_nbaccel_target_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        import cloudpickle

        cloudpickle.register_pickle_by_value(module)  # workers cannot import it by that name
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as err:
            raise CommandError(f"cannot import {path!r}: {err}") from err
    function = getattr(module, name, None)
    if not callable(function):
        raise CommandError(f"{path!r} has no function named {name!r}")
    return function


def _counts(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",") if part.strip()]
