"""The Arabic edition of the lessons: English code plus translated Markdown, never a second copy
of the code.

Each lesson's Arabic Markdown lives in ``notebooks/ar/text/<lesson>.md``, one section per English
Markdown cell, each opened by a marker that names the English cell and a hash of its text::

    <!-- cell 4, English 1a2b3c4d5e6f -->
    ## 2. الحلقة الكاملة
    ...
    <!-- after cell 11 -->
    (a cell only the Arabic edition has, placed after English cell 11)

``build`` makes ``notebooks/ar/<lesson>.ipynb`` from the English notebook: code cells copied as
they are (source, metadata, outputs), Markdown cells replaced by their translation wrapped in
``<div dir="rtl">``, with code inside it kept left to right. When an English Markdown cell
changes, its hash no longer matches and the build stops, naming the cell, so a change to a
lesson reaches both editions.

    python -m nbaccel.lessons.edition build            # every lesson with a translation
    python -m nbaccel.lessons.edition check            # what is missing or out of date
    python -m nbaccel.lessons.edition skeleton LESSON  # a translation file to fill in
    python -m nbaccel.lessons.edition renumber LESSON  # markers follow cells added above
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

from .runner import NOTEBOOKS, clean, lessons

ARABIC = NOTEBOOKS / "ar"
TEXT = ARABIC / "text"
MARKER = re.compile(r"^<!-- (?:cell (\d+), English ([0-9a-f]{12})|after cell (\d+)) -->$", re.M)
OPEN, CLOSE = '<div dir="rtl">\n\n', "\n\n</div>"  # blank lines: Markdown inside the div


FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LRI, PDI = "\u2066", "\u2069"  # Unicode's left-to-right isolate, and its end


def right_to_left(text: str) -> str:
    """``text`` wrapped to read right to left, its code kept left to right: each inline code
    span in a left-to-right isolate (else ``f()`` shows as ``()f``), each fenced block in a
    left-to-right div."""
    parts, start = [], 0
    for block in FENCE.finditer(text):
        parts.append(INLINE_CODE.sub(rf"{LRI}\g<0>{PDI}", text[start : block.start()]))
        parts.append(f'\n<div dir="ltr">\n\n{block[0]}\n\n</div>\n')  # blank lines around
        start = block.end()
    parts.append(INLINE_CODE.sub(rf"{LRI}\g<0>{PDI}", text[start:]))
    return OPEN + "".join(parts) + CLOSE


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
    """The Arabic notebook: ``english``'s cells with each Markdown cell's translation in place
    and the Arabic-only cells after theirs. Raises ``Stale`` naming every mismatch."""
    import nbformat

    problems, by_cell, extra = [], {}, {}
    for section in sections:
        if section.english is None:
            extra.setdefault(section.cell, []).append(section.text)
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
            else:
                cell = copy.deepcopy(cell)
                cell.source = right_to_left(section.text)
                cell.pop("id", None)  # a fresh id: two cells in one notebook must differ
        else:
            cell = copy.deepcopy(cell)
        cells.append(cell)
        for text in extra.pop(index, []):
            cells.append(nbformat.v4.new_markdown_cell(right_to_left(text)))
            cells[-1].pop("id")  # nbformat's is random: the one below is the same every build
    problems += [f"cell {i} is not a Markdown cell of the English lesson" for i in by_cell]
    problems += [f"'after cell {i}': the English lesson has no cell {i}" for i in extra]
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
    Arabic-only section moves with the section before it. Rewrites the translation file and
    returns what moved; a section whose text changed in English stays stale, for ``check``."""
    import nbformat

    english = nbformat.read(lesson, as_version=4)
    where: dict[str, list[int]] = {}
    for index, cell in enumerate(english.cells):
        if cell.cell_type == "markdown":
            where.setdefault(digest(cell.source), []).append(index)
    path = folder / "text" / f"{lesson.stem}.md"
    text = path.read_text(encoding="utf-8")
    moved, shift, out, last = [], 0, [], 0
    for match, following in zip(
        matches := list(MARKER.finditer(text)), [*matches[1:], None], strict=False
    ):
        out.append(text[last : match.start()])
        last = match.end()
        if match[1] is not None:
            old, found = int(match[1]), where.get(match[2], [])
            new = found[0] if len(found) == 1 else old
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
    parser = argparse.ArgumentParser(prog="python -m nbaccel.lessons.edition")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="write notebooks/ar/ from the English lessons and text/")
    sub.add_parser("check", help="list translations missing or out of date")
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
    for lesson in lessons():
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
