"""``nbaccel config``'s readers of its flags (``commands/config.py``)."""

from __future__ import annotations

from argparse import ArgumentTypeError

import pytest

from nbaccel.commands.config import minutes


def test_config_reads_the_slurm_time_as_slurmcluster_does():
    """One reading of SLURM's time forms for both: ``minutes`` calls SlurmCluster's."""
    assert [minutes(t) for t in ("90", "2-00:30:00", "UNLIMITED", "none")] == [
        90, "2-00:30:00", "UNLIMITED", "none",
    ]  # fmt: skip
    with pytest.raises(
        ArgumentTypeError,
        match=r"'1:2:3:4' is not a SLURM time limit; SLURM's forms: .*; e\.g\. 30",
    ):
        minutes("1:2:3:4")  # all digits and colons, which the old check let through
    with pytest.raises(ArgumentTypeError, match=r"'0': give more than 0 minutes, e\.g\. 30"):
        minutes("0")
