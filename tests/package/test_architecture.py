"""docs/architecture.md stays true, and the package keeps the shape it describes: the folders,
what each may import, no cycle, names that say what they hold."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "nbaccel"


def named_paths() -> set[str]:
    """Every repository path the page names in backticks (``nbaccel/...``, ``lessonbuild/``)."""
    return set(re.findall(r"`((?:nbaccel|lessonbuild)/[\w/<>.]*)`", DOC.read_text()))


def tree() -> str:
    """The page's drawing of the tree: the code block under "## The tree"."""
    section = DOC.read_text().split("## The tree", 1)[1]
    return section.split("```", 2)[1]


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


def test_the_page_names_every_folder_and_every_module_of_the_top_and_the_three_parts():
    named = named_paths()
    folders = [p for p in PACKAGE.rglob("*") if (p / "__init__.py").exists()]
    wanted = [f"{p.relative_to(ROOT).as_posix()}/" for p in folders]
    wanted += [
        p.relative_to(ROOT).as_posix()
        for p in [*PACKAGE.glob("*.py"), *PACKAGE.glob("*/*.py"), *PACKAGE.glob("*/*/*.py")]
        if p.name not in {"__init__.py", "__main__.py"}
        and p.parent.name not in {"commands", "lessons"}  # named by the tree, below
    ]
    unnamed = sorted(m for m in wanted if m not in named and m.rstrip("/") not in named)
    assert not unnamed, f"add these to docs/architecture.md: {unnamed}"


def test_the_tree_on_the_page_lists_every_folder_and_module():
    drawn = tree()
    words = set(re.findall(r"[\w.]+", drawn))
    missing = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent != PACKAGE:
            if f"{path.parent.name}/" not in drawn:
                missing.append(f"{path.parent.relative_to(ROOT)}/")
        elif path.name not in words and path.stem not in words:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"the tree in docs/architecture.md lacks: {sorted(missing)}"


def test_the_glossary_fixes_the_words():
    glossary = DOC.read_text().split("## Words, one meaning each", 1)[1].split("\n## ", 1)[0]
    for word in ("tracker", "recorder", "records", "view", "config"):
        assert f"- **{word}**:" in glossary, word


def test_structure_targets_hold():
    module = structure()
    result = module.measure()
    assert len(module.TARGETS) == 9  # every rule on the page is one of them
    for key in module.TARGETS:
        assert not result[key], (key, result[key])
    assert len(result["top_level_files"]) <= 10


def test_the_structure_check_finds_a_cycle_and_a_back_end_branch(tmp_path):
    """The measurement can fail: a made-up package with a cycle, and an Accelerator with an
    ``if`` on DeepSpeed, are both caught."""
    module = structure()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert module.cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "accelerator.py"
    source.write_text("def f(self):\n    if self.deepspeed_plugin is not None:\n        pass\n")
    assert len(module.back_end_branches(source)) == 1


def test_the_folder_table_refuses_what_it_does_not_allow():
    module = structure()
    graph = {
        "nbaccel.observe.records": {"nbaccel.launch.launcher", "nbaccel.env"},  # up: refused
        "nbaccel.accelerator.state": {"nbaccel.observe.stacks", "nbaccel.config"},  # down: fine
        "nbaccel.launch.supervisor": {"nbaccel.accelerator.state"},  # only the fork server may
        "nbaccel.launch.forkserver": {"nbaccel.accelerator.accelerator"},  # the exception
        "nbaccel.lab.scaling": {"nbaccel.commands.scale"},  # nothing imports the commands
        "nbaccel.lessons.tools": {"nbaccel", "nbaccel.observe.records"},  # public names only
        "nbaccel.env": {"nbaccel.utils"},  # the base imports nothing else
    }
    found = module.forbidden(graph)
    assert [line.split(" (")[1] for line in found] == [
        "base may not import utils)",
        "lab may not import commands)",
        "launch may not import accelerator)",
        "lessons may not import observe)",
        "observe may not import launch)",
    ]


def test_a_cycle_between_folders_is_found_even_without_a_cycle_between_modules():
    """``records`` imports ``live/panel`` and ``live/view`` imports ``records``: no module
    reaches itself, but the folder ``observe`` has ``records`` and ``live`` in a circle."""
    module = structure()
    graph = {
        "nbaccel.observe.records": {"nbaccel.observe.live.panel"},
        "nbaccel.observe.live.panel": set(),
        "nbaccel.observe.live.view": {"nbaccel.observe.records"},
    }
    assert module.cycles(graph) == []
    packages = {"nbaccel", "nbaccel.observe", "nbaccel.observe.live"}
    assert module.folder_cycles(graph, packages) == ["nbaccel.observe: live <-> records"]


def test_names_that_differ_only_by_a_suffix_are_found():
    module = structure()
    clashes = module.name_clashes(
        {"nbaccel": ["__init__", "tracker", "tracking", "tracking_setup", "env", "scaling"]}
    )
    assert clashes == [
        "nbaccel: tracker / tracking",
        "nbaccel: tracker / tracking_setup",
        "nbaccel: tracking / tracking_setup",
    ]
    assert module.name_clashes({"nbaccel/observe": ["records", "recorder"]})  # -s and -er too
    assert not module.name_clashes({"nbaccel/observe": ["records", "rank_recorder", "channel"]})


def test_a_base_class_that_uses_what_it_does_not_declare_is_found(tmp_path):
    """The Accelerator's checkpoint methods once lived in a base class that read
    ``self.rank`` and ``self.scaler`` without declaring them; such a class is caught."""
    module = structure()
    source = tmp_path / "parts.py"
    source.write_text(
        "class Saving:\n"
        "    registered: list\n"
        "    def save(self):\n"
        "        self.count = 1\n"
        "        return self.registered, self.count, self.rank, self.save\n"
        "class Accelerator(Saving):\n"
        "    rank = 0\n"
    )
    assert module.undeclared_members({"parts": source}) == ["Saving.rank"]
