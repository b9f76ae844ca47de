"""One ``LaunchError``, raised by every failing path, and also torch's ``ChildFailedError``.

Code written for torchrun or Hugging Face Accelerate catches ``ChildFailedError``; nbaccel's
own catches ``nbaccel.LaunchError``. Each path that fails a launch is caught both ways here:
many ranks, one process run in this process, a value that cannot come back, a SLURM job (at
the unit level: no cluster). The class is made on first use (``errors.__getattr__``), so
``import nbaccel`` still imports no torch.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import nbaccel
from nbaccel import errors
from nbaccel.errors import NbaccelError, RankFailure
from nbaccel.launch import results
from nbaccel.launch.protocol import Result
from nbaccel.launch.slurm import queue, watch
from nbaccel.observe.records import Run

HANG = 120  # seconds: a launch that takes this long is hung, not slow


def test_one_class_whichever_way_it_is_imported():
    from nbaccel.errors import CellError, LaunchError

    assert nbaccel.LaunchError is LaunchError is errors.LaunchError
    assert nbaccel.CellError is CellError and issubclass(CellError, LaunchError)
    assert issubclass(LaunchError, ChildFailedError) and issubclass(LaunchError, NbaccelError)
    assert LaunchError.__module__ == "nbaccel.errors" and LaunchError.__qualname__ == "LaunchError"
    with pytest.raises(AttributeError, match="has no attribute 'Nonesuch'"):
        errors.Nonesuch  # noqa: B018


@pytest.mark.process
def test_importing_nbaccel_and_its_errors_imports_no_torch_until_the_class_is_asked_for():
    probe = (
        "import sys, nbaccel, nbaccel.errors\n"
        "before = 'torch' in sys.modules\n"
        "from nbaccel.errors import LaunchError\n"
        "print(before, 'torch' in sys.modules, LaunchError is nbaccel.LaunchError)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"]


def test_it_pickles_as_itself_with_its_failures_and_values():
    failure = RankFailure(1, 4242, 1, "ValueError", "bad batch")
    err = errors.LaunchError("rank 1 raised", [failure], results={0: "kept"})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.LaunchError and str(back) == "rank 1 raised"
    assert back.failures == [failure] and back.rank == 1 and back.results == {0: "kept"}
    cell = pickle.loads(pickle.dumps(errors.CellError("cell 3: rank 0 hung", hung=True)))
    assert type(cell) is errors.CellError and cell.hung and str(cell) == "cell 3: rank 0 hung"


def test_torchs_accessors_answer_with_the_root_cause():
    err = errors.LaunchError("x", [RankFailure(1, 4242, -9), RankFailure(0, 4241, 1)])
    rank, failure = err.get_first_failure()
    assert rank == 1 and failure.pid == 4242 and failure.exitcode == -9
    assert failure.message == "rank 1 (pid 4242) was killed by SIGKILL"
    assert err.format_msg() == "x" and err.name == "notebook_launcher"


def _caught_both_ways(launch) -> errors.LaunchError:
    """Run ``launch``: ``except ChildFailedError`` catches what it raises, and so does
    ``except nbaccel.LaunchError`` (the same object)."""
    try:
        launch()
    except ChildFailedError as err:
        caught = err
    else:
        raise AssertionError("nothing was raised")
    try:
        raise caught
    except nbaccel.LaunchError as err:
        assert type(err) is nbaccel.LaunchError
        return err


def _fails_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("bad batch")
    return 0


@pytest.mark.multiprocess
def test_many_ranks():
    err = _caught_both_ways(
        lambda: nbaccel.notebook_launcher(
            _fails_on_rank_1, num_processes=2, cpu=True, timeout=HANG, live=False
        )
    )
    assert err.rank == 1 and "raised ValueError: bad batch" in str(err)


def test_one_process_here():
    def fails():
        raise ValueError("bad batch")

    err = _caught_both_ways(
        lambda: nbaccel.notebook_launcher(fails, num_processes=1, cpu=True, live=False)
    )
    assert err.rank == 0 and str(err).endswith("raised ValueError: bad batch (traceback above)")


def test_a_value_that_cannot_come_back():
    ranks = [SimpleNamespace(rank=0, pid=4241, result=Result(b"not a pickle", "Prepared"))]
    err = _caught_both_ways(lambda: results.collect(ranks, False, Run()))
    assert str(err).startswith("rank 0 returned a Prepared that cannot be rebuilt")


def test_a_slurm_job_that_can_never_start(tmp_path, monkeypatch):
    log = tmp_path / "0_log.out"
    task = SimpleNamespace(paths=SimpleNamespace(stdout=log))
    job = SimpleNamespace(job_id="42", task=lambda i: task)
    monkeypatch.setattr(queue, "state", lambda job_id: ("PENDING", "PartitionNodeLimit", ""))
    monkeypatch.setattr(queue, "cancel", lambda job_id, patient=True: ("GONE", ""))
    watched = watch.Watch(job, Path(tmp_path), b"k" * 32, run=Run())
    err = _caught_both_ways(lambda: watched.until_done(timeout=None))
    assert str(err).startswith("SLURM job 42 can never start: it is pending (PartitionNodeLimit)")
