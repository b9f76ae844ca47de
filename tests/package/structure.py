"""The architecture's rules, measured: the package's folders and what each may import, module
sizes, import cycles, names, formatting opt-outs and the Accelerator's back-end branches.

Rules, not benchmarks: counts, so one run is the answer (no rounds, no medians), and
``tests/package/test_architecture.py`` holds every target, so ``make check`` fails when one is
missed. What each rule is and why is in docs/architecture.md, "Rules that
``tests/package/structure.py --check`` measures". The measurements:

* lines per module: none over 400, ``accelerator/accelerator.py`` included, unless the first
  paragraph of the module's docstring says why in a sentence starting "Over 400 lines
  because"; a module that says so under 400 lines is flagged too, so the claim stays true;
* nbaccel's import graph, every ``import`` counted: at the top level, inside functions (a lazy
  import still runs) and under ``if TYPE_CHECKING:`` (a tie for the type checker is still a
  tie: the two modules cannot be read, tested or moved apart), and its cycles: groups of
  modules that reach each other;
* the same graph between folders: in every folder, its modules and subfolders (a subfolder
  counted as one) must not reach each other in a circle either;
* the folder table (``PARTS``, from DESIGN.md): each edge between the parts of the package
  (base, observe/, accelerator/, launch/, lab/, utils, lessons/, commands/) must be one the
  table allows; ``EXCEPTIONS`` names the one module allowed more, and why;
* names: no two modules of one folder whose names differ only by a suffix (``tracker`` /
  ``tracking`` / ``tracking_setup``), and at most ``MAX_TOP_LEVEL`` ``.py`` files at the top;
* base classes that use a member they do not declare (``self.x`` read but never set, defined
  or annotated in the class or its own bases): the target is none;
* the ``if``s in ``accelerator.py`` whose condition names a back end (DeepSpeed, FSDP, DDP, an
  engine, sharding): a back end belongs in its strategy module, so the target is none;
* ``# fmt: skip`` and ``# fmt: off`` comments in the package: the formatter's layout is the
  package's, so the target is none;
* which modules the library imports from the notebook build tooling (the target: none).

    python -m tests.package.structure [--json FILE] [--check]

``--check`` exits 1 when a target is missed, so the numbers cannot drift unnoticed.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nbaccel"
PAGE = ROOT / "docs" / "architecture.md"  # the process-wide state table
MAX_LINES = 400
# How a module over MAX_LINES says why, in the first paragraph of its docstring.
SIZE_REASON = re.compile(rf"(?:^|[.!?:;]\s+)Over {MAX_LINES} lines because\b")
FORMAT_OPT_OUT = re.compile(r"#\s*fmt:\s*(?:skip|off)\b")
MAX_TOP_LEVEL = 10  # .py files directly in nbaccel/, __init__.py and __main__.py included
BACK_END = re.compile(r"deepspeed|fsdp|engine|shard|DistributedDataParallel|zero", re.IGNORECASE)

# The parts of the package and what each may import besides itself (DESIGN.md's table). A
# module's part is its folder under nbaccel/; the base modules, utils and the entry points are
# parts of their own; "public" is nbaccel/__init__.py, the lazy public names.
BASE = ("env", "config", "errors", "tensors")
PARTS: dict[str, set[str]] = {
    "base": set(),
    "observe": {"base"},
    "accelerator": {"base", "observe"},
    "launch": {"base", "observe"},
    "lab": {"base", "observe", "accelerator", "launch"},
    "utils": {"base", "observe", "accelerator", "launch"},
    "lessons": {"public", "base", "lab"},
    "commands": {"public", "base", "observe", "accelerator", "launch", "lab", "utils", "lessons"},
    "public": {"base", "observe", "accelerator", "launch", "lab", "utils"},
}
# The measurements whose target is "none": --check fails when any of them holds something.
TARGETS = (
    "over_limit",
    "size_reasons_untrue",
    "cycles",
    "folder_cycles",
    "forbidden_imports",
    "name_clashes",
    "too_many_top_level_files",
    "undeclared_members",
    "accelerator_back_end_ifs",
    "format_opt_outs",
    "process_state_unlisted",
    "notebook_tooling_in_package",
)
EXCEPTIONS = {  # (module, part it may import beyond its own part's row): why
    ("nbaccel.launch.forkserver", "accelerator"): "imports the Accelerator once, before it forks, "
    "so that every worker starts warm",
}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The nbaccel modules this module imports anywhere in its body, ``if TYPE_CHECKING:``
    blocks included (not its parent packages, which Python imports first whatever the module
    says)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import checkpoint` imports a module; `from .env import X` a name in one
            targets = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
            targets = targets or [module]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def part(module: str) -> str:
    """The part of the package ``module`` belongs to (a key of ``PARTS``)."""
    names = module.split(".")
    if len(names) == 1:
        return "public"
    top = names[1]
    if top in BASE:
        return "base"
    return "commands" if top in ("cli", "commands", "__main__", "magics") else top


def forbidden(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b (part -> part)`` for each import the folder table does not allow."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = part(module)
        for target in sorted(targets):
            theirs = part(target)
            if theirs == mine or theirs in PARTS[mine] or (module, theirs) in EXCEPTIONS:
                continue
            found.append(f"{module} -> {target} ({mine} may not import {theirs})")
    return found


def folder_cycles(graph: dict[str, set[str]], packages: set[str] | None = None) -> list[str]:
    """Cycles between the children of each folder (its modules, and each subfolder counted as
    one), one line per cycle: ``nbaccel.observe: live <-> records``."""
    if packages is None:
        packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    found = []
    for folder in sorted(packages):

        def child(module: str, folder: str = folder) -> str | None:
            if not module.startswith(folder + ".") or module == folder:
                return None
            return module[len(folder) + 1 :].split(".")[0]

        edges: dict[str, set[str]] = {}
        for module, targets in graph.items():
            a = child(module)
            if a is None:
                continue
            edges.setdefault(a, set())
            for target in targets:
                b = child(target)
                if b is not None and b != a:
                    edges[a].add(b)
                    edges.setdefault(b, set())
        found += [f"{folder}: {' <-> '.join(group)}" for group in cycles(edges)]
    return found


def _stem(name: str) -> str:
    """``tracking_setup`` -> ``track``, ``tracker`` -> ``track``: a name's first word, without
    the endings that make another word of the same thing."""
    word = name.split("_")[0]
    for ending in ("ings", "ing", "ers", "er", "s"):
        if word.endswith(ending) and len(word) - len(ending) >= 3:
            return word[: -len(ending)]
    return word


def name_clashes(names_by_folder: dict[str, list[str]]) -> list[str]:
    """Pairs of modules or subfolders of one folder whose names differ only by a suffix."""
    found = []
    for folder, names in sorted(names_by_folder.items()):
        names = sorted(n for n in names if not n.startswith("__"))
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if b.startswith(a + "_") or _stem(a) == _stem(b):
                    found.append(f"{folder}: {a} / {b}")
    return found


def siblings() -> dict[str, list[str]]:
    """Each folder of the package -> the names of its modules and subfolders."""
    found: dict[str, list[str]] = {}
    for folder in [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if (p / "__init__.py").exists())]:
        names = [p.stem for p in folder.glob("*.py")]
        names += [p.name for p in folder.iterdir() if (p / "__init__.py").exists()]
        found[folder.relative_to(ROOT).as_posix()] = sorted(names)
    return found


def undeclared_members(sources: dict[str, Path]) -> list[str]:
    """``module.Class.member`` for each member a base class of the package reads from ``self``
    without declaring it (set, defined or annotated in it or in its own bases)."""
    classes: dict[str, tuple[ast.ClassDef, list[str]]] = {}
    for path in sources.values():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                classes[node.name] = (node, bases)
    used_as_base = {b for _, bases in classes.values() for b in bases if b in classes}

    def declared(name: str) -> set[str]:
        node, bases = classes[name]
        names: set[str] = set()
        for stmt in node.body:  # the class body's own names: methods, class attributes
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(stmt.name)
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        names |= {  # and what its methods set on self
            inner.attr
            for inner in ast.walk(node)
            if isinstance(inner, ast.Attribute)
            and isinstance(inner.ctx, ast.Store)
            and ast.unparse(inner.value) == "self"
        }
        for base in bases:
            names |= declared(base) if base in classes else set()
        return names

    found = []
    for name in sorted(used_as_base):
        node, bases = classes[name]
        if any(b not in classes and b not in ("object", "Protocol") for b in bases):
            continue  # a subclass of someone else's class (torch's): its members are theirs
        reads = {
            n.attr
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
            and not n.attr.startswith("__")
        }
        found += [f"{name}.{member}" for member in sorted(reads - declared(name))]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def back_end_branches(path: Path) -> list[str]:
    """``file:line  condition`` for each if / conditional expression naming a back end."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If | ast.IfExp):
            test = ast.get_source_segment(source, node.test) or ""
            if BACK_END.search(test):
                found.append(f"{path.name}:{node.lineno}  {test}")
    return found


