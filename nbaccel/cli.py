"""The ``nbaccel`` console script: ``launch``, ``config``, ``env``, ``test``, ``scale`` and
``build-ops``.

Each subcommand lives in its own module under ``commands/`` with a ``*_parser(subparsers)``
that declares its arguments and a ``*_command(args)`` that runs it and returns the exit status.
Nothing in the library imports this module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .commands import CommandError, UsageError
from .commands.build_ops import build_ops_parser
from .commands.config import config_parser
from .commands.env import env_parser
from .commands.launch import launch_parser
from .commands.scale import scale_parser
from .commands.test import test_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit status."""
    parser = argparse.ArgumentParser(
        prog="nbaccel",
        description="Launch and check distributed PyTorch runs (see `nbaccel COMMAND --help`).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parsers = (launch_parser, config_parser, env_parser, test_parser, scale_parser)
    for add in (*parsers, build_ops_parser):
        add(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:  # arguments that argparse alone cannot check: usage, status 2
        subparsers.choices[args.command].error(str(err))
    except CommandError as err:
        print(f"nbaccel {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
