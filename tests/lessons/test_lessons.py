"""The lesson notebooks: their shape, their committed outputs, and the runner behind
``make lessons`` / ``make demo``. nbval executes the notebooks themselves (notebooks/)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from lessonbuild import exercises, runner
from lessonbuild.notebooks import clean

LESSONS = runner.lessons()
NAMES = [
    "01_data_parallel.ipynb",
    "02_ddp.ipynb",
    "03_amp.ipynb",
    "04_accelerate.ipynb",
    "05_scaling_lab.ipynb",
    "06_sharding.ipynb",
]
PNG = b"\x89PNG\r\n\x1a\n"


def test_the_six_lessons_are_there():
    assert [p.name for p in LESSONS] == NAMES


def code(notebook) -> list:
    return [c for c in notebook.cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_follows_the_conventions(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    first = notebook.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# Lesson ")
    assert "**Goals.**" in first.source and "**Time:**" in first.source
    assert code(notebook)[0].source.startswith('SIZE = "small"')
    assert any(c.source.startswith("# Check:") for c in code(notebook)), "no check cell"
    further = exercises.going_further(notebook)
    assert further is not None, f"no Markdown cell opens with {exercises.GOING_FURTHER!r}"
    headings = [i for i, c in enumerate(notebook.cells) if c.source.startswith("## Exercises")]
    assert len(headings) == 1 and headings[0] > further, "one '## Exercises' after Going further"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_exercises_come_last_and_no_code_cell_holds_a_solution(path):
    """Run All runs the whole lesson, then stops at the first exercise: its learner's cell
    (tag ``exercise``) ships as comments and ``raise NotImplementedError()``; the check follows;
    the solution is a collapsed Markdown block with one ```python fence, never a code cell.
    tests/lessons/test_exercises.py runs the checks."""
    notebook = nbformat.read(path, as_version=4)
    cells = notebook.cells
    found = exercises.exercises(notebook)
    assert found, "no exercise (a code cell tagged 'exercise')"
    exercises_at = next(i for i, c in enumerate(cells) if c.source.startswith("## Exercises"))
    assert found[0].learner > exercises_at, "an exercise before the '## Exercises' heading"
    assert not any(
        c.cell_type == "code"
        and not exercises.tagged(c, exercises.EXERCISE)
        and not exercises.is_check(c)
        for c in cells[found[0].learner :]
    ), "after the first exercise come only exercises, their checks and Markdown"
    for cell in cells:
        if cell.cell_type == "code":
            assert not exercises.tagged(cell, exercises.SOLUTION), "a code cell tagged solution"
            assert not cell.source.startswith("# Solution"), "a solution as a code cell"
    for exercise in found:
        learner = cells[exercise.learner].source
        lines = [ln.strip() for ln in learner.splitlines() if ln.strip()]
        assert lines[-1] == exercises.SHIPPED and all(ln.startswith("#") for ln in lines[:-1]), (
            f"a learner's cell ships as comments, then {exercises.SHIPPED}: {learner!r}"
        )
        assert len(lines) > 1, "the learner's cell says, in a comment, what to define"
        assert cells[exercise.check].source.startswith("# Check: exercise"), exercise.first_line
        if exercise.solution is not None:  # else tests/lessons/mutants holds it (a quiz)
            solution = cells[exercise.solution].source
            assert solution.lstrip().startswith("<details>") and "</details>" in solution
            assert exercise.solution_source(notebook), "a solution holds one ```python fence"
            assert not re.search(r"^\s*assert\b", exercise.solution_source(notebook), re.M)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_the_core_has_at_most_1200_words_in_both_editions(path):
    english = nbformat.read(path, as_version=4)
    end = exercises.going_further(english)
    assert end is not None
    for edition in (path, runner.NOTEBOOKS / "ar" / path.name):
        words = exercises.core_words(nbformat.read(edition, as_version=4), end)
        assert words <= exercises.CORE_WORDS, (
            f"{edition.relative_to(runner.NOTEBOOKS)}: the core (before "
            f"{exercises.GOING_FURTHER!r}) has {words} words of prose, over {exercises.CORE_WORDS}"
        )


def test_words_leave_out_code_fences_and_tags_and_core_ends_at_going_further():
    assert exercises.words("one `two` <b>three</b>\n```python\nx = 1\n```\nfour") == 4
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# Lesson 9\n\nfive words are here now"),
            nbformat.v4.new_code_cell("x = 1  # not prose"),
            nbformat.v4.new_markdown_cell("## Going further\n\nnot counted"),
        ]
    )
    assert exercises.core_words(notebook) == 8
    assert exercises.core_words(notebook, end=1) == 8


