"""Every exercise check judges the learner's code, and every strengthened check can fail.

nbval runs each lesson as shipped, solutions included: its checks pass. Here each lesson runs in a
fresh kernel with its solution cells removed and the learner's cells as shipped (comments only):

- every exercise check (the first ``# Check:`` cell after a solution) must then fail with an
  AssertionError that says something, since nothing was written yet;
- every other cell must still run (nothing but an exercise may lean on a solution);
- each mutant in ``tests/lessons/mutants/<lesson>.py``, a plausible mistake, must make its
  check fail: in a shallow copy of the kernel's namespace (the lesson's names stay as they were
  for the next mutant), the exercise's solution runs when the check is an exercise's (a mutant
  is then the solution with one mistake), then the mutation, then the check's own source.

The lesson's structure (solution, then the learner's cell, then the check) is
``test_lessons.py``'s; this file judges what the checks do.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import nbformat
import pytest

from lessonbuild import runner

MUTANTS = Path(__file__).parent / "mutants"
CAUGHT, SURVIVED = "nbaccel-mutant-caught: ", "nbaccel-mutant-survived: "

pytestmark = pytest.mark.multiprocess


def is_solution(cell) -> bool:
    return cell.cell_type == "code" and "solution" in cell.metadata.get("tags", [])


def is_check(cell) -> bool:
    return cell.cell_type == "code" and cell.source.startswith("# Check:")


def exercise_checks(notebook) -> list[tuple[int, int]]:
    """Each solution's index, with the index of the first check after it (its exercise's)."""
    found = []
    for i, cell in enumerate(notebook.cells):
        if is_solution(cell):
            after = next(
                j for j in range(i + 1, len(notebook.cells)) if is_check(notebook.cells[j])
            )
            found.append((i, after))
    return found


def mutants(lesson: Path) -> list[tuple[str, str, str]]:
    path = MUTANTS / f"{lesson.stem}.py"
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location(f"mutants_{lesson.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.MUTANTS)


MUTANT_CELL = """\
_nbaccel_ip = get_ipython()
_nbaccel_ns = dict(globals())
exec(_nbaccel_ip.transform_cell({solution!r}), _nbaccel_ns)
exec(_nbaccel_ip.transform_cell({mutation!r}), _nbaccel_ns)
try:
    exec(_nbaccel_ip.transform_cell({check!r}), _nbaccel_ns)
except AssertionError as _nbaccel_error:
    print({caught!r} + (str(_nbaccel_error).splitlines() or ["(no message)"])[0])
except Exception as _nbaccel_error:
    print({survived!r} + "it raised " + repr(_nbaccel_error)[:300] + ", not AssertionError")
else:
    print({survived!r} + "the check passed")
"""


def errors(cell) -> list:
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("lesson", runner.lessons(), ids=lambda p: p.stem)
def test_without_solutions_every_exercise_check_fails_and_every_mutant_is_caught(lesson):
    from nbclient import NotebookClient

    notebook = nbformat.read(lesson, as_version=4)
    pairs = exercise_checks(notebook)
    checks = {id(notebook.cells[check]) for _, check in pairs}
    assert checks, f"{lesson.name} has no exercise checks"
    solution_of = {
        notebook.cells[check].source.splitlines()[0]: notebook.cells[solution].source
        for solution, check in pairs
    }
    notebook.cells = [c for c in notebook.cells if not is_solution(c)]
    by_source = {c.source.splitlines()[0]: c.source for c in notebook.cells if is_check(c)}
    planted = []
    for first_line, mutation, mistake in mutants(lesson):
        assert first_line in by_source, f"mutant for a check that is not there: {first_line!r}"
        source = MUTANT_CELL.format(
            solution=solution_of.get(first_line, ""),
            mutation=mutation,
            check=by_source[first_line],
            caught=CAUGHT,
            survived=SURVIVED,
        )
        planted.append((nbformat.v4.new_code_cell(source), first_line, mistake))
    notebook.cells += [cell for cell, _, _ in planted]
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(lesson.parent)}},
    )
    client.execute()

    broken = [
        (c.source.splitlines()[0] if c.source else "", [e.evalue[:300] for e in errors(c)])
        for c in notebook.cells
        if errors(c) and id(c) not in checks
    ]
    assert not broken, f"cells that failed without the solutions: {json.dumps(broken, indent=1)}"
    for cell in notebook.cells:
        if id(cell) in checks:
            first = cell.source.splitlines()[0]
            (error,) = errors(cell) or [None]
            assert error is not None, f"{first!r} passed with no answer written"
            assert error.ename == "AssertionError", (
                f"{first!r} raised {error.ename}: {error.evalue}"
            )
            assert error.evalue.strip(), f"{first!r} fails without saying what to fix"
    for cell, first_line, mistake in planted:
        said = printed(cell)
        assert CAUGHT in said, f"{first_line!r} let through {mistake!r}: {said.strip()[-400:]}"
