"""The Arabic edition of the lessons: English code plus translated Markdown, never a second copy
of the code.

Each lesson's Arabic Markdown lives in ``notebooks/ar/text/<lesson>.md``, one section per English
Markdown cell, each opened by a marker that names the English cell and a hash of its text::

    <!-- cell 4, English 1a2b3c4d5e6f -->
    ## 2. الحلقة الكاملة
    ...

The editions are equal in content: a section the English lesson lacks (``<!-- after cell N -->``,
which older translations used) stops the build; write it in English and translate it.

``build`` makes ``notebooks/ar/<lesson>.ipynb`` from the English notebook: code cells copied as
they are (source, metadata, outputs), Markdown cells replaced by their translation wrapped in
``<div dir="rtl">``, with code inside it kept left to right. When an English Markdown cell
changes, its hash no longer matches and the build stops, naming the cell, so a change to a
lesson reaches both editions.

    python -m lessonbuild.edition build [LESSON]   # every lesson with a translation, or one
    python -m lessonbuild.edition check [LESSON]   # what is missing or out of date
    python -m lessonbuild.edition skeleton LESSON  # a translation file to fill in
    python -m lessonbuild.edition renumber LESSON  # markers follow cells added above
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from . import exercises
from .notebooks import NOTEBOOKS, clean, lessons

ARABIC = NOTEBOOKS / "ar"
TEXT = ARABIC / "text"
MARKER = re.compile(r"^<!-- (?:cell (\d+), English ([0-9a-f]{12})|after cell (\d+)) -->$", re.M)
OPEN, CLOSE = '<div dir="rtl">\n\n', "\n\n</div>"  # blank lines: Markdown inside the div


FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LRI, PDI = "\u2066", "\u2069"  # Unicode's left-to-right isolate, and its end
# Spans of a translation that are left as written (link targets, HTML tags, URLs, isolates) or
# kept whole in an isolate (inline code, inline math), so no formula is looked for inside them.
KEEP = re.compile(
    r"(?P<isolate>(?P<ticks>`+)(?!`).+?(?<!`)(?P=ticks)(?!`)"  # `f()`: else it shows as ()f
    r"|(?<![\\$])\$(?!\$)[^$\n]+?(?<!\\)\$(?!\$))"  # $x^2$
    r"|\$\$.+?\$\$|\]\([^)\s]*\)|<[^<>\n]+>|https?://\S+|" + LRI + ".*?" + PDI,
    re.S,
)
# A formula: Latin or Greek letters, digits and operators with at least one operator, e.g.
# "2(N−1)/N × S", "(r−s) mod N", "(2 + 2 + 12) / N". In a right-to-left paragraph the bidi
# algorithm reorders it ("N × S/(N−1)2"), so the build puts each in a left-to-right isolate.
TERM = r"[A-Za-z0-9\u0370-\u03ff]"
FORMULA = re.compile(
    rf"(?<![A-Za-z0-9_])[-−(]*{TERM}(?:[{TERM[1:-1]}()+−×÷/=^<>≤≥≈·.,' %-]*[{TERM[1:-1]})%])?"
)
OPERATOR = re.compile(r"[+−×÷/=^<>≤≥≈·]| - |\bmod\b|\d\(")


def _isolate_formulas(prose: str) -> str:
    def wrap(span: str) -> str:
        if span.count("(") != span.count(")"):  # a parenthesis that opens or closes outside:
            inner = _unmatched(span)  # isolate the balanced pieces around it, e.g. "(2 + 2"
            if inner is not None:
                return "".join(
                    wrap(piece) if i % 2 == 0 else piece for i, piece in enumerate(inner)
                )
            return span
        if not OPERATOR.search(span):
            return span
        return f"{LRI}{span}{PDI}"

    return FORMULA.sub(lambda match: wrap(match[0]), prose)


def _unmatched(span: str) -> list[str] | None:
    """``span`` cut around its first unmatched parenthesis: [before, the parenthesis and the
    spaces beside it, after]; None when every parenthesis is matched."""
    opened: list[int] = []
    for i, char in enumerate(span):
        if char == "(":
            opened.append(i)
        elif char == ")":
            if not opened:
                return _cut(span, i)
            opened.pop()
    return _cut(span, opened[0]) if opened else None


def _cut(span: str, at: int) -> list[str]:
    before, after = span[:at], span[at + 1 :]
    left, right = before.rstrip(), after.lstrip()
    return [left, before[len(left) :] + span[at] + after[: len(after) - len(right)], right]


def left_to_right_spans(text: str) -> str:
    """``text`` (Markdown outside fenced blocks) with its code, inline math and formulas each in
    a left-to-right isolate; link targets, HTML tags and URLs untouched."""
    parts, start = [], 0
    for keep in KEEP.finditer(text):
        parts.append(_isolate_formulas(text[start : keep.start()]))
        parts.append(f"{LRI}{keep[0]}{PDI}" if keep["isolate"] else keep[0])
        start = keep.end()
    parts.append(_isolate_formulas(text[start:]))
    return "".join(parts)


def right_to_left(text: str) -> str:
    """``text`` wrapped to read right to left, with what must read left to right kept so: code,
    math and formulas in left-to-right isolates, each fenced block in a left-to-right div."""
    parts, start = [], 0
    for block in FENCE.finditer(text):
        parts.append(left_to_right_spans(text[start : block.start()]))
        parts.append(f'\n<div dir="ltr">\n\n{block[0]}\n\n</div>\n')  # blank lines around
        start = block.end()
    parts.append(left_to_right_spans(text[start:]))
    return OPEN + "".join(parts) + CLOSE


@dataclass(frozen=True)
class Term:
    arabic: str  # the glossary's one rendering (or renderings, for a row of several terms)
    english: tuple[str, ...]
    avoid: tuple[str, ...]  # renderings the glossary rules out


def glossary(readme: Path = ARABIC / "README.md") -> list[Term]:
    """The terms table of the Arabic edition's README: Arabic | English | not to be written."""
    text = readme.read_text(encoding="utf-8")
    table = text[text.index("| المصطلح |") :].split("\n\n")[0].splitlines()[2:]
    terms = []
    for row in table:
        arabic, english, avoid = (cell.strip() for cell in row.strip("|").split("|"))
        english = re.sub(r"\s*\([^)]*\)", "", english)  # "interconnect (link)": the term
        terms.append(
            Term(
                arabic,
                tuple(e.strip() for e in english.split(",")),
                tuple(a.strip() for a in avoid.split("،") if a.strip()),
            )
        )
    return terms


