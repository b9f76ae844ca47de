"""The words for what SLURM reports, and where a launch goes from inside an allocation: pure
functions and decisions, no cluster needed (the cluster tests run each on the real one)."""

from __future__ import annotations

import pytest

from nbaccel import NbaccelError, SlurmCluster
from nbaccel.launch.slurm import job, queue

FAILED = "sbatch: error: Batch job submission failed: "
REFUSALS = [
    ("sbatch: error: Memory specification can not be satisfied", "mem"),
    (FAILED + "Invalid feature specification", "constraint"),
    (FAILED + "Invalid account or account/partition combination specified", "account"),
    (FAILED + "Requested time limit is invalid (missing or exceeds some limit)", "time"),
    (
        FAILED + "Requested node configuration is not available",
        "cpus_per_task, mem or gpus_per_node",
    ),
]


@pytest.mark.parametrize(("sbatch_said", "option"), REFUSALS)
def test_an_sbatch_refusal_is_one_sentence_naming_the_option(sbatch_said, option):
    said = queue.refusal(f"some submitit preamble\n{sbatch_said}\n")
    assert said.startswith("sbatch refused the job: "), said
    assert "Batch job submission failed" not in said and "sbatch: error" not in said
    assert f"change {option} " in said and said.endswith("Nothing was submitted.")
    assert "\n" not in said


def test_an_unknown_refusal_still_points_at_the_options():
    said = queue.refusal("sbatch: error: Batch job submission failed: Something new")
    assert said.startswith("sbatch refused the job: Something new; change the SlurmCluster option")


def test_each_reason_that_never_resolves_names_what_to_change():
    for reason, asks in queue.NEVER_STARTS.items():
        said = queue.never_starts("7", reason)
        assert said.startswith(f"SLURM job 7 can never start: it is pending ({reason})"), said
        assert asks in said and "it was cancelled" in said
        assert "(" in asks and "=" in asks  # each one names an option to change


def inside(monkeypatch, nodes: int) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", str(nodes))


def test_outside_an_allocation_a_launch_is_a_new_job(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert job._as_step(SlurmCluster(folder=tmp_path), 2) is False


def test_inside_an_allocation_with_the_nodes_a_launch_is_a_step(monkeypatch, tmp_path, capsys):
    inside(monkeypatch, 2)
    assert job._as_step(SlurmCluster(folder=tmp_path), 2) is True
    assert job._as_step(SlurmCluster(folder=tmp_path, new_job=True), 2) is False
    assert capsys.readouterr().err == ""


def test_inside_a_smaller_allocation_a_launch_is_a_new_job_said_in_one_line(
    monkeypatch, tmp_path, capsys
):
    inside(monkeypatch, 1)
    assert job._as_step(SlurmCluster(folder=tmp_path), 2) is False
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "inside SLURM job 42 (1 node); num_nodes=2" in said
    with pytest.raises(NbaccelError, match=r"allocation 42 has 1 node; num_nodes=2 cannot run"):
        job._as_step(SlurmCluster(folder=tmp_path, new_job=False), 2)


def test_new_job_takes_none_true_or_false(tmp_path):
    with pytest.raises(NbaccelError, match=r"SlurmCluster\(new_job='yes'\): give None, True or"):
        SlurmCluster(folder=tmp_path, new_job="yes")


def test_sbatch_from_inside_a_job_leaves_its_variables_out_and_puts_them_back(monkeypatch):
    import os

    inside(monkeypatch, 1)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "7")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    with job._outside_allocation():
        assert "SLURM_JOB_ID" not in os.environ and "SLURM_CPUS_PER_TASK" not in os.environ
        assert os.environ["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert os.environ["SLURM_JOB_ID"] == "42" and os.environ["SLURM_CPUS_PER_TASK"] == "7"
