"""``nbaccel launch``: run a script on N processes through torch's own elastic launcher.

This builds a ``torchrun`` command line (``python -m torch.distributed.run``), the engine that
also scales to many nodes. The flags become the same ``LaunchConfig`` that ``notebook_launcher``
builds (defaults from ``nbaccel config``, every check in ``config.py``), whose variables
(``NBACCEL_MIXED_PRECISION``, ``NBACCEL_CPU``...) ``Accelerator()`` reads in each process; a
failed run ends with one line that names the failing rank and its exit code.

``--timeout`` stops a run that has not finished after that many seconds; then, as on Ctrl-C or
SIGTERM, it first asks every local rank where it is (each rank's ``PartialState`` listens on a
socket in a temporary folder named by ``NBACCEL_STACKS_DIR``, ``stacks.py``) and ends with that
report. ``--slurm`` submits the script to a SLURM cluster instead (``--num-nodes`` nodes of
``-n`` processes each): the notebook's cluster path (``launch/slurm``) with the script as its
function, so the queue state, the output, the error naming rank and node, and the hang report
read as they do in a cell; Ctrl-C cancels the job and ends with 130, as a local run does. There
is no ``--stall-warning``: under torchrun the workers' records stay in the workers (no channel
reaches this process), so it cannot see them stop.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile

from ..config import FLAGS, MODES, LaunchConfig
from ..config import check_gpus as launch_check_gpus
from ..env import PANEL_VAR, STACKS_VAR
from ..launch.torchrun import run_torchrun
from ..observe.hang import Report, ask
from . import UsageError, positive_int, saved_config


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
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help="stop the run if it has not finished after SECONDS, saying where each rank was",
    )
    parser.add_argument(
        "--save-panel", metavar="PNG", help="save rank 0's final live panel to this PNG file"
    )
    cluster = parser.add_argument_group(
        "a SLURM cluster (--slurm): --num-nodes nodes of -n processes each, through sbatch"
    )
    cluster.add_argument("--slurm", action="store_true", help="submit to SLURM (nbaccel[slurm])")
    cluster.add_argument("--partition", help="SLURM's partition (default: nbaccel config's)")
    cluster.add_argument("--time", help="the job's time limit: minutes or 1:30:00")
    cluster.add_argument("--account", help="the account to charge")
    cluster.add_argument("--gpus-per-node", type=int, help="GPUs on each node")
    cluster.add_argument("--cpus-per-task", type=positive_int, help="CPUs for each node's task")
    cluster.add_argument(
        "--folder", default="nbaccel-jobs", help="job folders, on a filesystem every node sees"
    )
    cluster.add_argument(
        "--print-script", action="store_true", help="print the batch script and submit nothing"
    )
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(func=launch_command)
    return parser


def launch_command(args: argparse.Namespace) -> int:
    if args.slurm or args.print_script:
        return slurm_command(args)
    config = launch_config(args)
    check_script(args)
    env = {**os.environ, **config.to_environ()}
    if args.save_panel:
        env[PANEL_VAR] = os.path.abspath(args.save_panel)
    first = config.node_rank * config.num_processes
    ranks = list(range(first, first + config.num_processes))  # this machine's
    found: list[Report] = []
    with tempfile.TemporaryDirectory(prefix="nbaccel-stacks-") as folder:
        env[STACKS_VAR] = folder
        outcome = run_torchrun(
            torchrun_command(args, config.num_processes),
            env,
            timeout=args.timeout,
            before_stop=lambda: found.append(ask(folder, ranks, [])),
        )
    where = f" {found[0]}" if found else ""
    if outcome.timed_out:
        print(
            f"nbaccel launch: timeout: the run had not finished after {args.timeout:g} s; "
            f"torchrun stopped the workers.{where}",
            file=sys.stderr,
        )
        return 124  # as coreutils' timeout
    if outcome.signal is not None:
        name = signal.Signals(outcome.signal).name
        print(f"nbaccel launch: stopped by {name}; the workers were ended.{where}", file=sys.stderr)
        return 128 + outcome.signal
    if outcome.returncode != 0:
        print(f"nbaccel launch: {outcome.describe()}", file=sys.stderr)
    return outcome.exit_status


def slurm_command(args: argparse.Namespace) -> int:
    """The script on a SLURM cluster: the notebook's cluster path, with the script as the
    function (``run_script``), so output, errors, the queue state and hangs read the same."""
    from .. import LaunchError, NbaccelError, SlurmCluster, notebook_launcher

    check_script(args)
    time = int(args.time) if args.time and args.time.isdigit() else args.time
    try:
        cluster = SlurmCluster(
            args.partition,
            time,
            args.account,
            args.gpus_per_node,
            args.cpus_per_task,
            args.folder,
        )
        if args.print_script:
            print(cluster.batch_script(args.num_nodes))
            return 0
        script = args.script if args.module else os.path.abspath(args.script)
        notebook_launcher(
            run_script,
            args=(script, list(args.script_args), args.module),
            num_processes=args.num_processes,
            num_nodes=args.num_nodes,
            mixed_precision=args.mixed_precision,
            cpu=args.cpu,
            fsdp=args.fsdp,
            deepspeed=args.deepspeed,
            zero_stage=args.zero_stage,
            timeout=args.timeout,
            cluster=cluster,
        )
    except KeyboardInterrupt:  # the launch has cancelled the job and said where the ranks were
        print("nbaccel launch: stopped by SIGINT; the workers were ended.", file=sys.stderr)
        return 128 + signal.SIGINT  # as the local path, and a shell, say Ctrl-C
    except LaunchError as err:
        print(f"nbaccel launch --slurm: {err}", file=sys.stderr)
        return 1
    except (NbaccelError, ValueError) as err:
        raise UsageError(str(err)) from None
    return 0


def run_script(script: str, argv: list[str], module: bool) -> None:
    """One rank of ``nbaccel launch --slurm``: the script as ``python SCRIPT ARGS`` runs it
    (``sys.argv``, ``__main__``); ``sys.exit(0)`` is a success."""
    import runpy

    sys.argv = [script, *argv]
    if not module:
        sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` does
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The same ``LaunchConfig`` that ``notebook_launcher`` builds, its errors spelled as flags."""
    if args.master_addr is not None and args.master_port is None:  # torchrun would ignore it
        raise UsageError("--master-addr needs --master-port too (a free port on that machine)")
    try:
        return LaunchConfig.from_arguments(
            num_processes=args.num_processes,
            mixed_precision=args.mixed_precision,
            cpu=args.cpu,
            fsdp=args.fsdp,
            deepspeed=args.deepspeed,
            zero_stage=args.zero_stage,
            num_nodes=args.num_nodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            defaults=saved_config(),
            spelling=FLAGS,
        )
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


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


def seconds(text: str) -> float:
    """An argparse ``type``: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, e.g. 600") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def check_script(args: argparse.Namespace) -> None:
    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"{args.script!r} is not a file; for a module, add -m: launch -m NAME")


def check_gpus(nproc: int, gpus: int) -> None:
    """``LaunchConfig``'s GPU check, as the command line says it."""
    try:
        launch_check_gpus(nproc, gpus, FLAGS)
    except ValueError as err:
        raise UsageError(str(err)) from None