def prose(text: str) -> str:
    """``text`` without what is not prose: fenced blocks, code, math, link targets, tags, URLs."""
    return KEEP.sub(" ", FENCE.sub(" ", text))


def wording(text: str, terms: list[Term]) -> list[str]:
    """Where a translation departs from the glossary: a rendering it rules out, an English term
    in the prose outside parentheses (a gloss), or English words in LaTeX's \\text{}."""
    problems = []
    plain = prose(text)
    for term in terms:
        for variant in term.avoid:
            if variant in plain:
                problems.append(f"«{variant}»: the glossary writes «{term.arabic}»")
        for english in term.english:
            if english.isupper() or any(c.isdigit() for c in english):
                continue  # GPU, CPU: glossed once, then written as they are; "for 2 ranks"
            arabic = dict(zip(term.english, term.arabic.split("، "), strict=False))
            for found in re.finditer(rf"(?<![\w-]){re.escape(english)}(?![\w-])", plain, re.I):
                before = plain[: found.start()]
                if before.count("(") <= before.count(")"):  # not inside parentheses
                    rendering = arabic.get(english, term.arabic)
                    problems.append(
                        f"«{found[0]}» in English: write «{rendering}» ({english} in "
                        "parentheses at its first use)"
                    )
                    break
    for latex in re.finditer(r"\\text\{([^}]*)\}", text):
        if re.search(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}", latex[1]):
            problems.append(f"{latex[0]}: English inside a formula; write it in Arabic prose")
    return problems


# Two isolates joined by an operator or a subscript and no Arabic word: one formula in pieces
# (``t_c + ...`` written bare, where the build's isolates stop at "_", or ``$a$ / $b$``).
PIECES = re.compile(PDI + r"([^\u0600-\u06ff\n" + LRI + PDI + r"]*)" + LRI)
JOINS = re.compile(r"[_^+−×÷=<>≤≥≈·]| - |^\s*/\s*$")


