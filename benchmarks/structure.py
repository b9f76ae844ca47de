"""How the package is built: module sizes, import cycles, and the Accelerator's back-end branches.

Counts, not timings, so one run is the answer (no rounds, no medians):

* lines per module (the target: none over 400, ``accelerator.py`` included);
* nbaccel's import graph, every ``import`` counted (top level and inside functions, since a lazy
  import still runs; not those under ``if TYPE_CHECKING:``, which never run), and its cycles:
  groups of modules that reach each other;
* the ``if``s in ``accelerator.py`` whose condition names a back end (DeepSpeed, FSDP, DDP, an
  engine, sharding): a back end belongs in its strategy module, so the target is none;
* which modules the library imports from the notebook build tooling (the target: none).

    python benchmarks/structure.py [--json FILE] [--check]

``--check`` exits 1 when a target is missed, so the numbers cannot drift unnoticed.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nbaccel"
MAX_LINES = 400
BACK_END = re.compile(r"deepspeed|fsdp|engine|shard|DistributedDataParallel|zero", re.IGNORECASE)


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
    """The nbaccel modules this module imports anywhere in its body (not its parent packages,
    which Python imports first whatever the module says)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {  # `if TYPE_CHECKING:` blocks never run
        id(inner)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for inner in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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


def measure() -> dict:
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in mods.items()}
    tooling = {
        m
        for m in mods
        if m.startswith("nbaccel.lessons.") and m.rsplit(".", 1)[1] in {"edition", "runner"}
    }
    return {
        "lines": dict(sorted(lines.items(), key=lambda kv: -kv[1])),
        "over_limit": {m: n for m, n in lines.items() if n > MAX_LINES},
        "cycles": cycles(graph),
        "accelerator_back_end_ifs": back_end_branches(PACKAGE / "accelerator" / "accelerator.py"),
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
    print(f"over {MAX_LINES} lines: {result['over_limit'] or 'none'}")
    print(f"import cycles: {result['cycles'] or 'none'}")
    ifs = result["accelerator_back_end_ifs"]
    print(f"back-end ifs in accelerator.py: {len(ifs)}")
    for line in ifs:
        print(f"  {line}")
    print(f"notebook tooling inside the package: {result['notebook_tooling_in_package'] or 'none'}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1) + "\n")
    missed = (
        result["over_limit"] or result["cycles"] or ifs or result["notebook_tooling_in_package"]
    )
    return 1 if opts.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
