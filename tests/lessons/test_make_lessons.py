"""``make lessons`` writes every lesson of one run or none: not while other programs load the
machine (lessonbuild/load.py), not when a lesson's first output names another machine; and it
records the machine, the load and the Run All times in notebooks/README.md."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import nbformat
import pytest

from lessonbuild import runner
from lessonbuild.load import LIMIT_CORES, Load, LoadMeter
from nbaccel.lessons import machine

SIZE = 'SIZE = "small"\nfrom nbaccel.lessons import machine\nprint(machine())'


def make(path, *sources):
    cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path.read_bytes()


def test_load_counts_only_what_others_took():
    assert Load(wall=10.0, busy=21.0, own=20.0).others == pytest.approx(0.1)
    assert Load(wall=10.0, busy=5.0, own=6.0).others == 0.0  # a late sample: never below 0
    assert "ABOVE" in Load(wall=10.0, busy=25.0, own=20.0).verdict()
    assert "within" in Load(wall=10.0, busy=20.5, own=20.0).verdict()


@pytest.mark.process
def test_the_meter_counts_this_process_trees_cpu_as_its_own():
    with LoadMeter() as meter:
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass",
            ],
            timeout=120,
        )
    assert child.returncode == 0
    assert meter.load.own >= 0.9, meter.load  # the child's second, less one interval at most


@pytest.fixture
def busy_outsider():
    """A busy loop that is not this process's descendant (it was handed to init), so the meter
    must count it as another program's; ended by its pid."""
    read, write = os.pipe()
    code = (
        "import os, sys\n"
        "if os.fork(): os._exit(0)\n"
        "os.setsid()\n"
        f"os.write({write}, str(os.getpid()).encode()); os.close({write})\n"
        "while True: pass\n"
    )
    subprocess.run([sys.executable, "-c", code], pass_fds=(write,), check=True, timeout=60)
    os.close(write)
    pid = int(os.read(read, 32))
    os.close(read)
    yield pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # gone from /proc, or a zombie that init will reap
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_a_run_while_another_program_keeps_a_core_busy_writes_nothing(
    tmp_path, busy_outsider, capsys
):
    lesson = tmp_path / "01_small.ipynb"
    before = make(lesson, SIZE, "import time\ntime.sleep(2)")
    readme = tmp_path / "README.md"
    readme.write_text("# Lessons\n")
    assert runner.run_lessons([lesson], readme=readme) == 1
    err = capsys.readouterr().err
    assert "not written: other programs kept" in err and "cores busy" in err, err
    assert lesson.read_bytes() == before and readme.read_text() == "# Lessons\n"


@pytest.mark.multiprocess
def test_a_quiet_run_writes_every_lesson_and_records_the_machine(tmp_path, monkeypatch):
    quiet = Load(wall=5.0, busy=4.0, own=4.0)
    monkeypatch.setattr(LoadMeter, "__exit__", lambda self, *exc: setattr(self, "load", quiet))
    first, second = tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"
    make(first, SIZE, "x = 1")
    make(second, SIZE)
    lesson = nbformat.read(first, as_version=4)  # a core, then more, then an exercise
    exercise = nbformat.v4.new_code_cell("# Exercise 1: define y\nraise NotImplementedError()")
    exercise.metadata["tags"] = ["exercise"]
    lesson.cells += [
        nbformat.v4.new_markdown_cell("## Going further"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(0.1)"),
        exercise,
        nbformat.v4.new_code_cell("# Check: exercise 1\nassert 'y' in globals(), 'define y'"),
    ]
    nbformat.write(lesson, first)
    readme = tmp_path / "README.md"
    readme.write_text("# Lessons\n\nprose\n")
    assert runner.run_lessons([first, second], readme=readme) == 0
    ran = nbformat.read(first, as_version=4)
    assert runner.first_machine(ran) == machine()
    # Run All stops at the first exercise: it and its check ship unexecuted
    assert ran.cells[-3].outputs == [] and ran.cells[-3].execution_count == 3
    assert [c.get("outputs") for c in ran.cells[-2:]] == [[], []]
    assert [c.get("execution_count") for c in ran.cells[-2:]] == [None, None]
    text = readme.read_text()
    assert text.startswith("# Lessons\n\nprose\n") and machine() in text
    assert re.search(r"^\| `01_a.ipynb` \| \d+ \| \d+ \|$", text, re.M), text
    assert re.search(r"^\| `02_b.ipynb` \| - \| \d+ \|$", text, re.M), text  # no core
    assert f"0.00 cores busy on average over 5 s (within the {LIMIT_CORES:.2f}" in text
    runner.run_lessons([second], readme=readme)  # a later run of one lesson keeps the other row
    assert readme.read_text().count("| `01_a.ipynb` |") == 1


@pytest.mark.multiprocess
def test_a_lesson_that_does_not_name_its_machine_first_is_not_written(tmp_path, capsys):
    lesson = tmp_path / "01_a.ipynb"
    before = make(lesson, 'print("CPU: elsewhere, 64 cores (torch 0.1)")')
    assert runner.run_lessons([lesson], check_load=False, readme=None) == 1
    assert "names 'CPU: elsewhere" in capsys.readouterr().err
    assert lesson.read_bytes() == before
