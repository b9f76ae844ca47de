"""``nbaccel config``: write the defaults that ``nbaccel launch`` and ``notebook_launcher`` read.

Asks up to five questions (the current value in brackets; Enter keeps it), or takes the answers as
flags, or writes the built-in defaults with ``--default``. ``nbaccel config show`` prints the file.
A SLURM cluster's defaults (partition, account, time) are flags only: they are set once per
cluster, not per launch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TypeVar

from ..config import MODES, Defaults, config_path, load_config, save_config
from . import CommandError, UsageError, positive_int, saved_config

T = TypeVar("T")
WHERE = (
    "The file is $NBACCEL_CONFIG if set, else $XDG_CONFIG_HOME/nbaccel/config.json, else "
    "~/.config/nbaccel/config.json (here: {path})."
)


def config_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "config",
        help="set the defaults for launches (processes, mixed precision, cpu, sharding)",
        description="Write the defaults that `nbaccel launch` and notebook_launcher read: "
        "interactively, or from the flags below. " + WHERE.format(path=config_path()),
    )
    parser.add_argument("action", nargs="?", choices=["show"], help="print the file and its path")
    parser.add_argument("--default", action="store_true", help="write the built-in defaults")
    parser.add_argument(
        "--num-processes", type=processes, help='per machine; "auto": one per GPU, else 1'
    )
    parser.add_argument("--mixed-precision", choices=MODES, help="the default for Accelerator()")
    parser.add_argument(
        "--cpu", action=argparse.BooleanOptionalAction, help="use the CPU even if there are GPUs"
    )
    parser.add_argument(
        "--fsdp", action=argparse.BooleanOptionalAction, help="shard with FSDP2 instead of DDP"
    )
    parser.add_argument(
        "--zero-stage",
        type=stage,
        help='train through DeepSpeed at this ZeRO stage (0-3); "none": no DeepSpeed',
    )
    parser.add_argument(
        "--prestart",
        action=argparse.BooleanOptionalAction,
        help="in a Jupyter kernel, start the worker server when the launcher is imported (the "
        "default), so that the first launch does not wait for it",
    )
    cluster = parser.add_argument_group("a SLURM cluster's defaults, for SlurmCluster()")
    cluster.add_argument("--slurm-partition", help='its partition; "none": the cluster\'s own')
    cluster.add_argument("--slurm-account", help='the account to charge; "none": no account')
    cluster.add_argument(
        "--slurm-time", type=minutes, help='the time limit: minutes or "1:30:00"; "none": 60'
    )
    parser.set_defaults(func=config_command)
    return parser


def config_command(args: argparse.Namespace) -> int:
    flags = {
        "num_processes": args.num_processes,
        "mixed_precision": args.mixed_precision,
        "cpu": args.cpu,
        "fsdp": args.fsdp,
        "zero_stage": args.zero_stage,
        "slurm_partition": args.slurm_partition,
        "slurm_account": args.slurm_account,
        "slurm_time": args.slurm_time,
        "prestart": args.prestart,
    }
    given = {k: (None if v in ("auto", "none") else v) for k, v in flags.items() if v is not None}
    if args.action == "show":
        if given or args.default:
            raise UsageError("`nbaccel config show` takes no other arguments")
        return show()
    if given or args.default:
        base = Defaults() if args.default else saved_config()
        if given.get("fsdp"):  # one way to shard: asking for one turns the other off
            base = replace(base, zero_stage=None)
        if given.get("zero_stage") is not None:
            base = replace(base, fsdp=False)
        try:
            config = replace(base, **given)
        except ValueError as err:
            raise UsageError(str(err)) from None
    else:
        config = ask_all(current())
    path = save_config(config)
    print(f"Wrote {path}:\n{render(config)}")
    return 0


def show() -> int:
    path = config_path()
    if not path.is_file():
        print(f"{path} (no file yet: the built-in defaults apply)\n{render(Defaults())}")
        return 0
    print(f"{path}\n{path.read_text().rstrip()}")
    saved_config()  # says what is wrong with the file, if anything
    return 0


def current() -> Defaults:
    try:
        return load_config()
    except ValueError as err:
        print(f"{err}\nStarting from the built-in defaults instead.")
        return Defaults()


def ask_all(config: Defaults) -> Defaults:
    print("Enter keeps the value in brackets. " + WHERE.format(path=config_path()))
    n = ask(
        "Processes per machine (a number, or auto: one per GPU, else 1)",
        "auto" if config.num_processes is None else str(config.num_processes),
        processes,
    )
    mixed = ask(f"Mixed precision ({', '.join(MODES)})", config.mixed_precision, mode)
    cpu = ask("Use the CPU even if there are GPUs (yes/no)", "yes" if config.cpu else "no", yes_no)
    fsdp = ask("Shard with FSDP2 instead of DDP (yes/no)", "yes" if config.fsdp else "no", yes_no)
    zero_stage = None
    if not fsdp:
        now = "none" if config.zero_stage is None else str(config.zero_stage)
        zero_stage = ask("Train through DeepSpeed at ZeRO stage (none, 0, 1, 2, 3)", now, stage)
    return replace(  # the questions' answers; what is not asked (a cluster's, prestart) is kept
        config,
        num_processes=None if n == "auto" else n,  # type: ignore[arg-type]
        mixed_precision=mixed,
        cpu=cpu,
        fsdp=fsdp,
        zero_stage=None if zero_stage == "none" else zero_stage,  # type: ignore[arg-type]
    )


def ask(question: str, default: str, parse: Callable[[str], T]) -> T:
    """Ask until the answer parses; an empty answer takes ``default``."""
    while True:
        try:
            answer = input(f"{question} [{default}]: ").strip() or default
        except EOFError:
            print()  # ends the prompt's line
            raise CommandError(
                "no answer (stdin is closed or not a terminal). Run `nbaccel config --default`, "
                "or give the values as flags: --num-processes 2 --mixed-precision bf16 --cpu"
            ) from None
        try:
            return parse(answer)
        except (ValueError, argparse.ArgumentTypeError) as err:
            print(f"  {err}; try again.")


def processes(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def mode(text: str) -> str:
    if text.lower() not in MODES:
        raise ValueError(f"{text!r} is not one of {', '.join(MODES)}")
    return text.lower()


def stage(text: str) -> int | str:
    text = text.strip().lower()
    if text not in ("none", "0", "1", "2", "3"):
        raise ValueError(f"{text!r} is not none, 0, 1, 2 or 3")
    return "none" if text == "none" else int(text)


def yes_no(text: str) -> bool:
    if text.lower() not in ("y", "yes", "n", "no"):
        raise ValueError(f"{text!r} is not yes or no")
    return text.lower().startswith("y")


def minutes(text: str) -> int | str:
    """A time limit: whole minutes, one of SLURM's forms ("1:30:00", "2-00:00:00"), or none."""
    from ..launch.slurm.limits import minutes as slurm_minutes  # SlurmCluster's own reading

    if text == "none":
        return text
    try:
        limit = slurm_minutes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err}; e.g. 30 or 1:30:00") from None
    if limit == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give more than 0 minutes, e.g. 30 or 1:30:00")
    return int(text) if text.isascii() and text.isdigit() else text


def render(config: Defaults) -> str:
    return json.dumps(asdict(config), indent=2)
