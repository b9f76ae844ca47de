"""One-way imports: what is imported where, checked in a fresh interpreter.

Data flows worker -> ``channel`` -> ``records`` -> ``live`` (the view): the view is imported
only where something draws, and a worker that sends its numbers never imports it.
The projection model imports neither torch nor its figure; the notebook build tooling is
outside the package.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


def imported_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The ``nbaccel``, ``torch`` and ``matplotlib`` modules loaded once ``code`` has run."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('nbaccel', 'torch', 'matplotlib', 'lessonbuild'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_channel_and_the_records_import_no_view():
    loaded = imported_after("import nbaccel.observe.channel, nbaccel.observe.records")
    assert "nbaccel.observe.records" in loaded
    assert not any(m.startswith(("nbaccel.observe.live", "torch", "matplotlib")) for m in loaded)


def test_the_panel_draws_a_run_it_is_given():
    loaded = imported_after(
        "from nbaccel.observe.channel import Record\nfrom nbaccel.observe.records import Run\n"
        "from nbaccel.observe.live import panel\n"
        "run = Run(); run.add([Record(0, 0, 0.0, 'loss', 1.0)]); panel.figure(run)"
    )
    assert {"nbaccel.observe.live.panel", "matplotlib"} <= loaded


def test_the_live_view_imports_no_torch():
    """Every module of ``observe/live`` imported, and a panel drawn: torch never loads, so the
    launching process draws without paying for it."""
    loaded = imported_after(
        "import pkgutil, importlib, nbaccel.observe.live as live\n"
        "for m in pkgutil.iter_modules(live.__path__):\n"
        "    importlib.import_module(f'{live.__name__}.{m.name}')\n"
        "from nbaccel.observe.channel import Record\nfrom nbaccel.observe.records import Run\n"
        "from nbaccel.observe.live import panel\n"
        "run = Run(); run.add([Record(0, 0, 0.0, 'loss', 1.0)]); panel.figure(run)"
    )
    assert {"nbaccel.observe.live.view", "nbaccel.observe.live.line", "matplotlib"} <= loaded
    assert not any(m.startswith("torch") for m in loaded)


def test_a_worker_that_sends_its_numbers_never_imports_the_view():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        env = {**os.environ, "NBACCEL_METRICS_FD": str(theirs.fileno()), "RANK": "0"}
        code = (
            "from nbaccel.observe.rank_recorder import Recorder\n"
            "t = Recorder(total_steps=3)\n"
            "for i in range(3): t.log({'loss': 1.0 / (i + 1)}, samples=4)\n"
            "t.close()"
        )
        seen = "any(m.startswith('nbaccel.observe.live') for m in sys.modules)"
        probe = f"{code}\nimport sys\nprint({seen})"
        done = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            pass_fds=(theirs.fileno(),),
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == "False"
        assert ours.recv(1 << 16)  # and its numbers did go out
    finally:
        ours.close()
        theirs.close()


def test_a_recorder_with_nobody_listening_draws_on_the_main_process():
    code = (
        "from nbaccel.observe.rank_recorder import Recorder\n"
        "t = Recorder(total_steps=2, clock=iter(range(100)).__next__)\n"
        "t.log({'loss': 1.0}); t.log({'loss': 0.5}); t.close()"
    )
    env = {k: v for k, v in os.environ.items() if k != "NBACCEL_METRICS_FD"}
    assert "nbaccel.observe.live.view" in imported_after(code, env)


def test_the_projection_model_imports_neither_torch_nor_its_figure():
    loaded = imported_after(
        "from nbaccel import projection\n"
        "projection.project(0.01, 4e6, 32, projection.PRESETS['PCIe 4.0 x16'], 8)"
    )
    assert "nbaccel.lab.projection.model" in loaded
    assert not loaded & {"nbaccel.lab.projection.view", "nbaccel.lab.projection.calibration"}
    assert not any(m.startswith(("torch", "matplotlib")) for m in loaded)
    drawn = imported_after("from nbaccel.lab.projection import figure")
    assert "nbaccel.lab.projection.view" in drawn and "nbaccel.observe.live.view" not in drawn


def test_the_collectives_are_one_module_that_utils_re_exports():
    import nbaccel.accelerator.collectives as collectives
    import nbaccel.utils as utils

    for name in collectives.__all__:
        if name != "world_size":
            assert getattr(utils, name) is getattr(collectives, name), name
    loaded = imported_after("import nbaccel.utils")
    assert not loaded & {
        "nbaccel.accelerator.accelerator",
        "nbaccel.accelerator.optim",
        "nbaccel.accelerator.strategies.ds_config",
    }


def test_the_notebook_tooling_is_outside_the_package_and_has_no_cycle():
    assert not (ROOT / "nbaccel" / "lessons" / "runner.py").exists()
    loaded = imported_after("import lessonbuild.edition")
    assert "lessonbuild.runner" not in loaded  # the edition needs the notebooks, not the runner
    assert not any(m.startswith("nbaccel") for m in loaded)
    setuptools = pytest.importorskip("setuptools")
    packages = setuptools.find_packages(str(ROOT), include=["nbaccel*"])
    assert "nbaccel.lab.projection" in packages and "lessonbuild" not in packages
    done = subprocess.run(
        [sys.executable, "-m", "lessonbuild.runner", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0 and "demo" in done.stdout, done.stderr


def test_the_public_paths_keep_working():
    """What users and the lessons import, in a fresh interpreter: every name in ``__all__``
    (``from nbaccel import *``), ``from nbaccel import projection``, ``nbaccel.utils`` with
    Accelerate's names, ``nbaccel.lessons``; and ``python -m nbaccel`` with every subcommand."""
    code = (
        "import nbaccel, nbaccel.lessons, nbaccel.utils\n"
        "from nbaccel import *\n"
        "assert all(globals()[name] is getattr(nbaccel, name) for name in nbaccel.__all__)\n"
        "from nbaccel import projection\n"
        "assert projection.__name__ == 'nbaccel.lab.projection' and projection.PRESETS\n"
        "assert all(hasattr(nbaccel.utils, name) for name in nbaccel.utils.__all__)\n"
        "assert nbaccel.lessons.MLP and set(nbaccel.__all__) <= set(dir(nbaccel))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "nbaccel", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for command in ("launch", "config", "env", "test", "scale", "build-ops"):
        assert command in done.stdout, command
