"""A pytest plugin for ``accelerate_units``: each test's outcome, and whether nbaccel ran in it.

Loaded into each side's pytest run (``-p tests.compat.units_probe``). For each test it writes
one JSON line to the file named by ``$NBACCEL_UNITS_REPORT``: its id, its outcome (``passed``,
``failed`` or ``skipped``, over set-up, call and tear-down), the first line of the failure, and
whether the test's own body (its call phase, not its fixtures) called into the ``nbaccel``
package. For that, a profile function watches the call phase for the first call into one of
nbaccel's modules, notes it and steps aside, so a test that reaches nbaccel early pays almost
nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

PACKAGE = str(Path(__file__).resolve().parents[2] / "nbaccel") + os.sep
_ran_nbaccel: set[str] = set()
_current: dict[str, list] = {}  # the reports of the test running, by id


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    def probe(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            _ran_nbaccel.add(item.nodeid)
            sys.setprofile(None)

    sys.setprofile(probe)
    try:
        yield
    finally:
        sys.setprofile(None)


def pytest_runtest_logreport(report):
    reports = _current.get(report.nodeid)
    if reports is not None:
        reports.append(report)


def pytest_runtest_logstart(nodeid, location):
    _current[nodeid] = []


def pytest_runtest_logfinish(nodeid, location):
    reports = _current.pop(nodeid, [])
    outcome, message = "passed", ""
    for report in reports:
        if report.failed:
            outcome, message = "failed", _first_line(report)
            break
        if report.skipped:
            outcome, message = "skipped", _first_line(report)
    _write(nodeid, outcome, message, nodeid in _ran_nbaccel)


def pytest_collectreport(report):
    if report.failed:  # a file that cannot be imported: its tests never ran
        _write(report.nodeid, "failed", _first_line(report), False)


def _first_line(report) -> str:
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[2])[:300]
    text = str(report.longrepr or "")
    errors = [line for line in text.splitlines() if line.startswith("E ")]
    line = errors[0][1:].strip() if errors else (text.splitlines() or [""])[-1]
    return line[:300]


def _write(nodeid: str, outcome: str, message: str, ran_nbaccel: bool) -> None:
    path = os.environ.get("NBACCEL_UNITS_REPORT")
    if path:
        record = {"id": nodeid, "outcome": outcome, "message": message, "nbaccel": ran_nbaccel}
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")
