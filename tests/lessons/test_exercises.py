"""Every exercise tests the learner: its check fails as shipped and for each wrong answer written
down beside it, and passes for its solution.

Each lesson runs in a fresh kernel as a learner's Run All would, but past its first exercise
(``allow_errors``): every cell outside the exercises must run; every learner's cell (tag
``exercise``) must raise the NotImplementedError it ships with; every exercise check must then
fail with an AssertionError that says what to fix, since nothing was written yet.

Then, for every exercise, in a shallow copy of the kernel's namespace (so each answer starts
from the lesson as it ran, not from the answer before it), the learner's cell holds

- the solution: the one ```` ```python ```` fence of the exercise's ``<details>`` Markdown cell
  (lessonbuild.exercises), or ``SOLUTIONS[check]`` in ``tests/lessons/mutants/<lesson>.py``
  where the notebook must not show it (a quiz's answers): the check must pass;
- each of ``WRONG``'s plausible wrong answers for it (at least two): the check must fail with
  an AssertionError and a message;

and each ``MUTANTS`` entry (a mistake once let through by a check in the lesson's body) runs
before that check, which must fail. The lesson's shape is ``test_lessons.py``'s; this file
judges what the checks do.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import nbformat
import pytest

from lessonbuild import exercises, runner

MUTANTS = Path(__file__).parent / "mutants"
PASSED, CAUGHT, RAISED = "nbaccel-check-passed", "nbaccel-check-caught: ", "nbaccel-check-raised: "
BROKEN = "nbaccel-answer-raised: "
LEAST_WRONG = 2

pytestmark = pytest.mark.multiprocess

# A learner's cell holding ``answer``, then ``check``, in a copy of the kernel's namespace.
VARIANT = """\
_nbaccel_ip = get_ipython()
_nbaccel_ns = dict(globals())
try:
    exec(_nbaccel_ip.transform_cell({answer!r}), _nbaccel_ns)
except Exception as _nbaccel_error:
    print({broken!r} + repr(_nbaccel_error)[:300])
else:
    try:
        exec(_nbaccel_ip.transform_cell({check!r}), _nbaccel_ns)
    except AssertionError as _nbaccel_error:
        _nbaccel_said = (str(_nbaccel_error).strip().splitlines() or [""])[0]
        print({caught!r} + (_nbaccel_said or "(no message)"))
    except Exception as _nbaccel_error:
        print({raised!r} + repr(_nbaccel_error)[:300])
    else:
        print({passed!r})
"""


def written_down(lesson: Path):
    """The lesson's MUTANTS, WRONG and SOLUTIONS (empty where its file lacks them)."""
    path = MUTANTS / f"{lesson.stem}.py"
    if not path.exists():
        return [], [], {}
    spec = importlib.util.spec_from_file_location(f"mutants_{lesson.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return (
        list(getattr(module, "MUTANTS", [])),
        list(getattr(module, "WRONG", [])),
        dict(getattr(module, "SOLUTIONS", {})),
    )


def variant(answer: str, check: str) -> nbformat.NotebookNode:
    source = VARIANT.format(
        answer=answer, check=check, broken=BROKEN, caught=CAUGHT, raised=RAISED, passed=PASSED
    )
    return nbformat.v4.new_code_cell(source)


def errors(cell) -> list:
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def first_line(cell) -> str:
    return cell.source.splitlines()[0] if cell.source else ""


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("lesson", runner.lessons(), ids=lambda p: p.stem)
def test_every_check_fails_as_shipped_and_when_wrong_and_passes_the_solution(lesson):
    from nbclient import NotebookClient

    notebook = nbformat.read(lesson, as_version=4)
    found = exercises.exercises(notebook)
    assert found, f"{lesson.name} has no exercises"
    mutants, wrong, solutions = written_down(lesson)
    checks = {e.first_line: notebook.cells[e.check].source for e in found}
    body_checks = {first_line(c): c.source for c in notebook.cells if exercises.is_check(c)}

    planted = []  # (cell, what it holds, "pass" or "fail")
    for exercise in found:
        solution = solutions.get(exercise.first_line) or exercise.solution_source(notebook)
        assert solution, f"{exercise.first_line!r}: no solution (one ```python fence)"
        planted.append((variant(solution, checks[exercise.first_line]), exercise, "pass"))
        answers = [
            (source, mistake) for line, source, mistake in wrong if line == exercise.first_line
        ]
        assert len(answers) >= LEAST_WRONG, (
            f"{exercise.first_line!r} has {len(answers)} wrong answers written down; "
            f"at least {LEAST_WRONG} are needed"
        )
        for source, mistake in answers:
            planted.append((variant(source, checks[exercise.first_line]), mistake, "fail"))
    for line, _source, _ in wrong:
        assert line in checks, f"a wrong answer for an exercise that is not there: {line!r}"
    for line, mutation, mistake in mutants:
        assert line in body_checks, f"a mutant for a check that is not there: {line!r}"
        assert line not in checks, f"{line!r} is an exercise's: write its mistake in WRONG"
        planted.append((variant(mutation, body_checks[line]), mistake, "fail"))

    learners = {id(notebook.cells[e.learner]) for e in found}
    exercise_checks = {id(notebook.cells[e.check]) for e in found}
    notebook.cells += [cell for cell, _, _ in planted]
    planted_ids = {id(cell) for cell, _, _ in planted}
    NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(lesson.parent)}},
    ).execute()

    broken = [
        (first_line(c), [e.evalue[:300] for e in errors(c)])
        for c in notebook.cells
        if errors(c) and id(c) not in learners | exercise_checks | planted_ids
    ]
    assert not broken, f"cells that failed outside the exercises: {json.dumps(broken, indent=1)}"
    for cell in notebook.cells:
        if id(cell) in learners:
            assert [e.ename for e in errors(cell)] == ["NotImplementedError"], (
                f"a learner's cell as shipped must raise NotImplementedError: {cell.source!r}"
            )
        if id(cell) in exercise_checks:
            (error,) = errors(cell) or [None]
            assert error is not None, f"{first_line(cell)!r} passed with no answer written"
            assert error.ename == "AssertionError", (
                f"{first_line(cell)!r}, as shipped, raised {error.ename}: {error.evalue}"
            )
            assert error.evalue.strip(), f"{first_line(cell)!r} fails without saying what to fix"
    for cell, held, expected in planted:
        said = printed(cell).strip()
        if expected == "pass":
            assert said.endswith(PASSED), f"{held.first_line!r} failed its solution: {said[-600:]}"
        else:
            assert CAUGHT in said and "(no message)" not in said, (
                f"a check let through {held!r}, or failed it without a message: {said[-600:]}"
            )
