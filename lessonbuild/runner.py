"""Run the lesson notebooks headless in a real kernel: ``make lessons`` and ``make demo``.

    python -m lessonbuild.runner lessons [NOTEBOOK ...]   # re-execute in place
    python -m lessonbuild.runner demo [--out DIR]         # the flagship lesson, to DIR

Run from the repository root: this is the repository's tooling, not part of the installed
library. A notebook runs in its own folder, as Jupyter would run it, and is written back only
when every cell succeeded (through a temporary file, so a failed run leaves the old one whole).
``lessons`` then rebuilds the Arabic edition (``notebooks/ar/``) from the English lessons just
run and their translations: the same code cells with the same outputs (``edition``).

``lessons`` runs every lesson before it writes any, and writes them only when other programs
left the machine alone meanwhile (``load``: at most ``LIMIT_CORES`` of a core on average, read
from ``/proc/stat`` against this run's own processes) and every lesson's first output names the
machine this run is on. It then records that machine, the load and each lesson's times (its
core's cells, before "Going further", and its Run All, which stops at the first exercise)
in ``notebooks/README.md``, between ``<!-- make lessons -->`` markers.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
import time
from pathlib import Path

from . import edition, exercises
from .drift import texts
from .load import LIMIT_CORES, LoadMeter
from .notebooks import NOTEBOOKS, WIDGET, clean, lessons

__all__ = ["FLAGSHIP", "NOTEBOOKS", "PANEL_TAG", "WIDGET", "execute", "final_panel", "lessons"]

FLAGSHIP = "04_accelerate.ipynb"
PANEL_TAG = "demo-panel"  # the cell whose last image is the run's final loss/throughput panel


def execute(
    source: Path,
    dest: Path | None = None,
    timeout: int = 600,
    kernel_name: str = "python3",
    write: bool = True,
    core: dict[str, float] | None = None,
):
    """Run the cells of ``source`` up to its first exercise in a fresh kernel (default:
    python3, this interpreter), as Run All does; the exercises stay unexecuted. Write the
    result to ``dest`` (default: in place) unless ``write`` is false; put the seconds its core
    took in ``core`` under the notebook's name. Raises nbclient's CellExecutionError naming
    the failing cell."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(source, as_version=4)
    stop = exercises.first_exercise(notebook)
    stop = len(notebook.cells) if stop is None else stop
    rest = notebook.cells[stop:]
    for cell in rest:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    notebook.cells = notebook.cells[:stop]
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(source.parent)}},
    )
    client.execute()
    notebook.cells += rest
    if core is not None:
        core[source.name] = core_seconds(notebook)
    clean(notebook)
    if write:
        save(notebook, dest or source)
    return notebook


def core_seconds(notebook) -> float | None:
    """The seconds the cells before "Going further" took, from nbclient's timestamps of each
    cell's execution (read before ``clean`` drops them); None without that heading."""
    from datetime import datetime

    end = exercises.going_further(notebook)
    if end is None:
        return None
    total = 0.0
    for cell in notebook.cells[:end]:
        stamps = cell.metadata.get("execution", {})
        if "iopub.execute_input" in stamps and "shell.execute_reply" in stamps:
            started = datetime.fromisoformat(stamps["iopub.execute_input"].replace("Z", "+00:00"))
            ended = datetime.fromisoformat(stamps["shell.execute_reply"].replace("Z", "+00:00"))
            total += (ended - started).total_seconds()
    return total


def save(notebook, dest: Path) -> None:
    """Write ``notebook`` to ``dest`` through a temporary file: never half a notebook."""
    import nbformat

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial")
    nbformat.write(notebook, partial)
    os.replace(partial, dest)


MACHINE = re.compile(r"^(?:CPU|GPU): .*\(torch [^)]+\)$", re.M)
BEGIN, END = "<!-- make lessons -->", "<!-- /make lessons -->"


def first_machine(notebook) -> str | None:
    """The machine line of the notebook's first text output (its ``SIZE`` cell prints it)."""
    for cell in notebook.cells:
        for text in texts(cell):
            found = MACHINE.search(text)
            return found.group(0) if found else None
    return None


