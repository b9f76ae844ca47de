"""The ``nbaccel`` subcommands, one module each (Accelerate's ``commands/`` habit).

Each module has ``<name>_parser(subparsers)``, which adds its subcommand and its arguments, and
``<name>_command(args) -> int``, which runs it and returns the exit status. They stay thin: the
work is done by the library (``notebook_launcher``, ``config``) or by torch's own launcher.
"""

from __future__ import annotations

import argparse

from ..config import Defaults, load_config
from ..errors import NbaccelError


class CommandError(NbaccelError):
    """A subcommand could not do its job; ``nbaccel`` prints the message and exits with 1."""


class UsageError(CommandError, ValueError):
    """Arguments that do not fit together; ``nbaccel`` prints usage and exits with 2."""


def saved_config() -> Defaults:
    """The ``nbaccel config`` defaults, or a CommandError that says how to repair the file."""
    try:
        return load_config()
    except ValueError as err:
        raise CommandError(str(err)) from err


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1, e.g. a process count."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number, e.g. 2") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value
