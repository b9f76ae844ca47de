"""The README's path without ``make``, run as it stands: a fresh environment with only the
``notebook`` extra (so no DeepSpeed), registered as a Jupyter kernel, runs lesson 6 top to bottom.

The block runs in a copy of this checkout with ``HOME`` pointed at a temporary folder, so its
``~/.venvs/nbaccel`` and ``ipykernel install --user`` land there and nothing of the user's is
touched; pip keeps its usual cache, so the packages ``make`` fetched are not fetched again.
This test takes minutes: it installs torch, JupyterLab and the rest into a new environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lessonbuild import runner

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- tests/package/test_install.py runs this block as it stands, in a copy of the clone -->"
BARE_PATH = "/usr/bin:/bin"

pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]


def readme_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    after = readme.split(MARK, 1)[1]
    block = re.match(r"\s*```bash\n(.*?)\n```", after, re.S)
    assert block, "the README's tested block should follow its marker"
    return [line for line in block[1].splitlines() if line.strip()]


def copy_of_the_checkout(dest: Path) -> Path:
    """The files a clone has (tracked, plus new ones not ignored), as they are now."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def pip_cache() -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True
    )
    return {"PIP_CACHE_DIR": done.stdout.strip()} if done.returncode == 0 else {}


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory):
    """(clone, home, python): the environment the README's block made, and its kernel."""
    tmp = tmp_path_factory.mktemp("readme")
    clone = copy_of_the_checkout(tmp / "clone")
    home = tmp / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), **pip_cache()}
    env.pop("JUPYTER_DATA_DIR", None)
    for line in readme_block():
        done = subprocess.run(
            ["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True, timeout=1200
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    yield clone, home, home / ".venvs" / "nbaccel" / "bin" / "python"
    shutil.rmtree(tmp, ignore_errors=True)  # 1.5 GB: pytest would keep it for three runs


def test_the_readme_environment_has_nbaccel_without_deepspeed(readme_env):
    _, home, python = readme_env
    probe = "import importlib.util as u, nbaccel; print(nbaccel.__file__, u.find_spec('deepspeed'))"
    env = {**os.environ, "PATH": BARE_PATH}
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, cwd=home)
    assert done.returncode == 0, done.stderr
    where, deepspeed = done.stdout.split()
    assert "site-packages" in where and deepspeed == "None"  # installed, not the source tree
    kernel = home / ".local" / "share" / "jupyter" / "kernels" / "nbaccel" / "kernel.json"
    assert str(python) in kernel.read_text()  # `--user` registered that environment's Python
    done = subprocess.run([python, "-m", "nbaccel", "env"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "- DeepSpeed: " in done.stdout, done.stderr


def test_lesson_6_runs_in_that_kernel_without_deepspeed_and_says_what_it_skipped(
    readme_env, monkeypatch
):
    clone, home, _ = readme_env
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(home / ".local" / "share" / "jupyter"))
    monkeypatch.setenv("PATH", BARE_PATH)  # as a registered kernel has it: no venv bin
    lesson = clone / "notebooks" / "06_sharding.ipynb"
    ran = runner.execute(lesson, kernel_name="nbaccel")  # raises on the first failing cell
    printed = [
        o.get("text", "")
        for c in ran.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream"
    ]
    skips = [line for text in printed for line in text.splitlines() if line.startswith("Skipped:")]
    assert len(skips) == 1, skips  # the ZeRO runs (Run All stops before the exercises)
    assert all("pip install deepspeed" in line for line in skips)
    assert any("launch option: {'fsdp': True}" in text for text in printed)
    tables = [
        o["data"]["text/markdown"]
        for c in ran.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "text/markdown" in o.get("data", {})
    ]
    measured = [t for t in tables if t.startswith("| strategy | paper's formula")]
    assert measured and "| DDP |" in measured[0] and "| FSDP2 |" in measured[0]
    assert "ZeRO 1 |" not in measured[0]  # not run, so not reported
