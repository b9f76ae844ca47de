"""The test cluster, once per session: two SLURM nodes on this machine (``cluster.py``).

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
    cluster = test_cluster.start()
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    try:
        yield cluster
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()


@pytest.fixture
def empty_queue(slurm):
    """The cluster, with a check that the test left no job in its queue."""
    yield slurm
    assert slurm.queue() == [], "the test left a job in SLURM's queue"
