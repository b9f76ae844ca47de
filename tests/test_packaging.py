"""The install story stays consistent: one set of pins, one conda environment, CI = make test."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def body(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("name:")) :]


def test_binder_and_conda_install_the_same_environment():
    assert body(ROOT / "binder" / "environment.yml") == body(ROOT / "environment.yml")


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
