"""The process's environment variables for a while, and the kernel check: Accelerate's
``patch_environment``, ``clear_environment`` and ``check_os_kernel``, under its names."""

from __future__ import annotations

import contextlib
import os
import platform
import re
from collections.abc import Iterator
from typing import Any

from .logging_utils import get_logger

__all__ = ["check_os_kernel", "clear_environment", "patch_environment"]

logger = get_logger(__name__)

_MIN_KERNEL = (5, 5, 0)  # older Linux kernels can hang the processes (Accelerate's issue #1929)


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set each keyword as an environment variable (its name upper-cased, its value as a
    string) inside the ``with`` block; afterwards, even after an error, each variable has its
    earlier value again, or is gone if it had none."""
    names = {key.upper(): str(value) for key, value in kwargs.items()}
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """No environment variables at all inside the ``with`` block; afterwards, even after an
    error, exactly the earlier ones (any set inside are dropped)."""
    before = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def check_os_kernel() -> None:
    """Log a warning on Linux older than 5.5, where the processes can hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if match is None:
        return  # a release string without a version: nothing to compare
    version = tuple(int(part) for part in match.groups())
    if version < _MIN_KERNEL:
        found, least = match.group(0), ".".join(map(str, _MIN_KERNEL))
        logger.warning(
            f"Detected kernel version {found}, which is below the recommended minimum of "
            f"{least}; this can cause the processes to hang. Upgrade the kernel to {least} or "
            "newer."
        )
