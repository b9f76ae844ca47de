"""A lesson's shape as a learner meets it: its core, then "Going further", then the exercises.

    python -m lessonbuild.exercises [NOTEBOOK ...]   # each lesson's core words and exercises

Every lesson opens with its core (at most ``CORE_WORDS`` words of prose, in either edition),
which ends where a Markdown cell opens with ``GOING_FURTHER``; everything after it (derivations,
benchmarks, history) is there for who wants it. The exercises come last, each in the convention
nbgrader's users know:

- the prompt (Markdown, ``### Exercise N: ...``) says what to define;
- the learner's cell (tag ``exercise``) ships as comments and ``raise NotImplementedError()``,
  so Run All runs the whole lesson and stops at the first exercise;
- its check (``# Check: exercise N ...``) fails, with a message that says what to fix, until
  the names it needs are defined and right;
- the solution is never a code cell: a collapsed Markdown block (tag ``solution``,
  ``<details>``) holds it as one ```` ```python ```` fence, the learner's cell as it should be.

``make lessons`` executes a lesson up to its first exercise cell and ships the exercises
without outputs; ``tests/lessons/test_exercises.py`` runs each check as shipped, with the
solution and with the wrong answers written down beside it (``tests/lessons/mutants``).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

GOING_FURTHER = "## Going further"
CORE_WORDS = 1200
EXERCISE, SOLUTION = "exercise", "solution"  # the tags
SHIPPED = "raise NotImplementedError()"
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.M | re.S)
ANY_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
TAG = re.compile(r"<[^<>\n]+>")


def tagged(cell, tag: str) -> bool:
    return tag in cell.metadata.get("tags", [])


def is_check(cell) -> bool:
    return cell.cell_type == "code" and cell.source.startswith("# Check:")


def going_further(notebook) -> int | None:
    """The index of the cell that ends the core, or None."""
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "markdown" and cell.source.startswith(GOING_FURTHER):
            return i
    return None


def words(markdown: str) -> int:
    """Words of prose: code fences and HTML tags left out, inline code counted as words."""
    return len(TAG.sub(" ", ANY_FENCE.sub(" ", markdown)).split())


def core_words(notebook, end: int | None = None) -> int:
    """Words of Markdown prose before the "Going further" cell (``end``: its index, for an
    edition whose heading is translated; the editions' cells correspond one to one)."""
    end = going_further(notebook) if end is None else end
    if end is None:
        raise ValueError(f"no Markdown cell opens with {GOING_FURTHER!r}")
    return sum(words(c.source) for c in notebook.cells[:end] if c.cell_type == "markdown")


def first_exercise(notebook) -> int | None:
    return next((i for i, c in enumerate(notebook.cells) if tagged(c, EXERCISE)), None)


@dataclass
class Exercise:
    learner: int  # the learner's cell
    check: int  # its check: the first check after it
    solution: int | None  # the Markdown cell that holds its solution, if any
    first_line: str  # the check's first line: how the mutants name it

    def solution_source(self, notebook) -> str | None:
        if self.solution is None:
            return None
        found = FENCE.findall(notebook.cells[self.solution].source)
        return found[0] if len(found) == 1 else None


def exercises(notebook) -> list[Exercise]:
    """Each learner's cell with its check and its solution (before the next learner's cell)."""
    cells = notebook.cells
    learners = [i for i, c in enumerate(cells) if tagged(c, EXERCISE)]
    found = []
    for n, i in enumerate(learners):
        end = learners[n + 1] if n + 1 < len(learners) else len(cells)
        check = next((j for j in range(i + 1, end) if is_check(cells[j])), None)
        if check is None:
            raise ValueError(f"the exercise in cell {i} has no '# Check:' cell after it")
        solution = next(
            (
                j
                for j in range(i + 1, end)
                if cells[j].cell_type == "markdown" and tagged(cells[j], SOLUTION)
            ),
            None,
        )
        found.append(Exercise(i, check, solution, cells[check].source.splitlines()[0]))
    return found


def main(argv: list[str] | None = None) -> int:
    import nbformat

    from .notebooks import NOTEBOOKS, lessons

    parser = argparse.ArgumentParser(prog="python -m lessonbuild.exercises")
    parser.add_argument("notebooks", nargs="*", type=Path)
    paths = parser.parse_args(argv).notebooks or lessons() + lessons(NOTEBOOKS / "ar")
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        english = nbformat.read(NOTEBOOKS / path.name, as_version=4)
        end = going_further(english)
        core = "no 'Going further' cell" if end is None else f"{core_words(notebook, end)} words"
        shapes = [
            f"cell {e.learner} ({'solution' if e.solution_source(notebook) else 'NO SOLUTION'})"
            for e in exercises(notebook)
        ]
        print(f"{path}: core {core} (at most {CORE_WORDS}); exercises: {', '.join(shapes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
