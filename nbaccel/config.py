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

    def __post_init__(self) -> None:
        check_mode(self.mixed_precision)
        n = self.num_processes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_processes={n!r} must be a positive int or null")
        for name in ("cpu", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")


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