def record(
    readme: Path, machine: str, load, times: dict[str, float], day: str, core: dict | None = None
) -> None:
    """Put this run's machine, load, and each lesson's core and Run All times in ``readme``'s
    generated block (rows of lessons not run this time are kept)."""
    core = core or {}
    text = readme.read_text()
    old = re.search(re.escape(BEGIN) + r"(.*?)" + re.escape(END), text, re.S)
    rows = {}
    for name, *cells in re.findall(
        r"^\| `(\S+)` \|(?: (\S+) \|)? (\d+) \|$", old[1] if old else "", re.M
    ):
        rows[name] = (cells[0] or "-", cells[1])
    for name, seconds in times.items():
        rows[name] = ("-" if core.get(name) is None else f"{core[name]:.0f}", f"{seconds:.0f}")
    table = "\n".join(f"| `{name}` | {rows[name][0]} | {rows[name][1]} |" for name in sorted(rows))
    together = "every lesson" if set(times) >= set(rows) else ", ".join(sorted(times))
    block = (
        f"{BEGIN}\nExecuted by `make lessons` on {day}, {together} in one run, on\n\n"
        f"    {machine}\n\nand {load.verdict()}.\n\n"
        "| lesson | core, seconds | Run All, seconds |\n|---|---:|---:|\n"
        f"{table}\n{END}"
    )
    text = text.replace(old.group(0), block) if old else f"{text.rstrip()}\n\n{block}\n"
    partial = readme.with_name(f".{readme.name}.partial")
    partial.write_text(text)
    os.replace(partial, readme)


def run_lessons(
    paths: list[Path], check_load: bool = True, readme: Path | None = NOTEBOOKS / "README.md"
) -> int:
    """Execute ``paths``, then write them all (and their Arabic editions) or none; record the
    run in ``readme`` (not for a draft run, ``check_load=False``)."""
    from nbaccel.lessons import machine

    here = machine()
    ran, times, core = {}, {}, {}
    with LoadMeter() as meter:
        for path in paths:
            started = time.perf_counter()
            print(f"{path}: running ...", flush=True)
            ran[path] = execute(path, write=False, core=core)
            times[path.name] = time.perf_counter() - started
            seconds = core.get(path.name)
            its_core = "" if seconds is None else f" (its core: {seconds:.0f} s)"
            print(f"{path}: done in {times[path.name]:.0f} s{its_core}", flush=True)
    load = meter.load
    print(load.verdict(), flush=True)
    if check_load and load.others > LIMIT_CORES:
        print(
            f"not written: other programs kept {load.others:.2f} cores busy meanwhile (more "
            f"than {LIMIT_CORES:.2f}), so the lessons' measurements are not this machine's. "
            "Stop them (top shows which) and run `make lessons` again.",
            file=sys.stderr,
        )
        return 1
    for path, notebook in ran.items():
        shown = first_machine(notebook)
        if shown != here:
            print(
                f"not written: {path.name}'s first output names {shown!r}, not this run's "
                f"machine {here!r}; its SIZE cell must print machine()",
                file=sys.stderr,
            )
            return 1
    for path, notebook in ran.items():
        save(notebook, path)
    # the Arabic edition of each English lesson just run (an Arabic notebook named here
    # was run itself, and keeps its own outputs)
    for path in sorted(set(edition.translated()) & {p.resolve() for p in ran}):
        print(f"{path.name}: Arabic edition -> {edition.build(path)}", flush=True)
    if readme is not None and check_load:
        record(readme, here, load, times, time.strftime("%Y-%m-%d"), core)
    return 0


def final_panel(notebook) -> bytes:
    """The last PNG shown by the cell tagged ``demo-panel``."""
    for cell in notebook.cells:
        if PANEL_TAG in cell.metadata.get("tags", []):
            pngs = [
                o["data"]["image/png"]
                for o in cell.get("outputs", [])
                if "image/png" in o.get("data", {})
            ]
            if pngs:
                return base64.b64decode(pngs[-1])
    raise LookupError(f"no cell tagged {PANEL_TAG!r} showed an image")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lessonbuild.runner")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("lessons", help="re-execute lesson notebooks in place")
    run.add_argument("notebooks", nargs="*", type=Path)
    run.add_argument(
        "--no-load-check",
        action="store_true",
        help="write the outputs even if other programs loaded the machine (for drafts only)",
    )
    demo = sub.add_parser("demo", help="execute the flagship lesson into a results folder")
    demo.add_argument("--out", type=Path, default=Path("results/demo"))
    args = parser.parse_args(argv)
    if args.command == "lessons":
        paths = [p.resolve() for p in args.notebooks] or lessons()
        return run_lessons(paths, check_load=not args.no_load_check)
    started = time.perf_counter()
    dest = args.out / FLAGSHIP
    print(f"running {NOTEBOOKS / FLAGSHIP} on 2 CPU workers (about two minutes) ...", flush=True)
    notebook = execute(NOTEBOOKS / FLAGSHIP, dest)
    panel = args.out / "final_panel.png"
    panel.write_bytes(final_panel(notebook))
    print(f"done in {time.perf_counter() - started:.0f} s")
    print(f"  executed notebook: {dest}")
    print(f"  final loss/throughput panel: {panel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
