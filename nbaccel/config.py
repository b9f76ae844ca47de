"""The defaults that ``nbaccel config`` writes and ``launch``/``notebook_launcher`` read.

One JSON file at ``$NBACCEL_CONFIG``, else ``$XDG_CONFIG_HOME/nbaccel/config.json``, else
``~/.config/nbaccel/config.json``. Arguments given to a launch always win over the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .precision import check_mode


@dataclass(frozen=True)
class LaunchConfig:
    num_processes: int | None = None  # None: one per visible GPU, else 1
    mixed_precision: str = "no"
    cpu: bool = False
    fsdp: bool = False  # Accelerator() shards with FSDP2 instead of DDP
    zero_stage: int | None = None  # 0-3: Accelerator() trains through DeepSpeed at this stage

    def __post_init__(self) -> None:
        check_mode(self.mixed_precision)
        n = self.num_processes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_processes={n!r} must be a positive int or null")
        for name in ("cpu", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        check_sharding(self.fsdp, self.zero_stage)


def check_sharding(fsdp: bool, zero_stage: int | None) -> None:
    if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3)):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2, 3 or null (no DeepSpeed)")
    if fsdp and zero_stage is not None:
        raise ValueError(
            f"fsdp and DeepSpeed (zero_stage={zero_stage}) were both asked for: choose one way "
            "to shard"
        )


def resolve_sharding(
    config: LaunchConfig, fsdp: bool | None, deepspeed: bool | None, zero_stage: int | None
) -> tuple[bool, int | None]:
    """A launch's ``(fsdp, zero_stage)``: its own arguments, else the config file's.

    ``zero_stage`` implies DeepSpeed; ``deepspeed=True`` alone takes the config's stage, else 2;
    asking for one way to shard turns the config's other way off.
    """
    if zero_stage is not None or deepspeed:
        if deepspeed is False:
            raise ValueError(f"zero_stage={zero_stage} asks for DeepSpeed, but deepspeed=False")
        stage = zero_stage if zero_stage is not None else config.zero_stage
        stage = 2 if stage is None else stage
        check_sharding(bool(fsdp), stage)
        return False, stage
    if fsdp:
        return True, None
    stage = None if deepspeed is False else config.zero_stage
    return (config.fsdp if fsdp is None else False), stage


def config_path() -> Path:
    if os.environ.get("NBACCEL_CONFIG"):
        return Path(os.environ["NBACCEL_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "nbaccel" / "config.json"


def load_config(path: Path | None = None) -> LaunchConfig:
    """The saved defaults, or the built-in ones when no file exists."""
    path = path or config_path()
    if not path.is_file():
        return LaunchConfig()
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(LaunchConfig)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return LaunchConfig(**data)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"the nbaccel config file {path} is invalid: {err}. Fix it, or rewrite it with "
            "`nbaccel config --default`."
        ) from err


def save_config(config: LaunchConfig, path: Path | None = None) -> Path:
    """Write atomically (temporary file, then rename): a crash never leaves half a file."""
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(asdict(config), indent=2) + "\n")
    os.replace(tmp, path)
    return path