# What no output may name, whatever machine ran the lesson: a home folder, a virtual
# environment, a checkout (lessonbuild's own "<clone>/" and "~/" included).
MACHINE_PATHS = re.compile(
    r"(?<![\w.])(/home/\w|/Users/\w|/root/|~/|<clone>/|/work/)|site-packages|dist-packages"
    r"|/\.?venvs?/|/\.pyenv/|/bin/python"
)


def output_texts(notebook):
    for cell in code(notebook):
        for output in cell.outputs:
            texts = [output.get("text", ""), output.get("evalue", "")]
            texts += output.get("traceback", [])
            texts += [v for k, v in output.get("data", {}).items() if k.startswith("text/")]
            for text in texts:
                yield cell, "".join(text) if isinstance(text, list) else text


@pytest.mark.parametrize(
    "path",
    LESSONS + runner.lessons(runner.NOTEBOOKS / "ar"),
    ids=lambda p: str(p.relative_to(runner.NOTEBOOKS)),
)
def test_no_output_names_a_folder_of_the_machine_that_ran_it(path):
    found = [
        (
            cell.source.splitlines()[0][:60],
            match[0],
            text[max(0, match.start() - 60) : match.end() + 40],
        )
        for cell, text in output_texts(nbformat.read(path, as_version=4))
        for match in MACHINE_PATHS.finditer(text)
    ]
    assert not found, f"outputs naming the machine's folders: {found[:5]}"


def test_the_machine_path_pattern_finds_what_it_should():
    for text in (
        "/home/ana/x.py",
        "~/.cache",
        "<clone>/notebooks",
        "/opt/venv/bin/python",
        "lib/python3.11/site-packages/torch",
        "/root/.venv/lib",
        "/work/main/a",
    ):
        assert MACHINE_PATHS.search(text), text
    for text in ("torch/distributed/distributed_c10d.py", "scratch/runs/lesson4", "a / b"):
        assert not MACHINE_PATHS.search(text), text


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_is_committed_executed_with_clean_metadata(path):
    notebook = nbformat.read(path, as_version=4)
    assert set(notebook.metadata) == {"kernelspec", "language_info"}
    stop = exercises.first_exercise(notebook)  # Run All stops there: the exercises ship blank
    cells = [c for c in notebook.cells[:stop] if c.cell_type == "code"]
    blank = [c for c in notebook.cells[stop:] if c.cell_type == "code"]
    assert blank and all(c.execution_count is None and not c.outputs for c in blank), (
        "the exercises (from the first learner's cell on) ship unexecuted: run `make lessons`"
    )
    assert all(c.execution_count is not None for c in cells), "run `make lessons`"
    counts = [c.execution_count for c in cells]
    assert counts == sorted(counts), "executed top to bottom, in one kernel"
    outputs = [o for c in cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if runner.WIDGET in o.get("data", {})], "a dead widget"
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, "the live view's panels should be in the committed notebook"
    assert all(base64.b64decode(o.data["image/png"])[:8] == PNG for o in images)
    assert all("execution" not in c.metadata for c in cells)
    text = path.read_text()  # this checkout's folder and the home folder, as `make lessons` ran
    assert f"{runner.NOTEBOOKS.parent}/" not in text and f"{Path.home()}/" not in text


def test_cleaning_a_notebook_names_the_machines_paths_as_a_reader_can_place_them(tmp_path):
    root, home = tmp_path / "home" / "me" / "nbaccel", tmp_path / "home" / "me"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    notebook.cells[0].outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=f"Wrote {root}/notebooks/a.json\n"),
        nbformat.v4.new_output("execute_result", data={"text/plain": f"'{home}/x'"}),
        nbformat.v4.new_output(
            "error", ename="E", evalue=f"{root}/b", traceback=[f"File {home}/.pyenv/t.py"]
        ),
    ]
    clean(notebook, root=root, home=home)
    stream, value, error = notebook.cells[0].outputs
    assert stream.text == "Wrote <clone>/notebooks/a.json\n"  # the clone first: it is in home
    assert value.data["text/plain"] == "'~/x'"
    assert (error.evalue, error.traceback) == ("<clone>/b", ["File ~/.pyenv/t.py"])


