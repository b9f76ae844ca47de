"""The job folder's seal (``launch/slurm/folder.py``): what the launch's own processes write is
read, anything else is refused, logged and never unpickled. No cluster needed: the files are
written by the same code the ranks and nodes run, and forged beside them."""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets

import pytest

from nbaccel import Run
from nbaccel.launch.slurm.folder import JobFolder, error_path, stacks_answer, write_sealed
from nbaccel.launch.slurm.node import answer_request
from nbaccel.observe.channel import Channel, seal


class Bomb:
    """Unpickling this creates ``path``: a forged frame that is unpickled leaves a trace."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def key():
    return secrets.token_bytes(32)


def rank_writes(folder, key, monkeypatch, rank: int, step: int, loss: float) -> None:
    """What a rank on a cluster does: its channel appends a sealed batch to the folder."""
    monkeypatch.setenv("NBACCEL_METRICS_DIR", str(folder))
    monkeypatch.setenv("NBACCEL_JOB_KEY", key.hex())
    channel = Channel.from_environ(rank)
    channel.add(step, {"loss": loss})
    channel.flush()


def append_frame(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(len(data).to_bytes(4, "big") + data)


def test_a_forged_batch_of_records_is_refused_logged_and_never_unpickled(
    tmp_path, key, monkeypatch, caplog, capsys
):
    rank_writes(tmp_path, key, monkeypatch, rank=0, step=1, loss=0.5)
    path = tmp_path / "metrics-0.bin"
    trace = tmp_path / "unpickled"
    # Forgeries: a pickle (as the local channel's datagrams are), the right JSON without the
    # seal, and the right JSON sealed with another launch's key.
    append_frame(path, pickle.dumps(("metrics", 0, 0, [(2, 1.0, "loss", 99.0)], Bomb(str(trace)))))
    body = json.dumps(["metrics", 0, 0, [[3, 1.0, "loss", 99.0]]]).encode()
    append_frame(path, b"\0" * 32 + body)
    append_frame(path, seal(secrets.token_bytes(32), body))
    rank_writes(tmp_path, key, monkeypatch, rank=0, step=4, loss=0.25)  # the rank again
    run = Run()
    with caplog.at_level(logging.WARNING, logger="nbaccel.launch.slurm.folder"):
        JobFolder(tmp_path, key, "SLURM job 7").relay(run, None)
    assert run.series("loss") == {0: ([1, 4], [0.5, 0.25])}  # the rank's own, nothing forged
    assert not trace.exists()
    assert "refused a batch of records without this launch's seal in metrics-0.bin" in caplog.text
    assert capsys.readouterr().err.count("nbaccel: refused") == 1  # said once per file


def test_a_false_batch_length_is_refused_not_waited_for(tmp_path, key, monkeypatch, capsys):
    # A length prefix no rank wrote (4 GiB) would otherwise keep the reader waiting for bytes
    # forever, and hide every later batch without a word.
    rank_writes(tmp_path, key, monkeypatch, rank=0, step=1, loss=0.5)
    rank_writes(tmp_path, key, monkeypatch, rank=1, step=1, loss=0.75)
    with open(tmp_path / "metrics-0.bin", "ab") as f:
        f.write((2**32 - 1).to_bytes(4, "big") + b"junk")
    rank_writes(tmp_path, key, monkeypatch, rank=0, step=2, loss=0.25)
    folder, run = JobFolder(tmp_path, key, "SLURM job 7"), Run()
    folder.relay(run, None)
    rank_writes(tmp_path, key, monkeypatch, rank=1, step=2, loss=0.5)
    folder.relay(run, None)  # the other rank's file is still read
    assert run.series("loss") == {0: ([1], [0.5]), 1: ([1, 2], [0.75, 0.5])}
    err = capsys.readouterr().err
    assert "refused a batch length of 4,294,967,295 bytes" in err
    assert err.count("nbaccel: refused") == 1


def test_a_forged_error_file_names_no_rank(tmp_path, key, caplog):
    real = {"rank": 1, "pid": 5, "exc_type": "ValueError", "message": "bad", "traceback": "tb",
            "node": "n2", "secondary": False}  # fmt: skip
    write_sealed(error_path(tmp_path, 1), key, real)
    forged = {**real, "rank": 0, "message": "forged"}
    error_path(tmp_path, 0).write_text(json.dumps(forged))  # no seal
    write_sealed(error_path(tmp_path, 2), secrets.token_bytes(32), {**forged, "rank": 2})
    files = JobFolder(tmp_path, key, "SLURM job 7")
    with caplog.at_level(logging.WARNING, logger="nbaccel.launch.slurm.folder"):
        failures = files.failures()
    assert [(f.rank, f.node, f.message) for f in failures] == [(1, "n2", "bad")]
    assert "rank-0.error.json does not carry this launch's seal" in caplog.text
    assert "rank-2.error.json does not carry this launch's seal" in caplog.text


def test_a_node_answers_only_the_launchs_own_stack_request(tmp_path, key, capsys):
    stacks_dir = tmp_path / "stacks"  # the node's ranks' sockets: none here
    stacks_dir.mkdir()
    (tmp_path / "stacks.request").write_text(json.dumps("forged1"))  # no seal
    seen = answer_request(tmp_path, str(stacks_dir), 0, key, None)
    assert not stacks_answer(tmp_path, "forged1", 0).exists()
    assert "nbaccel: refused a stack request" in capsys.readouterr().err
    write_sealed(tmp_path / "stacks.request", key, "abc123")
    answer_request(tmp_path, str(stacks_dir), 0, key, seen)
    answer = stacks_answer(tmp_path, "abc123", 0)
    assert JobFolder(tmp_path, key, "job").answers([answer]) == {}  # sealed, and no ranks
    forged = stacks_answer(tmp_path, "abc123", 1)
    forged.write_text(json.dumps({"0": None}))
    assert JobFolder(tmp_path, key, "job").answers([answer, forged]) == {}


def test_the_folder_files_are_the_users_alone(tmp_path, key, monkeypatch):
    rank_writes(tmp_path, key, monkeypatch, rank=3, step=1, loss=1.0)
    assert os.stat(tmp_path / "metrics-3.bin").st_mode & 0o077 == 0


def test_a_metrics_folder_without_the_launchs_key_records_into_the_run(tmp_path, monkeypatch):
    """Logging never raises: a folder without a key (set by hand, not by a launch) is not a
    channel anyone accepts, so the records stay in the rank's own run."""
    monkeypatch.setenv("NBACCEL_METRICS_DIR", str(tmp_path))
    monkeypatch.delenv("NBACCEL_JOB_KEY", raising=False)
    run = Run()
    channel = Channel.from_environ(0, run)
    channel.add(1, {"loss": 0.5})
    assert not channel.connected and run.series("loss") == {0: ([1], [0.5])}
    assert list(tmp_path.iterdir()) == []


