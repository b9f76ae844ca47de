"""The lessons' prose cannot contradict their outputs (lessonbuild/drift.py), both editions and the
READMEs, and each contradiction that reviews found in earlier executions fails the check when it
is put back. Also: one machine behind every committed output, live panels long enough to draw a
rate, and no DeepSpeed build line where the lesson says nbaccel hides it."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from lessonbuild import drift, runner
from lessonbuild.drift import findings, readme_findings
from nbaccel.lessons import rate_spread

ROOT = Path(__file__).resolve().parents[2]
ENGLISH = sorted((ROOT / "notebooks").glob("0*.ipynb"))
NOTEBOOKS = ENGLISH + sorted((ROOT / "notebooks" / "ar").glob("0*.ipynb"))
ids = lambda p: f"{p.parent.name}/{p.stem}"  # noqa: E731


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_no_number_or_direction_in_prose_that_its_outputs_do_not_back(path):
    found = findings(nbformat.read(path, as_version=4))
    assert not found, "\n".join(map(str, found))


@pytest.mark.parametrize("path", drift.READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_readme_claims_a_lesson_result_its_outputs_do_not_show(path):
    found = readme_findings(path)
    assert not found, "\n".join(map(str, found))


# --- the contradictions found in earlier executions, put back -----------------------------------


def lesson(*cells: tuple[str, str]) -> nbformat.NotebookNode:
    """A notebook of ``("markdown", text)`` and ``("output", text)`` cells (a code cell that
    printed ``text``), under one section."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_markdown_cell("## 1. A section"))
    for kind, text in cells:
        if kind == "markdown":
            notebook.cells.append(nbformat.v4.new_markdown_cell(text))
        else:
            cell = nbformat.v4.new_code_cell("report()")
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
            notebook.cells.append(cell)
    return notebook


# (what the prose said, what the output beside it printed): lessons as committed before issue 59
CONTRADICTIONS = {
    "01 cell 41: processes near 2 cores busy": (
        "Nothing makes them take turns, so with two free cores they run side by side and keep "
        "close to 2 busy, in about half the threads' wall time.",
        "together:  1.02 s CPU in  1.47 s wall -> 0.70 cores busy",
    ),
    "05 cell 52: efficiency near 1": (
        "There is little to hide, and the fast links' curves coincide at an efficiency near 1.",
        "| PCIe 4.0 x16 | 0.45 |\n| NVLink 4 (H100) | 0.79 |\n| InfiniBand NDR | 0.78 |",
    ),
    "05 cell 52: a GPU a hundred times faster": (
        "If a GPU computed the same step, say, a hundred times faster (an assumption to vary, "
        "not a measurement), the gradients would keep their size.",
        "one step 1.2743 ms, 4.506 MB of gradients",
    ),
    "05 cell 32: the ratio settles near a constant": (
        "So for wide models the ratio *all-reduce / step* settles near a constant that the "
        "per-process batch sets.",
        "| 128 | 1.07 |\n| 512 | 1.76 |\n| 1024 | 1.36 |",
    ),
    "05 exercise 1: the ratio falls as the model grows": (
        "Two effects pull against each other: the ratio *all-reduce / step* (both widths are in "
        "section 5's table: it falls as the model grows), and the work of a step.",
        "| 128 | 1.07 |\n| 512 | 1.76 |",
    ),
    "05 cell 20: half the cores each": (
        "Compute per sample changes too: each of the two processes has half the cores for its "
        "arithmetic (section 3's threads).",
        "1 process: 1 torch thread\n2 processes: 1 torch thread each",
    ),
    "05 cell 57: start-up times": (
        "Below, the first batch came 6.9 s after the call on the test cluster against 1.3 s for "
        "the local launch.",
        "start-up 6.58 s (cluster)\nstart-up 0.61 s (local)",
    ),
    "04 cell 31: bf16 slower on this CPU": (
        "**On this CPU** bf16 is usually *slower* than float32: without bf16 matrix units every "
        "bf16 operation converts to float32 and back.",
        "bf16: 0.53 of float32's time",
    ),
    "03 cell 46: several times faster": (
        "With autocast, matmul-heavy training steps typically run several times faster.",
        "| H200 | bf16 x0.84 |",
    ),
    "a Run All time in the first cell": (
        "**Time:** Run All on 2 CPU cores: about 20 s (measured 2026-12-03).",
        "",
    ),
}


@pytest.mark.parametrize("name", CONTRADICTIONS)
def test_each_contradiction_found_before_fails_the_check(name):
    prose, output = CONTRADICTIONS[name]
    assert findings(lesson(("output", output), ("markdown", prose))), name


def test_what_the_prose_may_say_passes():
    """A constant of the code, a formula, a cited figure, a figure of the section's output, a
    structural number and a direction put as something to look for are all backed."""
    notebook = lesson(
        ("output", "processes kept 1.97 cores busy, threads 1.00"),
        (
            "markdown",
            "Section 3 trains `HIDDEN = 128` units on 2 workers; a ring moves 2(N-1)/N x S "
            "bytes. The [ZeRO paper](https://arxiv.org/abs/1910.02054) counts 16 bytes a "
            "parameter. The printout says 1.97 cores. Look whether the ratio falls as the "
            "model grows, and compare the two rates. Reading: about 40 minutes.",
        ),
    )
    notebook.cells.append(nbformat.v4.new_code_cell("HIDDEN, WORKERS = 128, 2"))
    assert not findings(notebook), "\n".join(map(str, findings(notebook)))


