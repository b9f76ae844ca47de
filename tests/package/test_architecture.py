"""docs/architecture.md stays true, and the package keeps the shape it describes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def named_paths() -> set[str]:
    """Every repository path the page names in backticks (``nbaccel/...``, ``lessonbuild/``)."""
    return set(re.findall(r"`((?:nbaccel|lessonbuild)/[\w/<>.]*)`", DOC.read_text()))


def structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "benchmarks/structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_the_page_names_exists():
    paths = {p for p in named_paths() if "<" not in p}  # not the template strategies/<name>.py
    assert len(paths) > 30, paths  # the page names the modules, not one or two
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_page_names_every_module_of_the_library():
    named = named_paths()
    modules = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "nbaccel").glob("*.py")
        if p.name not in {"__init__.py", "__main__.py"}
    ]
    packages = [
        f"{p.relative_to(ROOT).as_posix()}/"
        for p in (ROOT / "nbaccel").iterdir()
        if (p / "__init__.py").exists()
    ]
    unnamed = sorted(m for m in modules + packages if m not in named and m.rstrip("/") not in named)
    assert not unnamed, f"add these to docs/architecture.md: {unnamed}"


def test_structure_targets_hold():
    result = structure().measure()
    assert not result["over_limit"], result["over_limit"]
    assert not result["cycles"], result["cycles"]
    assert not result["accelerator_back_end_ifs"], result["accelerator_back_end_ifs"]
    assert not result["notebook_tooling_in_package"]


def test_the_structure_check_finds_a_cycle_and_a_back_end_branch(tmp_path):
    """The measurement can fail: a made-up package with a cycle, and an Accelerator with an
    ``if`` on DeepSpeed, are both caught."""
    module = structure()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert module.cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "accelerator.py"
    source.write_text("def f(self):\n    if self.deepspeed_plugin is not None:\n        pass\n")
    assert len(module.back_end_branches(source)) == 1