def make_notebook(path, *sources: str, tag_last: bool = False) -> None:
    cells = [nbformat.v4.new_code_cell(s) for s in sources]
    if tag_last:
        cells[-1].metadata["tags"] = [runner.PANEL_TAG]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)


PANEL = """
from IPython.display import Image, display
from nbaccel.observe.live.panel import png
from nbaccel.observe.channel import Record
from nbaccel.observe.records import Run
run = Run()
run.add([Record(0, s, 100.0 + s, "loss", 1 / (s + 1)) for s in range(5)])
display(Image(png(run)))
"""


@pytest.mark.multiprocess
def test_the_runner_writes_back_only_a_run_that_passed(tmp_path):
    good, bad = tmp_path / "01_good.ipynb", tmp_path / "02_bad.ipynb"
    make_notebook(good, "from pathlib import Path\nprint(Path.cwd().name)")
    make_notebook(bad, "x = 1", "raise ValueError('broken lesson')")
    before = bad.read_bytes()
    runner.execute(good)
    ran = nbformat.read(good, as_version=4)
    assert ran.cells[0].outputs[0].text == f"{tmp_path.name}\n"  # ran in its own folder
    assert set(ran.metadata) == {"kernelspec", "language_info"}
    with pytest.raises(Exception, match="broken lesson"):
        runner.execute(bad)
    assert bad.read_bytes() == before and not list(tmp_path.glob(".*partial"))


@pytest.mark.multiprocess
def test_demo_writes_the_executed_flagship_and_its_final_panel(tmp_path, monkeypatch, capsys):
    lessons = tmp_path / "notebooks"
    lessons.mkdir()
    make_notebook(lessons / runner.FLAGSHIP, "x = 1", PANEL, tag_last=True)
    monkeypatch.setattr(runner, "NOTEBOOKS", lessons)
    assert runner.main(["demo", "--out", str(tmp_path / "results")]) == 0
    panel = tmp_path / "results" / "final_panel.png"
    assert panel.read_bytes()[:8] == PNG
    assert (tmp_path / "results" / runner.FLAGSHIP).exists()
    assert str(panel) in capsys.readouterr().out


def test_the_suite_and_the_lessons_kernel_run_without_the_environments_bin_on_path():
    if sys.prefix == sys.base_prefix:
        pytest.skip("not in a virtual environment: its bin is the system's, and stays on PATH")
    env_bin = os.path.dirname(sys.executable)  # conftest.py took it off PATH
    path = [os.path.realpath(p) for p in os.environ["PATH"].split(os.pathsep) if p]
    assert os.path.realpath(env_bin) not in path  # so nbval's kernel (a child) lacks it too
    assert shutil.which("nbaccel") != os.path.join(env_bin, "nbaccel")


SHELL = re.compile(r"^\s*(!|%%?(sx|system|bash|sh|script)\b)")


@pytest.mark.parametrize(
    "path",
    LESSONS + runner.lessons(runner.NOTEBOOKS / "ar"),
    ids=lambda p: str(p.relative_to(runner.NOTEBOOKS)),
)
def test_every_shell_command_in_a_lesson_runs_through_the_kernels_python(path):
    """``!nbaccel ...`` needs the environment's bin on PATH, which a registered kernel lacks
    (and then silently runs nothing); ``!{sys.executable} -m nbaccel ...`` does not."""
    notebook = nbformat.read(path, as_version=4)
    lines = [line for c in code(notebook) for line in c.source.splitlines() if SHELL.match(line)]
    bad = [line for line in lines if not line.strip().startswith("!{sys.executable} -m ")]
    assert not bad, f"call these through the kernel's interpreter: {bad}"


def test_needs_says_in_one_line_what_is_skipped_and_how_to_install_it(capsys):
    from nbaccel.lessons import needs

    assert needs("torch", "nothing") is True and capsys.readouterr().out == ""
    assert needs("no_such_module_here", "section 9", package="no-such-package") is False
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("Skipped: section 9, which needs no-such-package, not installed")
    assert "%pip install no-such-package" in line  # this kernel's pip, and no machine's path


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_with_fewer_than_two_gpus_runs_two_cpu_workers(path):
    """``device_count() or 2`` launches one process on a one-GPU machine, where the lesson's
    multi-process checks would pass without testing anything: below two GPUs, two CPU workers."""
    sources = "\n".join(c.source for c in code(nbformat.read(path, as_version=4)))
    assert not re.search(r"device_count\(\)\s+or\b", sources), "use lesson 2's USE_CUDA pattern"