def test_only_the_jobs_own_task_logs_are_relayed(tmp_path, key, capsys):
    # submitit names a task's log <job id>_<task>_log.out; anything else can write a file named
    # so into the folder, and its lines would read as a rank's output.
    own = tmp_path / "5_0_log.out"
    own.write_text("[rank 0] step 1\nagent line, left in the log\n")
    (tmp_path / "6_0_log.out").write_text("[rank 1] forged\n")
    later = tmp_path / "5_1_log.out"  # the second node's task, not started yet
    JobFolder(tmp_path, key, "SLURM job 5", logs=[own, later]).relay(None, None)
    assert capsys.readouterr().out == "[rank 0] step 1\n"
    JobFolder(tmp_path, key, "SLURM job 5").relay(None, None)  # told none: every log, as before
    assert capsys.readouterr().out == "[rank 0] step 1\n[rank 1] forged\n"


def test_an_entry_named_like_an_error_file_that_is_no_file_is_refused_once(tmp_path, key, capsys):
    # A directory where an error file goes made the watch raise IsADirectoryError, and the
    # launch then cancelled a healthy job.
    real = {"rank": 1, "pid": 5, "exc_type": "ValueError", "message": "bad", "traceback": "tb",
            "node": "n2", "secondary": False}  # fmt: skip
    write_sealed(error_path(tmp_path, 1), key, real)
    error_path(tmp_path, 5).mkdir()
    answer = stacks_answer(tmp_path, "abc123", 0)
    answer.mkdir()
    files = JobFolder(tmp_path, key, "SLURM job 7")
    for _ in range(2):  # the watch reads the folder again at every poll
        assert [f.rank for f in files.failures()] == [1]
        assert files.answers([answer]) == {}
    err = capsys.readouterr().err
    assert f"refused an entry that cannot be read as a file in {error_path(tmp_path, 5)}" in err
    assert f"refused an entry that cannot be read as a file in {answer}" in err
    assert err.count("nbaccel: refused") == 2  # each said once