def formula_in_pieces(text: str) -> list[str]:
    """A formula the build would show in pieces, each isolated alone, so that the bidi algorithm
    reorders the pieces in a right-to-left line. One ``$...$`` span keeps it whole, as in
    English."""
    shown = right_to_left(text)
    problems = []
    for join in PIECES.finditer(shown):
        left = shown.rfind(LRI, 0, join.start())
        right = shown.find(PDI, join.end())
        code = shown[left + 1 : left + 2] == "`" and shown[join.end() : join.end() + 1] == "`"
        if JOINS.search(join[1]) and not code:  # `save`/`load`: two names, no formula
            piece = shown[left + 1 : right].replace(LRI, "").replace(PDI, "")
            problems.append(f"«{piece}»: a formula in pieces; write it as one $...$ span")
    return problems


class Stale(ValueError):
    """A translation that no longer matches its English lesson."""


@dataclass
class Section:
    cell: int  # the English cell's index
    english: str | None  # the hash of the English text it translates; None: an Arabic-only cell
    text: str


def digest(source: str) -> str:
    return hashlib.sha256(source.strip().encode()).hexdigest()[:12]


def marker(cell: int, source: str) -> str:
    return f"<!-- cell {cell}, English {digest(source)} -->"


def parse(text: str) -> list[Section]:
    matches = list(MARKER.finditer(text))
    if not matches or text[: matches[0].start()].strip():
        raise ValueError("a translation file starts with a marker: <!-- cell N, English HASH -->")
    sections = []
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        body = text[match.end() : following.start() if following else len(text)].strip()
        if match[1] is not None:
            sections.append(Section(int(match[1]), match[2], body))
        else:
            sections.append(Section(int(match[3]), None, body))
    return sections


def translate(english, sections: list[Section], name: str):
    """The Arabic notebook: ``english``'s cells with each Markdown cell's translation in place.
    Raises ``Stale`` naming every mismatch."""
    problems, by_cell, terms = [], {}, glossary()
    for section in sections:
        if section.english is None:
            problems.append(
                f"after cell {section.cell}: a section only the Arabic edition has; the editions "
                "are equal in content: add it to the English lesson and translate it there"
            )
        elif section.cell in by_cell:
            problems.append(f"cell {section.cell} is translated twice")
        else:
            by_cell[section.cell] = section
    cells = []
    for index, cell in enumerate(english.cells):
        if cell.cell_type == "markdown":
            section = by_cell.pop(index, None)
            if section is None:
                problems.append(
                    f"cell {index} has no translation: add {marker(index, cell.source)}"
                )
            elif section.english != digest(cell.source):
                problems.append(
                    f"cell {index} changed in English since it was translated: update the "
                    f"translation, then its marker to {marker(index, cell.source)}"
                )
            elif not section.text:
                problems.append(f"cell {index}: the translation is empty")
            elif exercises.tagged(cell, exercises.SOLUTION) and exercises.FENCE.findall(
                section.text
            ) != exercises.FENCE.findall(cell.source):
                problems.append(
                    f"cell {index}: a solution's code must be the English one, byte for byte "
                    "(translate the words around its ```python fence only)"
                )
            elif wrong := wording(section.text, terms) + formula_in_pieces(section.text):
                problems += [f"cell {index}: {w}" for w in wrong]
            else:
                cell = copy.deepcopy(cell)
                cell.source = right_to_left(section.text)
                cell.pop("id", None)  # a fresh id: two cells in one notebook must differ
        else:
            cell = copy.deepcopy(cell)
        cells.append(cell)
    problems += [f"cell {i} is not a Markdown cell of the English lesson" for i in by_cell]
    if problems:
        raise Stale(f"{name}: " + "; ".join(problems))
    arabic = copy.deepcopy(english)
    arabic.cells = cells
    for cell in arabic.cells:
        if "id" not in cell:
            cell.id = hashlib.sha1(f"ar/{name}/{cell.source}".encode()).hexdigest()[:8]
    return arabic


