"""``nbaccel build-ops``: compile DeepSpeed's C++ op now, not while a learner waits.

DeepSpeed builds a small C++ op (its shared-memory communication on the CPU) the first time a
process needs it, which takes a compiler and tens of seconds. ``make`` and Binder's
``postBuild`` run this once after installing, so the first ZeRO run of lesson 6 starts at once;
torch caches the op, so running it again only finds it. Without DeepSpeed it says how to install
it and exits with status 1.
"""

from __future__ import annotations

import argparse

from . import CommandError


def build_ops_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "build-ops",
        help="compile DeepSpeed's C++ op ahead of its first use",
        description="Compile (or find in torch's extension cache) the C++ op DeepSpeed loads on "
        "first use, so that the first DeepSpeed run does not wait for the compiler. Needs the "
        "deepspeed extra and a C++ compiler.",
    )
    parser.set_defaults(func=build_ops_command)
    return parser


def build_ops_command(args: argparse.Namespace) -> int:
    from ..accelerator.strategies.ds_config import build_ops

    try:
        build_ops()
    except ImportError as err:
        raise CommandError(str(err)) from err
    return 0
