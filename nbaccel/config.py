"""Every launch option, resolved once: ``LaunchConfig``, and the file of defaults behind it.

``notebook_launcher`` and ``nbaccel launch`` both build one with ``LaunchConfig.from_arguments``:
an argument that was given wins, then the ``nbaccel config`` file's value (``Defaults``, read by
``load_config`` and written by ``save_config``), then the built-in default; the machine decides
the rest (its GPUs). This is torch's ``distributed/run.py`` habit: the command line is a thin
parser that builds the same config object as the Python API, so each option is checked here,
once. Only the spelling of an error differs: ``num_processes=2`` for the API,
``--num-processes 2`` for the CLI.

The workers get the launch through their environment (``to_environ``) and read it back with
``LaunchConfig.from_environ``, so ``Accelerator()`` inside a worker needs no arguments.

The vocabulary of the options is here too, one spelling each: the mixed-precision modes
(``"no" | "fp16" | "bf16"``), the ZeRO stages, a length of time.

The ``nbaccel config`` file is one JSON file at ``$NBACCEL_CONFIG``, else
``$XDG_CONFIG_HOME/nbaccel/config.json``, else ``~/.config/nbaccel/config.json``, holding a
``Defaults``. Arguments given to a launch always win over it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import InitVar, asdict, dataclass, fields
from pathlib import Path
from typing import Literal, get_args

from .env import (
    CONFIG_VAR,
    CPU_VAR,
    DEEPSPEED_VAR,
    FSDP_VAR,
    MIXED_PRECISION_VAR,
    accelerate_defaults,
    threads_per_worker,
    visible_gpus,
)

MixedPrecision = Literal["no", "fp16", "bf16"]
MODES: tuple[str, ...] = get_args(MixedPrecision)
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Spelling:
    """How an error names an option: as a keyword argument (``num_processes=2``), or as the
    flag of ``nbaccel launch`` that sets it (``--num-processes 2``)."""

    flags: bool = False

    def __call__(self, name: str, value: object = ...) -> str:
        if not self.flags:
            return name if value is ... else f"{name}={value!r}"
        flag = "--" + name.replace("_", "-")
        if value is ... or value is True:
            return flag
        if value is False:
            return f"--no-{flag[2:]}"
        return f"{flag} {value}"


KEYWORDS, FLAGS = Spelling(), Spelling(flags=True)


@dataclass(frozen=True)
class Defaults:
    """What ``nbaccel config`` saves: the values a launch takes where its arguments say nothing."""

    num_processes: int | None = None  # None: one per visible GPU, else 1
    mixed_precision: str = "no"
    cpu: bool = False
    fsdp: bool = False  # Accelerator() shards with FSDP2 instead of DDP
    zero_stage: int | None = None  # 0-3: Accelerator() trains through DeepSpeed at this stage
    # A cluster's defaults, for SlurmCluster() (launch/slurm): None leaves SLURM's own.
    slurm_partition: str | None = None
    slurm_account: str | None = None
    slurm_time: int | str | None = None  # minutes, or SLURM's "1:30:00"; None: 60 minutes
    # In a Jupyter kernel, start the worker server when the launcher is imported (launch/client.py)
    prestart: bool = True

    def __post_init__(self) -> None:
        check_mode(self.mixed_precision)
        for name in ("slurm_partition", "slurm_account"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} must be a name or null")
        t = self.slurm_time
        if (
            t is not None
            and not (isinstance(t, str) and t)
            and not (isinstance(t, int) and not isinstance(t, bool) and t > 0)
        ):
            raise ValueError(f"slurm_time={t!r} must be minutes (> 0), SLURM's '1:30:00', or null")
        n = self.num_processes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_processes={n!r} must be a positive int or null")
        for name in ("cpu", "fsdp", "prestart"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        check_sharding(self.fsdp, self.zero_stage)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch's options, checked: what the launcher starts and what its workers read.

    Build it with ``from_arguments`` where the launch starts, ``from_environ`` in a worker.
    A worker knows only what its environment says; the other fields keep their defaults.
    """

    num_processes: int = 1  # workers on this machine
    mixed_precision: str | None = None  # None: the launch set none (the Accelerator's "no")
    cpu: bool | None = None  # None: not said (GPUs where there are any)
    fsdp: bool = False  # Accelerator() shards with FSDP2 instead of DDP
    zero_stage: int | None = None  # 0-3: Accelerator() trains through DeepSpeed at this stage
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # node 0's address; None: this machine
    master_port: int | None = None  # None (one node only): a free port, picked at launch
    max_restarts: int = 0  # torch elastic's: restart every worker after a failure, this often
    gpus: int = 0  # the GPUs this machine's workers use: 0 on the CPU
    spelling: InitVar[Spelling] = KEYWORDS  # how errors name the options; not a field

    def __post_init__(self, spelling: Spelling) -> None:
        say = spelling
        for name in ("num_processes", "num_nodes"):
            check_count(name, getattr(self, name), say)
        if self.mixed_precision is not None:
            check_mode(self.mixed_precision)
        if self.cpu is not None and not isinstance(self.cpu, bool):
            raise TypeError(f"{say('cpu', self.cpu)} must be True, False or None")
        check_sharding(self.fsdp, self.zero_stage, say)
        check_gpus(self.num_processes, self.gpus, say)
        self._check_nodes(say)
        m = self.max_restarts
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(
                f"{say('max_restarts', m)} must be an int, e.g. {say('max_restarts', 2)}"
            )
        if m < 0:
            raise ValueError(f"{say('max_restarts', m)} must be 0 (no restarts) or more")

    def _check_nodes(self, say: Spelling) -> None:
        rank, nodes, port = self.node_rank, self.num_nodes, self.master_port
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nodes:
            kind = "" if say.flags else "an int "  # argparse made it an int already
            raise ValueError(
                f"{say('node_rank', rank)} must be {kind}in 0..{nodes - 1} for "
                f"{say('num_nodes', nodes)}"
            )
        if nodes > 1 and None in (self.master_addr, port):
            addr, port_ = say("master_addr"), say("master_port")
            raise ValueError(
                f"several nodes must agree on where to meet: pass {addr} (node 0's address) "
                f"and {port_} (a free port on node 0); pass the same {addr} and {port_} on "
                "every node"
            )
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
            raise TypeError(f"{say('master_port', port)} must be an int, e.g. 29500")
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"{say('master_port', port)} is not a port: use 1024..65535")

    @classmethod
    def from_arguments(
        cls,
        *,
        num_processes: int | None = None,
        mixed_precision: str | None = None,
        cpu: bool | None = None,
        fsdp: bool | None = None,
        deepspeed: bool | None = None,
        zero_stage: int | None = None,
        num_nodes: int = 1,
        node_rank: int = 0,
        master_addr: str | None = None,
        master_port: int | None = None,
        max_restarts: int = 0,
        defaults: Defaults | None = None,
        gpus: int | None = None,
        spelling: Spelling = KEYWORDS,
    ) -> LaunchConfig:
        """The launching side: each argument given wins, then the ``nbaccel config`` file's
        value (``defaults``), then the built-in one. ``gpus`` defaults to the visible GPUs
        (none with ``cpu``); they set the device and the default number of processes.
        ``deepspeed``/``zero_stage`` resolve into ``zero_stage`` (see ``resolve_sharding``)."""
        defaults = Defaults() if defaults is None else defaults
        cpu = defaults.cpu if cpu is None else bool(cpu)
        fsdp, zero_stage = resolve_sharding(defaults, fsdp, deepspeed, zero_stage, spelling)
        gpus = 0 if cpu else visible_gpus() if gpus is None else gpus
        if num_processes is None:
            num_processes = defaults.num_processes or max(gpus, 1)
        return cls(
            num_processes=num_processes,
            mixed_precision=mixed_precision or defaults.mixed_precision,
            cpu=cpu,
            fsdp=fsdp,
            zero_stage=zero_stage,
            num_nodes=num_nodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            max_restarts=max_restarts,
            gpus=gpus,
            spelling=spelling,
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchConfig:
        """The worker side: the launch's options, read back from what ``to_environ`` wrote.

        A variable that is unset (or empty) was not said: ``mixed_precision``/``cpu`` read as
        None, ``fsdp`` as False, ``zero_stage`` as None. Plain ``torchrun`` sets none of them.
        """
        environ = os.environ if environ is None else environ
        mixed = environ.get(MIXED_PRECISION_VAR) or None
        if mixed is not None and mixed not in MODES:
            raise ValueError(
                f"the environment variable {MIXED_PRECISION_VAR}={mixed!r} is not one of "
                f"{', '.join(MODES)}; the launch sets it (mixed_precision=..., "
                "--mixed-precision), so set it to one of those or unset it"
            )
        stage = environ.get(DEEPSPEED_VAR) or None
        if stage is not None and stage not in tuple(map(str, ZERO_STAGES)):
            raise ValueError(
                f"the environment variable {DEEPSPEED_VAR}={stage!r} must be a ZeRO stage, "
                "0, 1, 2 or 3, or empty for no DeepSpeed"
            )
        try:
            return cls(
                mixed_precision=mixed,
                cpu=_flag(environ, CPU_VAR),
                fsdp=bool(_flag(environ, FSDP_VAR)),
                zero_stage=None if stage is None else int(stage),
            )
        except ValueError as err:
            raise ValueError(
                f"the launch's variables {FSDP_VAR} and {DEEPSPEED_VAR} disagree: {err}"
            ) from None

    def to_environ(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables that carry this launch to its workers, to add to ``environ`` (default
        ``os.environ``), whose own ``OMP_NUM_THREADS`` and ``ACCELERATE_USE_CPU`` win."""
        environ = os.environ if environ is None else environ
        variables = {
            FSDP_VAR: "1" if self.fsdp else "0",
            DEEPSPEED_VAR: "" if self.zero_stage is None else str(self.zero_stage),
            "OMP_NUM_THREADS": str(threads_per_worker(self.num_processes, environ)),
        }
        if self.mixed_precision is not None:
            variables[MIXED_PRECISION_VAR] = self.mixed_precision
        if self.cpu is not None:
            variables[CPU_VAR] = "1" if self.cpu else "0"
        variables.update(accelerate_defaults(self.gpus, self.mixed_precision or "no", environ))
        return variables

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes


# -- the checks, each written once ---------------------------------------------------------------
def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(
            f"mixed_precision={mode!r} is not one of {', '.join(map(repr, MODES))}. "
            'Use "no" for float32, "bf16" or "fp16" for mixed precision.'
        )
    return mode  # type: ignore[return-value]


def check_seconds(
    name: str, value: object, example: str, none: str | None = None, default: bool = True
) -> float | None:
    """A launch's length of time: a positive, finite number of seconds (``example``, the
    default unless ``default=False``), or ``None`` where ``none`` says what None means."""
    if value is None and none is not None:
        return None
    also = f", or None to {none}" if none is not None else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r} must be a number of seconds, e.g. {example}{also}")
    if not (value > 0 and math.isfinite(value)):
        the_default = " (the default)" if default else ""
        raise ValueError(
            f"{name}={value} must be a positive, finite number of seconds, e.g. "
            f"{example}{the_default}{also}"
        )
    return float(value)


def check_count(name: str, value: object, say: Spelling = KEYWORDS) -> None:
    """A number of processes or nodes: an int, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{say(name, value)} must be an int, e.g. {say(name, 2)}")
    if value < 1:
        raise ValueError(f"{say(name, value)} must be at least 1")


def check_gpus(num_processes: int, gpus: int, say: Spelling = KEYWORDS) -> None:
    """One worker per GPU: more workers than GPUs would share one, which NCCL refuses."""
    if gpus and num_processes > gpus:
        raise ValueError(
            f"{say('num_processes', num_processes)} but this machine has {gpus} visible GPU(s): "
            f"one worker per GPU. Use {say('num_processes', gpus)} or fewer, or "
            f"{say('cpu', True)} to run {num_processes} workers on the CPU."
        )


def check_sharding(fsdp: bool, zero_stage: int | None, say: Spelling = KEYWORDS) -> None:
    """A ZeRO stage is 0-3, and a model is sharded one way: FSDP or DeepSpeed, not both."""
    if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES):
        raise ValueError(
            f"{say('zero_stage', zero_stage)} must be 0, 1, 2, 3 or null (no DeepSpeed)"
        )
    if fsdp and zero_stage is not None:
        raise ValueError(
            f"{say('fsdp', True)} and DeepSpeed ({say('zero_stage', zero_stage)}) were both "
            "asked for: choose one way to shard"
        )


