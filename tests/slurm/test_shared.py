"""The session's shared test cluster (``cluster.shared``): a start that failed is remembered."""

from __future__ import annotations

import pytest

from tests.slurm import cluster


def test_a_failed_start_is_said_again_not_retried(monkeypatch):
    # Lesson 5 asks for the cluster before each of its cells: a retry would wait for a start
    # that already failed, once per cell.
    calls = []

    def start():
        calls.append(1)
        raise OSError("munged would not start")

    monkeypatch.setattr(cluster, "start", start)
    monkeypatch.setattr(cluster, "_shared", [])  # the session's own cluster is put back after
    monkeypatch.setattr(cluster, "_failed", [])
    for _ in range(3):
        with pytest.raises(RuntimeError, match="did not start: munged would not start"):
            cluster.shared()
    assert len(calls) == 1