def build(lesson: Path, folder: Path = ARABIC) -> Path:
    """Write ``folder/<lesson>.ipynb`` from the English lesson and its translation."""
    import nbformat

    english = nbformat.read(lesson, as_version=4)
    text = (folder / "text" / f"{lesson.stem}.md").read_text(encoding="utf-8")
    arabic = translate(english, parse(text), lesson.name)
    clean(arabic)
    dest = folder / lesson.name
    partial = dest.with_name(f".{dest.name}.partial")  # a failed write leaves the old one whole
    nbformat.write(arabic, partial)
    os.replace(partial, dest)
    return dest


def translated(folder: Path = ARABIC) -> list[Path]:
    """The English lessons that have a translation file."""
    return [p for p in lessons() if (folder / "text" / f"{p.stem}.md").exists()]


def skeleton(lesson: Path) -> str:
    """A translation file to fill in: each English Markdown cell under its marker."""
    import nbformat

    english = nbformat.read(lesson, as_version=4)
    return (
        "\n\n".join(
            f"{marker(i, cell.source)}\n{cell.source.strip()}"
            for i, cell in enumerate(english.cells)
            if cell.cell_type == "markdown"
        )
        + "\n"
    )


def renumber(lesson: Path, folder: Path = ARABIC) -> list[str]:
    """Move each marker to where its English cell now is, after cells were added or removed
    above it: a section follows the one English Markdown cell whose text has its hash, and an
    Arabic-only section, or one whose English text changed, moves with the section before it
    (and stays stale, for ``check`` to name). Rewrites the translation file; returns what
    moved."""
    import nbformat

    english = nbformat.read(lesson, as_version=4)
    where: dict[str, list[int]] = {}
    for index, cell in enumerate(english.cells):
        if cell.cell_type == "markdown":
            where.setdefault(digest(cell.source), []).append(index)
    path = folder / "text" / f"{lesson.stem}.md"
    text = path.read_text(encoding="utf-8")
    moved, shift, out, last = [], 0, [], 0
    for match in MARKER.finditer(text):
        out.append(text[last : match.start()])
        last = match.end()
        if match[1] is not None:
            old, found = int(match[1]), where.get(match[2], [])
            new = found[0] if len(found) == 1 else old + shift  # changed: moves with the rest
            shift = new - old
            out.append(f"<!-- cell {new}, English {match[2]} -->")
        else:
            old = int(match[3])
            new = old + shift
            out.append(f"<!-- after cell {new} -->")
        if new != old:
            moved.append(f"cell {old} -> {new}")
    out.append(text[last:])
    if moved:
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text("".join(out), encoding="utf-8")
        os.replace(partial, path)
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lessonbuild.edition")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, says in (
        ("build", "write notebooks/ar/ from the English lessons and text/"),
        ("check", "list translations missing or out of date"),
    ):
        command = sub.add_parser(name, help=says)
        command.add_argument("lessons", nargs="*", help="e.g. 04_accelerate (default: all)")
    make = sub.add_parser("skeleton", help="print a translation file to fill in")
    make.add_argument("lesson", help="e.g. 04_accelerate")
    move = sub.add_parser("renumber", help="move markers to where their English cells now are")
    move.add_argument("lesson", help="e.g. 04_accelerate")
    args = parser.parse_args(argv)
    if args.command == "renumber":
        lesson = NOTEBOOKS / f"{Path(args.lesson).stem}.ipynb"
        print("\n".join(renumber(lesson)) or f"{lesson.name}: nothing moved")
        return 0
    if args.command == "skeleton":
        print(skeleton(NOTEBOOKS / f"{Path(args.lesson).stem}.ipynb"), end="")
        return 0
    failed = 0
    chosen = {Path(name).stem for name in args.lessons}
    for lesson in [p for p in lessons() if not chosen or p.stem in chosen]:
        if not (TEXT / f"{lesson.stem}.md").exists():
            print(f"{lesson.name}: no translation (text/{lesson.stem}.md)")
            failed += args.command == "check"
            continue
        try:
            if args.command == "build":
                print(f"wrote {build(lesson)}")
            else:
                import nbformat

                english = nbformat.read(lesson, as_version=4)
                translate(english, parse((TEXT / f"{lesson.stem}.md").read_text()), lesson.name)
                print(f"{lesson.name}: up to date")
        except Stale as error:
            print(error, file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
