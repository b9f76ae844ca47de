"""Prose that its outputs could contradict: measured figures and directions in a lesson's Markdown.

A lesson's Markdown says what to look for; the cell that measures prints what it saw. This reads
an executed notebook and lists every sentence that states a figure or a direction the notebook
does not back:

- a **number** in prose must be a constant the lesson's code sets, part of a formula, cited
  (a link in its sentence, or just above its table), structural (a lesson, section, cell,
  exercise, stage or rank number; a list marker; a date, a version, a year; a reading time in
  minutes), or shown by an output of a code cell in the same ``##`` section;
- a number that reads as **measured** (after "about", "near", "close to", "≈"; before a unit
  such as s, ms, %, samples/s, MB, "busy"; "N times faster", "twice", "half") is excused only by
  a formula, a citation or an output of its section (a one-digit integer only by a formula or a
  citation: "near 1" matches too much);
- a sentence that states a measured **direction** ("faster", "falls as ...", "settles near")
  about this run or machine ("here", "this CPU", "the table") counts as measured, unless it says
  what to look for ("whether", "if", "compare", "look", "watch", "where", "when").

The README files' claims about a lesson are read the same way against that lesson's outputs
(``readme_findings``): a figure it quotes must be in them, and a claim that a model or
projection was verified needs the lesson to print "verified" and never "NOT verified". A block
that ``make lessons`` writes from its own run (between ``<!-- make lessons -->`` markers) is
skipped.

    python -m lessonbuild.drift [NOTEBOOK ...]   # default: every lesson, both editions, READMEs
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .notebooks import NOTEBOOKS

ROOT = NOTEBOOKS.parent
READMES = (ROOT / "README.md", NOTEBOOKS / "README.md", NOTEBOOKS / "ar" / "README.md")
GENERATED = re.compile(r"<!-- make lessons -->.*?<!-- /make lessons -->", re.S)


@dataclass(frozen=True)
class Finding:
    where: str  # "cell 41" or "README.md line 92"
    claim: str  # the number or direction found
    why: str
    sentence: str

    def __str__(self) -> str:
        return f"{self.where}: {self.claim!r} {self.why}\n    {self.sentence}"


# --- the prose of a Markdown cell, as sentences --------------------------------------------------

FENCED = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)|\$\$.+?\$\$|(?<![\\$])\$[^$\n]+?\$", re.S)
LINK = re.compile(r"\]\((?:https?:)?[^)\s]*\)|<https?://[^>]+>|https?://\S+")
HTML = re.compile(r"<[^<>\n]+>")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}(?:T[\d:+.]+)?\b|\b\d+\.\d+\.\d+\S*")
# a link, or a committed benchmark's results file (`benchmarks/results/...`): a figure's source
CITED = re.compile(r"\]\(https?://|<https?://|https?://|benchmarks/results/")


def sentences(markdown: str) -> list[tuple[str, bool]]:
    """``markdown`` as units of prose: ``(text, cited)``. A unit is a sentence, a list item, a
    heading or a whole table; ``cited`` says it (or, for a table, the sentence above it) holds
    a link. Code spans, math, link targets, HTML and dates are blanked out of ``text``."""
    text = FENCED.sub("\n\n", GENERATED.sub("", markdown))
    units: list[tuple[str, bool]] = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if lines and all(line.lstrip().startswith("|") for line in lines):
            above = units[-1][1] if units else False
            units.append((_blank(block), bool(CITED.search(block)) or above))
            continue
        for item in re.split(r"\n(?=\s*(?:[-*+]|\d+\.)\s|#)", block):
            item = re.sub(r"^\s*(?:[-*+>]|\d+\.)\s+|^#+\s+(?:\d+(?:\.\d+)*\.?\s+)?", "", item)
            for sentence in re.split(r"(?<=[.!?])\s+(?=[^a-z])", item.replace("\n", " ")):
                blanked = _blank(sentence)
                if blanked.strip() and not re.fullmatch(r"\s*\d+\.\s*", blanked):
                    units.append((blanked, bool(CITED.search(sentence))))
    return units


def _blank(text: str) -> str:
    for pattern in (CODE, LINK, HTML, DATE):
        text = pattern.sub(" `code` ", text)
    return re.sub(r"[*_]{1,3}(?=\S)|(?<=\S)[*_]{1,3}", "", text)  # emphasis marks


# --- numbers ------------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.,])(\d[\d,]*(?:\.\d+)?)(?!\d)")
APPROXIMATE = re.compile(
    r"(?:\babout|\baround|\broughly|\bapproximately|\bnearly|\bnear|\bclose to|\balmost|≈|~"
    r"|نحو|حوالي|قرابة|قرب)\s*$",
    re.I,
)
UNIT = re.compile(
    r"^\s*(?:%|(?:s|ms|µs|us|ns|seconds?|milliseconds?)\b|samples?/s|samples? per"
    r"|[KMGT]i?B\b|[KMGT]b/s|GB/s|TFLOPS|cores? busy|busy\b|times (?:faster|slower|as)"
    r"|ثانية|ثوانٍ|ثوان|مللي)",
    re.I,
)
MINUTES = re.compile(r"^(?:-|\s)minutes?\b|^\s*min\b|^\s*(?:دقيقة|دقائق)", re.I)
STRUCTURAL = re.compile(
    r"(?:§|\b(?:lessons?|sections?|cells?|exercises?|questions?|stages?|ranks?|parts?|chapters?|"
    r"figures?|tables?|lines?|versions?|steps?|epochs?|torch|python|pytorch|accelerate|"
    r"deepspeed|pcie|nvlink|cuda|zero|gen|sm|level|option|item|point)"
    r"|الدرس|الدروس|القسم|القسمين|الأقسام|الخلية|الخلايا|التمرين|التمارين|المرحلة|المراحل|الرتبة"
    r"|السؤال|الخطوة|الحقبة)"
    r"(?:\s*(?:\d+|,|and|or|to|-|–))*\s*$",
    re.I,
)
OPERATOR = "+−×÷/*=^<>≤≥·"
SPEED = re.compile(
    r"\b(?:faster|slower|quicker|speeds?[- ]?up|throughput|rate|time|latency)\b", re.I
)
MULTIPLIER = re.compile(
    r"\b(?:several|many|a few|(?:a|one|two|three|four|five|ten)(?: hundred| thousand)?|"
    r"hundreds?|thousands?|\d[\d,.]*)\s+times\b|\b\d[\d,.]*\s*[x×](?!\d)",
    re.I,
)
RESOURCE = re.compile(r"\b(?:faster|slower|time|cores?|busy|memory|bytes|throughput)\b", re.I)
FRACTION = re.compile(r"\b(?:half|twice|double|a third|a quarter)\b", re.I)


def _value(token: str) -> float:
    return float(token.replace(",", ""))


def code_numbers(sources: list[str]) -> set[float]:
    """Every numeric literal in ``sources`` (code cells), as values: 1_000 and 3e-3 included."""
    found = set()
    for source in sources:
        for token in re.findall(r"(?<![\w.])\d[\d_]*(?:\.\d+)?(?:e-?\d+)?", source):
            found.add(float(token.replace("_", "")))
    return found


def output_numbers(texts: list[str]) -> set[float]:
    return {_value(t) for text in texts for t in NUMBER.findall(text) if t.strip(",")}


def number_findings(
    text: str, cited: bool, constants: set[float] | None, shown: set[float]
) -> list[tuple[str, str]]:
    """``(claim, why)`` for each number in one unit of prose that nothing backs. Without
    ``constants`` (a README's prose) only quantities count: a figure with a unit, an
    approximation, a ratio."""
    found = []
    formula = any(op in text for op in OPERATOR) or re.search(r"\d\(", text)
    speed = SPEED.search(text)
    for match in NUMBER.finditer(text):
        token, start, end = match.group(1).rstrip(","), match.start(), match.end()
        before, after = text[:start], text[end:]
        if before.endswith("-") and before[:-1][-1:].isalpha():  # ZeRO-3, fp-16
            continue
        if re.match(r"[x×]\d", after) or before.endswith(("x", "×")):  # 8x8: a shape
            continue
        if STRUCTURAL.search(before) or MINUTES.match(after):
            continue
        if re.fullmatch(r"(?:19|20)\d\d", token) and not UNIT.match(after):  # a year
            continue
        near = text[max(0, start - 3) : end + 3]
        if formula and any(op in near for op in OPERATOR):
            continue
        value = _value(token)
        multiplier = re.match(r"\s*(?:times\b|[x×](?!\w))", after) and speed
        measured = bool(APPROXIMATE.search(before) or multiplier)
        if cited:
            continue
        small = "." not in token and value < 10
        if value in shown and not (measured and small):
            continue
        if measured:
            word = "an approximation" if APPROXIMATE.search(before) else "a measured ratio"
            found.append((token, f"reads as {word}, and no output of its section shows it"))
        elif constants is None or value not in constants:
            if constants is None and not UNIT.match(after):
                continue
            if UNIT.match(after):
                why = "is a quantity that no output of its section shows, nor the code sets"
                found.append((token, why))
                continue
            found.append((token, "is not a constant of the code, a formula, or in an output"))
    if not cited:
        for match in MULTIPLIER.finditer(text):
            if speed and not match.group(0)[0].isdigit():
                found.append((match.group(0), "is a measured ratio, stated in prose"))
        for match in FRACTION.finditer(text):
            if not formula and "`code`" not in text and RESOURCE.search(text):
                found.append((match.group(0), "is a measured ratio, stated in prose"))
    return found


# --- directions -----------------------------------------------------------------------------------

DIRECTION = re.compile(
    r"\b(?:faster|slower|quicker|speeds? (?:it |them )?up|slows? (?:it )?down|usually|"
    r"beats?|outperforms?|coincides?|coincide)\b",
    re.I,
)
TREND = re.compile(r"\b(?:falls?|rises?|grows?|shrinks?|drops?|climbs?|settles?)\s+(?:near|as)\b")
THIS_RUN = re.compile(
    r"\b(?:here|this (?:CPU|machine|run|lesson's run|computer)|these runs|above|below|"
    r"the (?:table|printout|plot|figure|curves|panel|numbers)|measured|you (?:will )?see)\b",
    re.I,
)
LOOK = re.compile(
    r"\b(?:whether|if|look|looks|compare|check|watch|where|when|predict|might|may|can|could)\b",
    re.I,
)


def direction_findings(text: str, cited: bool) -> list[tuple[str, str]]:
    if cited or LOOK.search(text):
        return []
    trend = TREND.search(text)
    if trend and not re.match(r"\s*\S*[/×^]", text[trend.end() :]):  # "falls as 1/N"
        return [(trend.group(0), "states a measured trend; say what to look for instead")]
    direction = DIRECTION.search(text)
    if direction and THIS_RUN.search(text):
        return [(direction.group(0), "states a measured direction about this run")]
    return []


# --- a notebook -----------------------------------------------------------------------------------


def texts(cell) -> list[str]:
    """A code cell's text outputs: streams, plain text and Markdown (not images or HTML)."""
    out = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        for text in (output.get("text"), data.get("text/plain"), data.get("text/markdown")):
            if text:
                out.append("".join(text) if isinstance(text, list) else text)
    return out


def sections(notebook) -> list[int]:
    """Each cell's section: the index of the last Markdown cell with a ``#``/``##`` heading."""
    current, owner = 0, []
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "markdown" and re.search(r"^#{1,2} ", cell.source, re.M):
            current = i
        owner.append(current)
    return owner


def findings(notebook) -> list[Finding]:
    """Every number or direction in the notebook's Markdown that nothing in it backs."""
    owner = sections(notebook)
    constants = code_numbers([c.source for c in notebook.cells if c.cell_type == "code"])
    outputs: dict[int, list[str]] = {}
    for i, cell in enumerate(notebook.cells):
        outputs.setdefault(owner[i], []).extend(texts(cell))
    found = []
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type != "markdown":
            continue
        source = re.sub(r"</?div[^>]*>", "", cell.source)
        shown = output_numbers(outputs.get(owner[i], []))
        for text, cited in sentences(source):
            for claim, why in number_findings(text, cited, constants, shown):
                found.append(Finding(f"cell {i}", claim, why, text.strip()))
            for claim, why in direction_findings(text, cited):
                found.append(Finding(f"cell {i}", claim, why, text.strip()))
    return found


# --- the READMEs' claims about a lesson -----------------------------------------------------------

LESSON = re.compile(r"\b(0[1-6])_\w+\.ipynb|\b[Ll]esson (\d)\b|الدرس (\d)")
VERIFIED = re.compile(
    r"(?<!not )(?<!NOT )\b(?:verified|validated|checked|confirmed|predicts)\b"
    r"|مُتحقَّق|متحقق|تحقَّق",
    re.I,
)
MODEL = re.compile(r"\b(?:model|projection|predict\w*|calibrat\w*)\b|نموذج|إسقاط", re.I)


@functools.cache
def lesson_outputs(lesson: str) -> tuple[str, ...]:
    import nbformat

    path = next(NOTEBOOKS.glob(f"{lesson}_*.ipynb"))
    notebook = nbformat.read(path, as_version=4)
    return tuple(t for cell in notebook.cells for t in texts(cell))


def readme_findings(path: Path, outputs=lesson_outputs) -> list[Finding]:
    """A README's claims about a lesson's result (in a paragraph or table row that names the
    lesson) that the lesson's own outputs do not show."""
    found = []
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    for block in re.split(r"\n\s*\n|\n(?=\||[-*+] )", FENCED.sub("", text)):
        mention = LESSON.search(block)
        if not mention:
            continue
        lesson = "0" + next(g for g in mention.groups() if g)[-1]
        shown = outputs(lesson)
        numbers = output_numbers(shown)
        line = text[: text.find(block)].count("\n") + 1
        where = f"{path.name} line {line}"
        for sentence, cited in sentences(block):
            if VERIFIED.search(sentence) and MODEL.search(sentence):
                said = "\n".join(shown)
                if "NOT verified" in said or not re.search(r"\bverified\b", said):
                    claim = VERIFIED.search(sentence).group(0)
                    why = f"claims lesson {lesson[1]}'s model is verified; its outputs do not"
                    found.append(Finding(where, claim, why, sentence.strip()))
            for claim, why in number_findings(sentence, cited, None, numbers):
                found.append(Finding(where, claim, f"{why} (lesson {lesson[1]})", sentence))
    return found


def main(argv: list[str] | None = None) -> int:
    import nbformat

    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        paths = sorted(NOTEBOOKS.glob("0*.ipynb")) + sorted((NOTEBOOKS / "ar").glob("0*.ipynb"))
        paths += list(READMES)
    total = 0
    for path in paths:
        if path.suffix == ".md":
            found = readme_findings(path)
        else:
            found = findings(nbformat.read(path, as_version=4))
        for finding in found:
            print(f"{path}: {finding}")
        total += len(found)
    print(f"{total} finding(s)" if total else "no drift: every figure and direction is backed")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