README_CLAIMS = [
    "| [05 Scaling lab](notebooks/05_scaling_lab.ipynb) | a scaling model checked here |",
    "`projection.calibrate()` checks the model against 2 real workers: here it predicts a DDP "
    "step within 7-20%. Lesson 5 draws the projections.",
    "| [05 مختبر التوسع](05_scaling_lab.ipynb) | إسقاط التوسع بنموذج مُتحقَّق منه |",
]


@pytest.mark.parametrize("claim", README_CLAIMS)
def test_a_readme_claim_the_lesson_does_not_show_fails(tmp_path, claim):
    readme = tmp_path / "README.md"
    readme.write_text(f"# nbaccel\n\n{claim}\n")
    said = ["calibration (+102%, bound ±30%): NOT verified on this machine"]
    assert readme_findings(readme, outputs=lambda lesson: said), claim
    fine = tmp_path / "FINE.md"
    fine.write_text("# nbaccel\n\n| [05 Scaling lab](05_scaling_lab.ipynb) | the model's check |\n")
    assert not readme_findings(fine, outputs=lambda lesson: said)


# --- one machine, panels that draw a rate, what the lessons promise to hide ---------------------


def test_every_lesson_records_the_one_machine_that_ran_them_all():
    machines = {ids(p): runner.first_machine(nbformat.read(p, as_version=4)) for p in NOTEBOOKS}
    assert None not in machines.values(), machines  # each first output names its machine
    assert len(set(machines.values())) == 1, machines
    readme = (ROOT / "notebooks" / "README.md").read_text()
    block = drift.GENERATED.search(readme)
    assert block, "notebooks/README.md has no block that `make lessons` wrote"
    assert next(iter(machines.values())) in block.group(0)


WINDOW = re.compile(r"\(training window ([\d.]+) s\)")


def windows(path: Path) -> list[tuple[float, bool]]:
    """Each final progress line's training window, and whether its cell showed an image."""
    found = []
    for cell in nbformat.read(path, as_version=4).cells:
        image = any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))
        for text in drift.texts(cell):
            found += [(float(w), image) for w in WINDOW.findall(text)]
    return found


@pytest.mark.parametrize("path", ENGLISH, ids=ids)
def test_every_lesson_trains_once_long_enough_for_its_panel_to_draw_a_rate(path):
    runs = windows(path)
    assert any(3 <= window <= 60 and image for window, image in runs), runs
    assert all(window <= 60 for window, _ in runs), f"a run over 60 s on 2 cores: {runs}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_no_output_shows_deepspeeds_op_build_line(path):
    """nbaccel hides the line DeepSpeed prints as each process loads its shared-memory op."""
    for cell in nbformat.read(path, as_version=4).cells:
        for text in drift.texts(cell):
            assert "built successfully" not in text, text[:300]


def test_rate_spread_flags_two_runs_of_one_model_more_than_3x_apart(capsys):
    assert rate_spread({"1 rank": (602.0, 1), "2 ranks": (19_226.0, 2)}).startswith("FLAGGED")
    calm = rate_spread({"1 rank": (9_000.0, 1), "2 ranks": (9_600.0, 2), "short": (None, 1)})
    assert not calm.startswith("FLAGGED") and "short: too short" in calm
    assert capsys.readouterr().out.count("\n") == 2
    with pytest.raises(ValueError, match="at least 1 rank"):
        rate_spread({"x": (1.0, 0)})


def leaves_the_group_holding_a_ddp_model(source: str) -> bool:
    """True when ``source`` wraps a model in DDP and calls ``destroy_process_group()`` without a
    ``del`` of it first: the hang at exit lesson 2's version note warns of."""
    if "DistributedDataParallel(" not in source or "destroy_process_group()" not in source:
        return False
    wrapped = set(re.findall(r"^\s*(\w+) = DistributedDataParallel\(", source, re.M))
    before = source[: source.index("destroy_process_group()")]
    return not any(re.search(rf"^\s*del .*\b{name}\b", before, re.M) for name in wrapped)


@pytest.mark.parametrize("path", ENGLISH, ids=ids)
def test_a_recipe_deletes_its_ddp_model_before_leaving_the_group(path):
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            assert not leaves_the_group_holding_a_ddp_model(cell.source), f"cell {i}"
    recipe = (
        "    model = DistributedDataParallel(model, device_ids=None)\n"
        "    state = model.module.state_dict()\n"
        "    dist.destroy_process_group()\n"
    )
    assert leaves_the_group_holding_a_ddp_model(recipe)  # lesson 2's recipe, as it was
    fixed = recipe.replace("    dist.destroy", "    del model\n    dist.destroy")
    assert not leaves_the_group_holding_a_ddp_model(fixed)
