"""The test cluster, once per session: two SLURM nodes on this machine (``cluster.py``), shared
with lesson 5's cluster section (``notebooks/conftest.py``) and stopped when the session ends.

Where ``make`` installed SLURM as root (CI), ``NBACCEL_SLURM=required`` and a cluster that
cannot start fails the tests; elsewhere they skip and say how to run them. While it runs,
``SLURM_CONF`` points SLURM's commands at it, in this process and the kernels it starts.
"""

from __future__ import annotations

import os

import pytest

from . import cluster as test_cluster


@pytest.fixture(scope="session")
def slurm():
    reason = test_cluster.why_not()
    if reason:
        if os.environ.get("NBACCEL_SLURM") == "required":
            pytest.fail(f"make installed SLURM, yet: {reason}")
        pytest.skip(f"{reason}; then `make test` runs these on a two-node cluster it starts")
    return test_cluster.shared()  # stopped when the session ends (lesson 5 runs on it too)


def pytest_sessionfinish(session):
    test_cluster.stop_shared()


@pytest.fixture
def empty_queue(slurm):
    """The cluster, with a check that the test left no job in its queue: a job the launch
    stopped may still be COMPLETING for SLURM's KillWait, so the queue is given a minute to
    drain (a hang guard; a job that stays fails the test)."""
    yield slurm
    assert slurm.drained(), f"the test left a job in SLURM's queue: {slurm.queue()}"
