"""The lessons under pytest (nbval). Lesson 5's cluster section runs on a real SLURM cluster
where the tests can start one (root, with SLURM's packages: ``make test`` in CI): the two-node
test cluster of ``tests/slurm``, the same one the cluster tests use, started here if they did
not run, with ``SLURM_CONF`` set before the lesson's kernel starts, and stopped when the session
ends. Elsewhere the lesson says it skipped that section, and why.

nbval runs a lesson as a learner's Run All does: up to its first exercise, whose cell raises
NotImplementedError as shipped; ``tests/lessons/test_exercises.py`` runs the exercises, with
their solutions and their wrong answers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is a package of the repository, not an installed one
    sys.path.insert(0, str(ROOT))

from lessonbuild import exercises  # noqa: E402
from tests.slurm import cluster as test_cluster  # noqa: E402

ON_A_CLUSTER = ("05_scaling_lab.ipynb",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    past, keep, drop = set(), [], []
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's items: one per code cell, in order
        if cell is not None and (item.parent in past or exercises.tagged(cell, exercises.EXERCISE)):
            past.add(item.parent)
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Runs before the notebook's kernel starts (the file's setup follows this hook).
    if item.path.name not in ON_A_CLUSTER:
        return
    reason = test_cluster.why_not()
    if reason is None:
        try:
            test_cluster.shared()  # once per session: a failed start is remembered, not retried
        except RuntimeError as e:
            reason = str(e)  # the lesson then says it skipped its cluster section
    if reason is not None and os.environ.get("NBACCEL_SLURM") == "required":
        pytest.fail(f"make installed SLURM, yet: {reason}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    test_cluster.stop_shared()