def gives_size_reason(path: Path) -> bool:
    """Whether the first paragraph of the module's docstring has a sentence starting "Over 400
    lines because"."""
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    return bool(SIZE_REASON.search(paragraph))


def size_rule(lines: dict[str, int], sources: dict[str, Path]) -> tuple[dict, dict]:
    """(modules over ``MAX_LINES`` that do not say why, modules that say why but are not over):
    name -> lines, each."""
    over, untrue = {}, {}
    for name, n in lines.items():
        reason = gives_size_reason(sources[name])
        if n > MAX_LINES and not reason:
            over[name] = n
        elif n <= MAX_LINES and reason:
            untrue[name] = n
    return over, untrue


def format_opt_outs(sources: dict[str, Path]) -> list[str]:
    """``path:line  comment`` for each ``# fmt: skip`` or ``# fmt: off`` comment (comments
    only: a docstring that names them is not one)."""
    found = []
    for path in sorted(sources.values()):
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        with path.open("rb") as source:
            for token in tokenize.tokenize(source.readline):
                if token.type == tokenize.COMMENT and FORMAT_OPT_OUT.search(token.string):
                    found.append(f"{where}:{token.start[0]}  {token.string}")
    return found


STATE_CALLS = {  # what a call that makes process-wide state is called (without arguments)
    *("ContextVar", "Lock", "RLock", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary"),
    *("count", "deque", "set", "list", "dict"),
}


def process_state(sources: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's process-wide state: a name some function rebinds (``global``), or one
    bound at the top level to an empty container, a lock, a weak collection, a counter or a
    context variable (a filled literal is a table of constants, not state)."""
    found: dict[str, set[str]] = {}
    for name, path in sources.items():
        tree = ast.parse(path.read_text(), str(path))
        names = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            empty = isinstance(value, (ast.List, ast.Dict, ast.Set)) and not (
                getattr(value, "elts", None) or getattr(value, "keys", None)
            )
            call = (
                isinstance(value, ast.Call)
                and (getattr(value.func, "attr", None) or getattr(value.func, "id", None))
                in STATE_CALLS
                and not value.args
            )
            if empty or call:
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if names:
            found[name] = names
    return found


def process_state_unlisted(
    sources: dict[str, Path], page: Path = PAGE, root: Path = PACKAGE
) -> list[str]:
    """``module.name`` for each piece of process-wide state that the page's table does not
    list (a row naming the module's path under nbaccel/ and the name, both in backticks)."""
    text = page.read_text()
    table = text[text.index("## Process-wide state") :]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    missing = []
    for module, names in sorted(process_state(sources).items()):
        rel = str(sources[module].relative_to(root))
        for state in sorted(names):
            if not any(f"`{rel}`" in row and f"`{state}`" in row for row in rows):
                missing.append(f"{module}.{state}")
    return missing


def measure() -> dict:
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in mods.items()}
    over_limit, size_reasons_untrue = size_rule(lines, mods)
    top_level = sorted(p.name for p in PACKAGE.glob("*.py"))
    tooling = {
        m
        for m in mods
        if m.startswith("nbaccel.lessons.") and m.rsplit(".", 1)[1] in {"edition", "runner"}
    }
    return {
        "lines": dict(sorted(lines.items(), key=lambda kv: -kv[1])),
        "over_limit": over_limit,
        "size_reasons_untrue": size_reasons_untrue,
        "cycles": cycles(graph),
        "folder_cycles": folder_cycles(graph),
        "forbidden_imports": forbidden(graph),
        "name_clashes": name_clashes(siblings()),
        "top_level_files": top_level,
        "too_many_top_level_files": len(top_level) > MAX_TOP_LEVEL,
        "undeclared_members": undeclared_members(mods),
        "accelerator_back_end_ifs": back_end_branches(PACKAGE / "accelerator" / "accelerator.py"),
        "format_opt_outs": format_opt_outs(mods),
        "process_state_unlisted": process_state_unlisted(mods),
        "notebook_tooling_in_package": sorted(tooling),
        "imports": {m: sorted(t) for m, t in sorted(graph.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the measurements to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    opts = parser.parse_args(argv)
    result = measure()
    print(f"{len(result['lines'])} modules, {sum(result['lines'].values())} lines; largest:")
    for name, n in list(result["lines"].items())[:8]:
        print(f"  {n:5d}  {name}")
    print(f"over {MAX_LINES} lines, without saying why: {result['over_limit'] or 'none'}")
    untrue = result["size_reasons_untrue"] or "none"
    print(f"saying why they are over {MAX_LINES} lines, but not over: {untrue}")
    print(f"import cycles: {result['cycles'] or 'none'}")
    print(f"cycles between a folder's modules and subfolders: {result['folder_cycles'] or 'none'}")
    print(f"imports the folder table forbids: {len(result['forbidden_imports'])}")
    for line in result["forbidden_imports"]:
        print(f"  {line}")
    print(f"names that differ only by a suffix: {result['name_clashes'] or 'none'}")
    top = result["top_level_files"]
    print(f".py files at nbaccel/'s top level: {len(top)} (at most {MAX_TOP_LEVEL}): {top}")
    print(f"members a base class uses without declaring: {result['undeclared_members'] or 'none'}")
    ifs = result["accelerator_back_end_ifs"]
    print(f"back-end ifs in accelerator.py: {len(ifs)}")
    for line in ifs:
        print(f"  {line}")
    print(f"# fmt: skip / off comments: {len(result['format_opt_outs'])}")
    for line in result["format_opt_outs"]:
        print(f"  {line}")
    unlisted = result["process_state_unlisted"] or "none"
    print(f"process-wide state the architecture page does not list: {unlisted}")
    print(f"notebook tooling inside the package: {result['notebook_tooling_in_package'] or 'none'}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1) + "\n")
    missed = any(result[key] for key in TARGETS)
    return 1 if opts.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