def resolve_sharding(
    defaults: Defaults,
    fsdp: bool | None,
    deepspeed: bool | None,
    zero_stage: int | None,
    say: Spelling = KEYWORDS,
) -> tuple[bool, int | None]:
    """A launch's ``(fsdp, zero_stage)``: its own arguments, else the config file's.

    ``zero_stage`` implies DeepSpeed; ``deepspeed=True`` alone takes the file's stage, else 2;
    asking for one way to shard turns the file's other way off.
    """
    if zero_stage is not None or deepspeed:
        if deepspeed is False:
            raise ValueError(
                f"{say('zero_stage', zero_stage)} asks for DeepSpeed, but {say('deepspeed', False)}"
            )
        stage = zero_stage if zero_stage is not None else defaults.zero_stage
        stage = 2 if stage is None else stage
        check_sharding(bool(fsdp), stage, say)
        return False, stage
    if fsdp:
        return True, None
    stage = None if deepspeed is False else defaults.zero_stage
    return (defaults.fsdp if fsdp is None else False), stage


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    value = environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"the environment variable {name}={value!r} must be 1, 0 or unset")
    return None if value == "" else value == "1"


# -- the `nbaccel config` file -------------------------------------------------------------------
def config_path() -> Path:
    if os.environ.get(CONFIG_VAR):
        return Path(os.environ[CONFIG_VAR])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "nbaccel" / "config.json"


def load_config(path: Path | None = None) -> Defaults:
    """The saved defaults, or the built-in ones when no file exists."""
    path = path or config_path()
    if not path.is_file():
        return Defaults()
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(Defaults)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return Defaults(**data)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"the nbaccel config file {path} is invalid: {err}. Fix it, or rewrite it with "
            "`nbaccel config --default`."
        ) from err


def save_config(config: Defaults, path: Path | None = None) -> Path:
    """Write atomically (temporary file, then rename): a crash never leaves half a file."""
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(asdict(config), indent=2) + "\n")
    os.replace(tmp, path)
    return path
