"""``nbaccel launch``: run a script on N processes through torch's own elastic launcher.

This builds a ``torchrun`` command line (``python -m torch.distributed.run``), the engine that
also scales to many nodes, and adds three things: defaults from ``nbaccel config``, the launch
defaults that ``Accelerator()`` reads (``NBACCEL_MIXED_PRECISION``, ``NBACCEL_CPU``), and one
line at the end of a failed run that names the failing rank and its exit code.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..config import resolve_sharding
from ..env import (
    CPU_VAR,
    DEEPSPEED_VAR,
    FSDP_VAR,
    MIXED_PRECISION_VAR,
    accelerate_defaults,
    threads_per_worker,
    visible_gpus,
)
from ..metrics import PANEL_VAR
from ..precision import MODES
from . import UsageError, positive_int, saved_config
from .torchrun import run_torchrun


def launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="run a script on several processes (torchrun underneath)",
        description="Run SCRIPT on N processes per machine with torch.distributed.run. "
        "Defaults come from `nbaccel config`; arguments after SCRIPT go to the script.",
    )
    parser.add_argument(
        "-n",
        "--num-processes",
        type=positive_int,
        help="processes on this machine (default: the config's, else one per GPU, else 1)",
    )
    parser.add_argument("--num-nodes", type=positive_int, default=1, help="machines (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..N-1")
    parser.add_argument("--master-addr", help="node 0's address (several nodes)")
    parser.add_argument("--master-port", type=positive_int, help="a free port on node 0")
    parser.add_argument("--mixed-precision", choices=MODES, help="default for Accelerator()")
    parser.add_argument(
        "--cpu", action=argparse.BooleanOptionalAction, help="use the CPU even if there are GPUs"
    )
    parser.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        help="Accelerator() shards the model with FSDP2, not DDP (default: the config's)",
    )
    parser.add_argument(
        "--deepspeed",
        action=argparse.BooleanOptionalAction,
        help="Accelerator() trains through DeepSpeed, ZeRO stage 2 unless --zero-stage says "
        "(default: the config's)",
    )
    parser.add_argument(
        "--zero-stage", type=int, choices=(0, 1, 2, 3), help="DeepSpeed's ZeRO stage (implies it)"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a process fails, restart them all, up to N times (torchrun's; default 0)",
    )
    parser.add_argument(
        "--save-panel", metavar="PNG", help="save rank 0's final live panel to this PNG file"
    )
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(func=launch_command)
    return parser


def launch_command(args: argparse.Namespace) -> int:
    check_arguments(args)
    config = saved_config()
    cpu = config.cpu if args.cpu is None else args.cpu
    gpus = 0 if cpu else visible_gpus()
    nproc = args.num_processes or config.num_processes or max(gpus, 1)
    check_gpus(nproc, gpus)
    try:
        fsdp, zero_stage = resolve_sharding(config, args.fsdp, args.deepspeed, args.zero_stage)
    except ValueError as err:
        raise UsageError(str(err)) from None
    env = {
        **os.environ,
        MIXED_PRECISION_VAR: args.mixed_precision or config.mixed_precision,
        CPU_VAR: "1" if cpu else "0",
        FSDP_VAR: "1" if fsdp else "0",
        DEEPSPEED_VAR: "" if zero_stage is None else str(zero_stage),
    }
    env.update(accelerate_defaults(gpus, env[MIXED_PRECISION_VAR]))
    if args.save_panel:
        env[PANEL_VAR] = os.path.abspath(args.save_panel)
    env["OMP_NUM_THREADS"] = str(threads_per_worker(nproc, env))  # the user's choice wins
    outcome = run_torchrun(torchrun_command(args, nproc), env)
    if outcome.signal is not None:
        name = signal.Signals(outcome.signal).name
        print(f"nbaccel launch: stopped by {name}; the workers were ended.", file=sys.stderr)
        return 128 + outcome.signal
    if outcome.returncode != 0:
        print(f"nbaccel launch: {outcome.describe()}", file=sys.stderr)
    return outcome.exit_status


def torchrun_command(args: argparse.Namespace, nproc: int) -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line for these arguments."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if args.master_port is None:  # one node (checked): torchrun picks a free port on loopback
        command.append("--standalone")
    else:
        command += ["--nnodes", str(args.num_nodes), "--node-rank", str(args.node_rank)]
        command += ["--master-addr", args.master_addr or "127.0.0.1"]
        command += ["--master-port", str(args.master_port)]
    if args.max_restarts:
        command += ["--max-restarts", str(args.max_restarts)]
    if args.module:
        command.append("-m")
    return [*command, args.script, *args.script_args]


def check_arguments(args: argparse.Namespace) -> None:
    if not 0 <= args.node_rank < args.num_nodes:
        raise UsageError(
            f"--node-rank {args.node_rank} must be in 0..{args.num_nodes - 1} for "
            f"--num-nodes {args.num_nodes}"
        )
    if args.num_nodes > 1 and None in (args.master_addr, args.master_port):
        raise UsageError(
            "several nodes must agree on where to meet: pass --master-addr (node 0's address) "
            "and --master-port (a free port on node 0), the same on every node"
        )
    if args.master_addr is not None and args.master_port is None:
        raise UsageError("--master-addr needs --master-port too (a free port on that machine)")
    if args.master_port is not None and args.master_port > 65535:
        raise UsageError(f"--master-port {args.master_port} is not a port: use 1024..65535")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts} must be 0 (no restarts) or more")
    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"{args.script!r} is not a file; for a module, add -m: launch -m NAME")


def check_gpus(nproc: int, gpus: int) -> None:
    if gpus and nproc > gpus:
        raise UsageError(
            f"--num-processes {nproc} but this machine has {gpus} visible GPU(s): one process "
            f"per GPU. Use -n {gpus} or fewer, or --cpu to run {nproc} processes on the CPU."
        )
