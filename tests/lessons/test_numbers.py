"""The numbers the committed lessons show (both editions) agree with the runs that made them.

Read from the notebooks as committed, so a lesson re-executed on older code, or a change that
lets two numbers of one run drift apart, fails here:

- no trained run shows "0 samples/s";
- every final progress line shows the run's training-window throughput, and the timing line
  printed under it (the run's own measurement) agrees with it within 25%;
- no progress line keeps the old, unlabelled rate (one counter interval's);
- a scaling table's efficiency above 1.05 carries its flag;
- a projection check outside its stated bound says it was not verified.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(ROOT.glob("0*.ipynb")) + sorted((ROOT / "ar").glob("0*.ipynb"))
NUMBER = r"([\d,]+(?:\.\d+)?)"
FINAL = re.compile(rf"{NUMBER} samples/s \(training window {NUMBER} s\)")
TIMING = re.compile(rf"^training window {NUMBER} s: {NUMBER} samples, {NUMBER} samples/s", re.M)


def number(text: str) -> float:
    return float(text.replace(",", ""))


def texts(path: Path) -> list[tuple[int, str]]:
    """Every text output of every code cell: (cell index, text)."""
    out = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain") or ""
            markdown = output.get("data", {}).get("text/markdown") or ""
            for t in (text, markdown):
                if t:
                    out.append((i, "".join(t) if isinstance(t, list) else t))
    return out


def progress_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^step \d+", line) and "|" in line]


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) == 12, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_trained_run_shows_zero_samples_per_s(path):
    for cell, text in texts(path):
        assert not re.search(r"(?<![\d,.])0 samples/s", text), f"cell {cell}: {text[:300]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_final_progress_line_agrees_with_its_runs_throughput(path):
    for cell, text in texts(path):
        for line in progress_lines(text):
            if "samples/s" not in line:
                continue
            labelled = "(training window" in line or re.search(r"\(last \d+ s\)", line)
            assert labelled, f"cell {cell}: a rate that does not say what it covers: {line}"
        for found in FINAL.finditer(text):
            after = text[found.end() :]
            timing = TIMING.search(after)
            assert timing, f"cell {cell}: no timing line under {found.group(0)!r}"
            shown, own = number(found.group(1)), number(timing.group(3))
            assert abs(shown / own - 1) <= 0.25, (
                f"cell {cell}: the progress line shows {shown:,.0f} samples/s, the run's "
                f"training window {own:,.0f}"
            )


def efficiencies(text: str) -> list[tuple[str, str]]:
    """Each row of each Markdown table with an "efficiency" column: (row, its efficiency cell)."""
    found, column = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            column = None
        elif "efficiency" in cells:
            column = cells.index("efficiency")
        elif column is not None and not set(line) <= set("|-: ") and len(cells) > column:
            found.append((line, cells[column]))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_efficiency_above_1_05_without_its_flag(path):
    for cell, text in texts(path):
        for row, value in efficiencies(text):
            efficiency = float(re.match(r"[\d.]+", value).group(0))
            flagged = re.search(r"\(!\d+\)", value)
            assert efficiency <= 1.05 or flagged, f"cell {cell}: unflagged efficiency: {row}"


CHECK = re.compile(r"\(([+-]\d+)%, bound ±(\d+)%\): (verified|NOT verified)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_projection_outside_its_bound_says_it_was_not_verified(path):
    for cell, text in texts(path):
        for found in CHECK.finditer(text):
            error, bound, verdict = int(found.group(1)), int(found.group(2)), found.group(3)
            if abs(error) > bound:
                assert verdict == "NOT verified", f"cell {cell}: {found.group(0)}"


def test_the_checks_can_fail(tmp_path):
    """The two regular expressions above catch what they are for."""
    line = "step 10/10 | 2 ranks on CPU | 4,000 samples/s (training window 2.0 s) | 9 s"
    below = "training window 2.00 s: 4,000 samples, 2,000 samples/s | start-up 1.00 s"
    found = FINAL.search(f"{line}\n{below}")
    timing = TIMING.search(below)
    assert number(found.group(1)) / number(timing.group(3)) == 2.0  # would fail the 25%
    assert re.search(r"(?<![\d,.])0 samples/s", "| 0 samples/s |")
    assert not re.search(r"(?<![\d,.])0 samples/s", "| 1,230 samples/s | 10 samples/s")
    assert progress_lines("step 3/3 | 2 ranks | 16,136 samples/s | 2 s") == [
        "step 3/3 | 2 ranks | 16,136 samples/s | 2 s"
    ]
    table = "| processes | efficiency | data % |\n|---:|---:|---:|\n| 1 | 1.00 | 3 |\n"
    table += "| 2 | 1.51 | 4 |\n| 3 | 1.60 (!1) | 5 |\n\nnot a table | 9.99 |"
    assert efficiencies(table) == [
        ("| 1 | 1.00 | 3 |", "1.00"),
        ("| 2 | 1.51 | 4 |", "1.51"),
        ("| 3 | 1.60 (!1) | 5 |", "1.60 (!1)"),
    ]
    verdict = CHECK.search("measured 3,715 (+240%, bound ±30%): verified on this machine")
    assert (int(verdict.group(1)), verdict.group(3)) == (240, "verified")  # would fail
