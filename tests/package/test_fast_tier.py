"""``make check``'s tier (tests/conftest.py, ``pytest --fast``): it leaves out what the markers
and nbval mark as starting processes, and fails a test of its own that starts one. These tests
start nothing: when the refusal they test is broken, the tier's own refusal (or, outside the
tier, a child that exits at once) is what runs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest


def _fork() -> None:
    pid = os.fork()
    if pid == 0:  # only if the refusal failed: a child that leaves at once
        os._exit(0)
    os.waitpid(pid, 0)


def _spawn() -> None:
    process = multiprocessing.get_context("spawn").Process(target=os.getpid)
    process.start()
    process.join()


STARTS = {
    "subprocess.Popen": lambda: subprocess.run(["true"], check=False),
    "os.fork": _fork,
    "a multiprocessing Process": _spawn,
    "os.system": lambda: os.system("true"),
}


@pytest.mark.parametrize("what", STARTS)
def test_each_way_of_starting_a_process_is_refused_and_named(what):
    originals = [getattr(owner, name) for owner, name, _ in conftest._STARTS]
    refused = pytest.raises(conftest.ProcessStarted, match=r"test_y started a process .*mark")
    with conftest._processes_refused("tests/x.py::test_y") as tried, refused:
        STARTS[what]()
    assert len(tried) == 1 and tried[0].startswith(what), tried
    assert [getattr(owner, name) for owner, name, _ in conftest._STARTS] == originals


def _phase(fast: bool):
    item = SimpleNamespace(nodeid="t", config=SimpleNamespace(getoption=lambda name: fast))
    return conftest._guarded_phase(item)


def test_a_test_that_catches_the_refusal_still_fails():
    phase = _phase(fast=True)
    next(phase)  # the phase begins: starts are refused
    try:
        subprocess.run(["true"], check=False)
    except Exception:
        pass  # code under test that swallows the error
    with pytest.raises(conftest.ProcessStarted, match="t started a process"):
        phase.send(None)


def test_outside_the_fast_tier_nothing_is_patched():
    phase = _phase(fast=False)
    before = subprocess.Popen.__init__
    next(phase)
    assert subprocess.Popen.__init__ is before
    with pytest.raises(StopIteration):
        phase.send(None)


def test_the_tier_leaves_out_the_marked_tests_and_the_notebooks():
    def item(name: str, *marks: str):
        return SimpleNamespace(
            name=name,
            path=Path(name),
            get_closest_marker=lambda mark: mark if mark in marks else None,
        )

    items = [
        item("test_a.py"),
        item("test_b.py", "process"),
        item("test_c.py", "multiprocess"),
        item("01_lesson.ipynb"),
        item("test_d.py", "gpu"),
        item("test_e.py", "parametrize"),
    ]
    deselected = []
    config = SimpleNamespace(
        getoption=lambda name: True,
        hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
    )
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["test_a.py", "test_e.py"]
    assert len(deselected) == 4
