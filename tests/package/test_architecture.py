"""docs/architecture.md stays true, and the package keeps the shape it describes: the folders,
what each may import, no cycle, names that say what they hold."""

from __future__ import annotations

import re
from pathlib import Path

from tests.package import structure as rules

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
    result = rules.measure()
    assert len(rules.TARGETS) == 12  # every rule on the page is one of them
    missed = {key: result[key] for key in rules.TARGETS if result[key]}
    assert not missed, f"missed (python -m tests.package.structure prints them): {missed}"
    assert len(result["top_level_files"]) <= 10


def test_the_structure_check_finds_a_cycle_and_a_back_end_branch(tmp_path):
    """The measurement can fail: a made-up package with a cycle, and an Accelerator with an
    ``if`` on DeepSpeed, are both caught."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert rules.cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "accelerator.py"
    source.write_text("def f(self):\n    if self.deepspeed_plugin is not None:\n        pass\n")
    assert len(rules.back_end_branches(source)) == 1


def test_the_folder_table_refuses_what_it_does_not_allow():
    graph = {
        "nbaccel.observe.records": {"nbaccel.launch.launcher", "nbaccel.env"},  # up: refused
        "nbaccel.accelerator.state": {"nbaccel.observe.stacks", "nbaccel.config"},  # down: fine
        "nbaccel.launch.supervisor": {"nbaccel.accelerator.state"},  # only the fork server may
        "nbaccel.launch.forkserver": {"nbaccel.accelerator.accelerator"},  # the exception
        "nbaccel.lab.scaling": {"nbaccel.commands.scale"},  # nothing imports the commands
        "nbaccel.lessons.tools": {"nbaccel", "nbaccel.observe.records"},  # public names only
        "nbaccel.env": {"nbaccel.utils"},  # the base imports nothing else
    }
    found = rules.forbidden(graph)
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
    graph = {
        "nbaccel.observe.records": {"nbaccel.observe.live.panel"},
        "nbaccel.observe.live.panel": set(),
        "nbaccel.observe.live.view": {"nbaccel.observe.records"},
    }
    assert rules.cycles(graph) == []
    packages = {"nbaccel", "nbaccel.observe", "nbaccel.observe.live"}
    assert rules.folder_cycles(graph, packages) == ["nbaccel.observe: live <-> records"]


def test_names_that_differ_only_by_a_suffix_are_found():
    clashes = rules.name_clashes(
        {"nbaccel": ["__init__", "tracker", "tracking", "tracking_setup", "env", "scaling"]}
    )
    assert clashes == [
        "nbaccel: tracker / tracking",
        "nbaccel: tracker / tracking_setup",
        "nbaccel: tracking / tracking_setup",
    ]
    assert rules.name_clashes({"nbaccel/observe": ["records", "recorder"]})  # -s and -er too
    assert not rules.name_clashes({"nbaccel/observe": ["records", "rank_recorder", "channel"]})


def test_a_base_class_that_uses_what_it_does_not_declare_is_found(tmp_path):
    """The Accelerator's checkpoint methods once lived in a base class that read
    ``self.rank`` and ``self.scaler`` without declaring them; such a class is caught."""
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
    assert rules.undeclared_members({"parts": source}) == ["Saving.rank"]


def test_an_import_under_type_checking_still_makes_a_cycle(tmp_path):
    """``a`` imports ``b`` to run, ``b`` imports ``a`` only for its annotations: the two
    cannot be read or moved apart, so they are a cycle."""
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import Thing\n"
    )
    known = {"pkg", "pkg.a", "pkg.b"}
    graph = {
        name: rules.imports(name, tmp_path / f"{name[4:]}.py", known) for name in known - {"pkg"}
    }
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert rules.cycles(graph) == [["pkg.a", "pkg.b"]]


def test_a_module_over_400_lines_must_say_why_and_only_then(tmp_path):
    """Over the cap without the sentence fails; with it, it passes; the sentence in a module
    under the cap fails too, and so does one outside the docstring's first paragraph."""
    body = "x = 1\n" * 400
    reason = "Over 400 lines because the table and its checks read as one."
    sources = {
        "silent": f'"""A module."""\n{body}',
        "says_why": f'"""A module. {reason}\n\nMore."""\n{body}',
        "says_why_late": f'"""A module.\n\n{reason}"""\n{body}',
        "says_why_small": f'"""A module.\n{reason}"""\nx = 1\n',
        "small": '"""A module."""\nx = 1\n',
    }
    paths = {}
    for name, text in sources.items():
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(text)
    lines = {name: len(text.splitlines()) for name, text in sources.items()}
    over, untrue = rules.size_rule(lines, paths)
    assert sorted(over) == ["says_why_late", "silent"]
    assert list(untrue) == ["says_why_small"]


def test_format_opt_outs_are_found_in_comments_not_in_strings(tmp_path):
    source = tmp_path / "layout.py"
    source.write_text(
        '"""Never ``# fmt: skip``."""\n'
        "TABLE = [1,  2]  # fmt: skip\n"
        "# fmt: off\n"
        "OTHER = [3,  4]\n"
        "# fmt: on\n"
    )
    assert rules.format_opt_outs({"layout": source}) == [
        "layout.py:2  # fmt: skip",
        "layout.py:3  # fmt: off",
    ]


def test_process_wide_state_must_be_listed_with_its_reason(tmp_path):
    (tmp_path / "pkg").mkdir()
    source = tmp_path / "pkg" / "cache.py"
    source.write_text(
        "import threading, weakref\n"
        "TABLE = {'a': 1}  # a filled table: constants, not state\n"
        "_seen = {}\n"
        "_lock = threading.Lock()\n"
        "_live = weakref.WeakSet()\n"
        "_flag = False\n"
        "def warm():\n"
        "    global _flag\n"
        "    _flag = True\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "## Process-wide state\n\n| where | what | why |\n|---|---|---|\n"
        "| `cache.py` `_seen`, `_lock` | ... | ... |\n"
        "`cache.py` `_live` outside the table does not count\n"
    )
    found = rules.process_state_unlisted({"pkg.cache": source}, page, tmp_path / "pkg")
    assert found == ["pkg.cache._flag", "pkg.cache._live"]
