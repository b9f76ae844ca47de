"""The install story stays consistent: one set of pins, one conda environment, CI = make test."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONDA_NAMES = {"torch": "pytorch"}  # PyPI name -> conda-forge name, where they differ


def declared(group: str) -> list[str]:
    """Package names in pyproject's ``group = [...]`` line (dependencies or an extra)."""
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is not in Python 3.10
    entries = re.search(rf"^{group} = \[(.*)\]$", pyproject, re.M).group(1)
    return [re.split(r"[<>=\[ ]", e.strip().strip('"'))[0] for e in entries.split(",")]


def conda_packages(path: Path) -> tuple[set[str], list]:
    spec = yaml.safe_load(path.read_text())
    names = {re.split(r"[<>= ]", d)[0] for d in spec["dependencies"] if isinstance(d, str)}
    pip = [d["pip"] for d in spec["dependencies"] if isinstance(d, dict)]
    return names, pip


def test_binder_and_conda_name_every_runtime_dependency():
    needed = {CONDA_NAMES.get(n, n) for n in declared("dependencies") + declared("notebook")}
    needed |= {"nbval", "ipykernel", "python"}  # the lessons are tested with nbval
    binder, binder_pip = conda_packages(ROOT / "binder" / "environment.yml")
    root, root_pip = conda_packages(ROOT / "environment.yml")
    assert needed <= binder, f"binder/environment.yml lacks {needed - binder}"
    assert needed <= root, f"environment.yml lacks {needed - root}"
    assert binder == root, "the two environments should name the same packages"
    assert binder_pip == [] and root_pip == [["--no-deps -e ."]]
    assert "pip install --no-deps" in (ROOT / "binder" / "postBuild").read_text()


def test_the_package_declares_a_range_and_ci_pins_one_torch():
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is not in Python 3.10
    assert 'dependencies = ["torch>=2.4"' in pyproject
    for extra in ("notebook", "test", "dev", "bench"):
        assert f"\n{extra} = [" in pyproject
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in pins


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
