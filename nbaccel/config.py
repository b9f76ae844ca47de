"""The ``nbaccel config`` file: the defaults that ``launch`` and ``notebook_launcher`` read.

One JSON file at ``$NBACCEL_CONFIG``, else ``$XDG_CONFIG_HOME/nbaccel/config.json``, else
``~/.config/nbaccel/config.json``, holding a ``Defaults``. Arguments given to a launch always
win over the file; ``launch_config.py`` resolves the two into one ``LaunchConfig``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

from .env import CONFIG_VAR
from .launch_config import Defaults, LaunchConfig, check_sharding, resolve_sharding

# LaunchConfig, check_sharding and resolve_sharding lived here once: their old import path works.
__all__ = [
    "Defaults",
    "LaunchConfig",
    "check_sharding",
    "config_path",
    "load_config",
    "resolve_sharding",
    "save_config",
]


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
