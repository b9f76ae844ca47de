"""Run the lesson notebooks headless in a real kernel: ``make lessons`` and ``make demo``.

    python -m lessonbuild.runner lessons [NOTEBOOK ...]   # re-execute in place
    python -m lessonbuild.runner demo [--out DIR]         # the flagship lesson, to DIR

Run from the repository root: this is the repository's tooling, not part of the installed
library. A notebook runs in its own folder, as Jupyter would run it, and is written back only
when every cell succeeded (through a temporary file, so a failed run leaves the old one whole).
``lessons`` then rebuilds the Arabic edition (``notebooks/ar/``) from the English lessons just
run and their translations: the same code cells with the same outputs (``edition``).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from pathlib import Path

from . import edition
from .notebooks import NOTEBOOKS, WIDGET, clean, lessons

__all__ = ["FLAGSHIP", "NOTEBOOKS", "PANEL_TAG", "WIDGET", "execute", "final_panel", "lessons"]

FLAGSHIP = "04_accelerate.ipynb"
PANEL_TAG = "demo-panel"  # the cell whose last image is the run's final loss/throughput panel


def execute(
    source: Path, dest: Path | None = None, timeout: int = 600, kernel_name: str = "python3"
):
    """Run every cell of ``source`` in a fresh kernel (default: python3, this interpreter);
    write the result to ``dest`` (default: in place). Raises nbclient's CellExecutionError
    naming the failing cell."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(source, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(source.parent)}},
    )
    client.execute()
    clean(notebook)
    dest = dest or source
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial")
    nbformat.write(notebook, partial)
    os.replace(partial, dest)
    return notebook


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
    demo = sub.add_parser("demo", help="execute the flagship lesson into a results folder")
    demo.add_argument("--out", type=Path, default=Path("results/demo"))
    args = parser.parse_args(argv)
    if args.command == "lessons":
        ran = args.notebooks or lessons()
        for path in ran:
            started = time.perf_counter()
            print(f"{path}: running ...", flush=True)
            execute(path)
            print(f"{path}: done in {time.perf_counter() - started:.0f} s", flush=True)
        # the Arabic edition of each English lesson just run (an Arabic notebook named here
        # was run itself, and keeps its own outputs)
        for path in sorted(set(edition.translated()) & {p.resolve() for p in ran}):
            print(f"{path.name}: Arabic edition -> {edition.build(path)}", flush=True)
        return 0
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
