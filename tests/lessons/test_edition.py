"""The Arabic edition (notebooks/ar/): the same code as the English lessons, Markdown translated,
right to left, and up to date with the English text. lessonbuild.edition builds it."""

from __future__ import annotations

import re

import nbformat
import pytest

from lessonbuild import edition, runner

LESSONS = runner.lessons()
GLOSSARY = {  # the course's own terms (issues 8, 33), each listed in notebooks/ar/README.md
    "التدريب غير المعتمد على الجهاز": "device-agnostic training",
    "تراكم التدرجات": "gradient accumulation",
    "الدقة المختلطة": "mixed precision",
    "تحجيم التدرجات": "gradient scaling",
    "محمّل البيانات": "data loader",
    "المُحسّن": "optimizer",
    "الانتشار العكسي": "backpropagation",
    "أخذ العينات الموزع": "distributed sampling",
    "نقطة التحقق": "checkpoint",
    "عدة عقد": "multiple nodes",
    "تغليف DDP": "DDP wrapping",
    "التكامل مع DeepSpeed": "DeepSpeed integration",
}
# Every term the course's Accelerate lesson uses (its own spelling), which the edition must
# use too: where the glossary prefers another word, ours stands beside the course's.
COURSE = [
    "التدريب غير المعتمد على الجهاز",
    "تراكم التدرجات",
    "الدقة المختلطة",
    "التدريب بالدقة المختلطة",
    "تحجيم التدرجات",
    "محمّل البيانات",
    "محمّل البيانات المُجهّز",
    "المُحسّن",
    "الانتشار العكسي الموزّع والمختلط الدقة",
    "نقل الجهاز",
    "تغليف DDP",
    "أخذ العينات الموزع",
    "التعليمات المتكررة",
    "العمليات",
    "وحدة GPU واحدة",
    "عدة وحدات GPU",
    "وحدة المعالجة المركزية في حاسوبكم",
    "دفعات",
    "إطلاق التشغيل عبر أجهزة متعددة",
    "التكامل مع DeepSpeed",
]
ARABIC_LETTER = re.compile(r"[\u0600-\u06FF]")


def read(path):
    return nbformat.read(path, as_version=4)


def code(notebook) -> list[tuple[str, dict]]:
    return [(c.source, c.metadata) for c in notebook.cells if c.cell_type == "code"]


@pytest.mark.parametrize("english", LESSONS, ids=lambda p: p.stem)
def test_every_code_cell_is_the_english_one(english):
    arabic = edition.ARABIC / english.name
    assert arabic.exists(), f"no Arabic edition of {english.name}: run make lessons"
    assert code(read(arabic)) == code(read(english)), (
        f"{arabic} has code that differs from {english}: change the English lesson and run "
        "`make lessons`, which rebuilds the Arabic one from it"
    )


@pytest.mark.parametrize("english", LESSONS, ids=lambda p: p.stem)
def test_the_arabic_text_is_up_to_date_and_right_to_left(english):
    text = (edition.TEXT / f"{english.stem}.md").read_text(encoding="utf-8")
    built = edition.translate(read(english), edition.parse(text), english.name)  # or Stale
    committed = read(edition.ARABIC / english.name)
    markdown = [c.source for c in committed.cells if c.cell_type == "markdown"]
    assert markdown == [c.source for c in built.cells if c.cell_type == "markdown"], (
        "the committed Arabic notebook's Markdown is not its translation file's: run make lessons"
    )
    # the same cell ids, build after build: a rebuild changes nothing that did not change
    assert [c.id for c in committed.cells] == [c.id for c in built.cells]
    for source in markdown:
        assert source.startswith('<div dir="rtl">') and source.endswith("</div>")
        assert ARABIC_LETTER.search(source), f"not translated: {source[:200]}"
    nbformat.validate(committed)


def test_a_changed_english_cell_stops_the_build_and_names_the_cell():
    english = read(runner.NOTEBOOKS / runner.FLAGSHIP)
    sections = edition.parse((edition.TEXT / "04_accelerate.md").read_text(encoding="utf-8"))
    edition.translate(english, sections, "04")  # as committed: no error
    index = next(i for i, c in enumerate(english.cells) if c.cell_type == "markdown" and i > 0)
    english.cells[index].source += "\nA sentence added in English."
    with pytest.raises(edition.Stale, match=rf"cell {index} changed in English"):
        edition.translate(english, sections, "04")
    english.cells.insert(1, nbformat.v4.new_markdown_cell("A new English cell."))
    with pytest.raises(edition.Stale, match="cell 1 has no translation"):
        edition.translate(english, sections, "04")


def test_code_changes_reach_the_arabic_edition_through_the_build(tmp_path):
    english = read(runner.NOTEBOOKS / runner.FLAGSHIP)
    english.cells[1].source += "\nEPOCHS += 1  # a change to the English code"
    (tmp_path / runner.FLAGSHIP).write_text(nbformat.writes(english))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "04_accelerate.md").write_bytes(
        (edition.TEXT / "04_accelerate.md").read_bytes()
    )
    built = edition.build(tmp_path / runner.FLAGSHIP, folder=tmp_path)
    assert built.parent == tmp_path and code(read(built)) == code(english)
    assert read(built).cells[1].source.endswith("EPOCHS += 1  # a change to the English code")


def test_code_inside_arabic_text_stays_left_to_right():
    """In a right-to-left paragraph the bidi algorithm would show `f()` as `()f`: inline code
    goes in a left-to-right isolate, fenced blocks in a left-to-right div."""
    text = "استدعِ `loss.backward()` ثم:\n\n```bash\nmake lessons  # `x`\n```\nانتهى."
    html = edition.right_to_left(text)
    assert html.startswith('<div dir="rtl">\n\n') and html.endswith("\n\n</div>")
    assert f"{edition.LRI}`loss.backward()`{edition.PDI}" in html
    assert '\n<div dir="ltr">\n\n```bash\nmake lessons  # `x`\n```\n\n</div>\n\n' in html
    assert html.count(edition.LRI) == 1  # nothing inside the fenced block is touched


def shown(html: str) -> str:
    return html.replace(edition.LRI, "⟨").replace(edition.PDI, "⟩")


@pytest.mark.parametrize(
    ("text", "isolated"),
    [
        ("يرسل كل رتبة 2(N−1)/N × S بايت.", "⟨2(N−1)/N × S⟩"),  # else "N × S/(N−1)2"
        ("تنتقل القطعة (r−s) mod N.", "⟨(r−s) mod N⟩"),  # else "mod N (r−s)"
        ("لكل عملية (2 + 2 + 12) / N من Ψ.", "⟨(2 + 2 + 12) / N⟩"),  # else its inverse
        ("أي 2Ψ + 2Ψ + 12Ψ بايت", "⟨2Ψ + 2Ψ + 12Ψ⟩"),
        ("**4 × 8 = 32** عينة", "**⟨4 × 8 = 32⟩**"),  # inside emphasis, which still parses
        ("المعادلة $2\\Psi + 12\\Psi$ هنا", "⟨$2\\Psi + 12\\Psi$⟩"),
    ],
)
def test_formulas_in_arabic_prose_stay_left_to_right(text, isolated):
    """The bidi algorithm reorders a formula's parts inside a right-to-left paragraph; the
    build puts each formula, and inline math, in a left-to-right isolate."""
    assert isolated in shown(edition.right_to_left(text))


def test_isolating_formulas_leaves_markdown_and_plain_words_alone():
    text = "راجع [التوثيق](https://pytorch.org/docs/a/b.html) و<b>ZeRO-3</b> و(GPU) و0.5 و N-1."
    assert edition.right_to_left(text) == f"{edition.OPEN}{text}{edition.CLOSE}"
    twice = edition.right_to_left("2(N−1)/N × S و `f(x)`")
    assert edition.left_to_right_spans(twice) == twice  # an isolate is never isolated again


@pytest.mark.parametrize("english", LESSONS, ids=lambda p: p.stem)
def test_no_formula_in_a_committed_arabic_lesson_is_left_to_the_bidi_algorithm(english):
    for cell in read(edition.ARABIC / english.name).cells:
        if cell.cell_type == "markdown":
            bare = edition.prose(cell.source)  # what is outside code, math and isolates
            assert edition._isolate_formulas(bare) == bare, cell.source[:300]


def test_the_build_refuses_a_rendering_the_glossary_rules_out():
    terms = edition.glossary()
    assert edition.wording("الكمون (latency) هنا، ثم الكمون", terms) == []
    assert edition.wording("استدعِ `tensor.to()` على الموتر", terms) == []  # code is not prose
    (problem,) = edition.wording("زمن انتظار الرابط", terms)
    assert "«زمن انتظار»" in problem and "«الكمون»" in problem
    (problem,) = edition.wording("نجمع الـ gradient accumulation هنا", terms)
    assert "«تراكم التدرجات»" in problem and "in parentheses" in problem
    (problem,) = edition.wording("$\\text{mean loss over all}$", terms)
    assert "English inside a formula" in problem
    english = read(runner.NOTEBOOKS / runner.FLAGSHIP)
    sections = edition.parse((edition.TEXT / "04_accelerate.md").read_text(encoding="utf-8"))
    sections[1].text += "\nوهذه دفعة صغيرة."
    with pytest.raises(edition.Stale, match=rf"cell {sections[1].cell}: «دفعة صغيرة»"):
        edition.translate(english, sections, "04")


def test_renumber_moves_each_marker_to_where_its_cell_went(tmp_path):
    english = read(runner.NOTEBOOKS / runner.FLAGSHIP)
    english.cells[1:1] = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("y")]
    (tmp_path / runner.FLAGSHIP).write_text(nbformat.writes(english))
    (tmp_path / "text").mkdir()
    text = (edition.TEXT / "04_accelerate.md").read_text(encoding="utf-8")
    (tmp_path / "text" / "04_accelerate.md").write_text(text, encoding="utf-8")
    with pytest.raises(edition.Stale, match="cell 2 is not a Markdown cell"):
        edition.translate(english, edition.parse(text), "04")
    index = next(i for i, c in enumerate(english.cells) if c.cell_type == "markdown" and i > 4)
    english.cells[index].source += " A sentence added."  # this one's text changed too
    (tmp_path / runner.FLAGSHIP).write_text(nbformat.writes(english))
    moved = edition.renumber(tmp_path / runner.FLAGSHIP, folder=tmp_path)
    assert "cell 2 -> 4" in moved and f"cell {index - 2} -> {index}" in moved
    assert "cell 0 -> 0" not in moved
    renumbered = (tmp_path / "text" / "04_accelerate.md").read_text(encoding="utf-8")
    with pytest.raises(edition.Stale) as stale:
        edition.translate(english, edition.parse(renumbered), "04")
    assert str(stale.value).startswith(f"04: cell {index} changed in English")
    assert str(stale.value).count("cell") == 2  # it alone, and its new marker
    assert edition.renumber(tmp_path / runner.FLAGSHIP, folder=tmp_path) == []


def test_a_malformed_translation_file_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="starts with a marker"):
        edition.parse("some text before any marker\n<!-- cell 0, English 000000000000 -->\nx")


def test_the_glossary_lists_the_course_terms_with_their_english():
    readme = (edition.ARABIC / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("|")]
    for arabic, english in GLOSSARY.items():
        assert any(arabic in row and english in row for row in rows), (arabic, english)


def test_the_glossary_never_rules_out_a_word_of_the_course():
    """Where we prefer another word we write it beside the course's, never instead of it."""
    ruled_out = [variant for term in edition.glossary() for variant in term.avoid]
    words = [*GLOSSARY, *COURSE, "الكود"]
    assert not [(w, v) for w in words for v in ruled_out if v in w]  # the word would trip it
    assert edition.wording("التدريب غير المعتمد على الجهاز (المستقل عنه)", edition.glossary()) == []


def test_every_term_of_the_course_appears_in_the_arabic_edition():
    shown = "\n".join(
        cell.source.replace(edition.LRI, "").replace(edition.PDI, "")
        for english in LESSONS
        for cell in read(edition.ARABIC / english.name).cells
        if cell.cell_type == "markdown"
    )
    missing = [term for term in COURSE if term not in shown]
    assert not missing, f"the course's terms the Arabic lessons never use: {missing}"


@pytest.mark.parametrize(
    "written, isolated",
    [  # formulas that open or close a parenthesis outside themselves (issue 60's four)
        ("الرتبة r−1 (mod N، أي", "الرتبة ⁦r−1⁩ (⁦mod N⁩، أي"),
        ("بـ 16 بت (2 + 2 بايت)، و", "بـ 16 بت (⁦2 + 2⁩ بايت)، و"),
        ("المُحسّن (KΨ / N لكل عملية)", "المُحسّن (⁦KΨ / N⁩ لكل عملية)"),
        ("مختلطة، K = 12) والصيغة", "مختلطة، ⁦K = 12⁩) والصيغة"),
    ],
)
def test_a_formula_beside_an_unmatched_parenthesis_is_isolated_too(written, isolated):
    assert edition._isolate_formulas(written) == isolated


def test_one_word_one_meaning_for_the_terms_that_clashed():
    terms = edition.glossary()
    (problem,) = edition.wording("أعد تشغيل نواة Jupyter", terms)
    assert "«مُفسِّر الدفتر»" in problem
    (problem,) = edition.wording("يضاعف معامل التحجيم", terms)
    assert "«عامل التحجيم»" in problem
    (problem,) = edition.wording("تبدأ العمال الآن", terms)
    assert "العمليات العاملة»" in problem
    assert edition.wording("الكود هنا، والأعمال والاستعمال", terms) == []
    (problem,) = edition.wording("في جولة التدريب الثانية", terms)
    assert "«التشغيل، الجولة»" in problem


@pytest.mark.parametrize(
    "text",
    ["الزمن t(N) = t_c + 2(N−1)/N × S/b هنا", "الزمن $t$_c + $x$ هنا", "النسبة $a$ / $b$ هنا"],
)
def test_the_build_refuses_a_formula_in_pieces(text):
    """Each piece isolated alone, the pieces reorder right to left (lesson 5's central formula
    did: "_c + " fell between two isolates). One $...$ span, as in English, is whole."""
    (problem,) = edition.formula_in_pieces(text)
    assert "one $...$ span" in problem
    assert edition.formula_in_pieces("الزمن $t(N) = t_c + 2(N-1)/N$ هنا") == []
    assert edition.formula_in_pieces("`save_state`/`load_state` هنا") == []  # two names


def test_the_build_refuses_a_section_only_the_arabic_edition_has():
    english = read(runner.NOTEBOOKS / runner.FLAGSHIP)
    text = (edition.TEXT / "04_accelerate.md").read_text(encoding="utf-8")
    with pytest.raises(edition.Stale, match="after cell 3: a section only the Arabic edition has"):
        edition.translate(english, edition.parse(text + "\n<!-- after cell 3 -->\nنص إضافي"), "04")


@pytest.mark.parametrize("english", LESSONS, ids=lambda p: p.stem)
def test_no_arabic_reaches_a_plot(english):
    """matplotlib neither joins Arabic letters nor lays them right to left, so an Arabic label
    would come out as broken glyphs. Plots stay English in both editions: the Arabic one runs
    the English code, and neither the code nor the live panel holds an Arabic letter."""
    for source, _ in code(read(edition.ARABIC / english.name)):
        assert not ARABIC_LETTER.search(source), source[:200]


def test_the_live_panel_has_no_arabic_text():
    from nbaccel.observe.channel import Record
    from nbaccel.observe.live.panel import Panel
    from nbaccel.observe.records import Run

    run = Run(world_size=2)
    run.add([Record(rank, 0, 0.0, "loss", 1.0) for rank in (0, 1)])
    panel = Panel()
    panel.png(run)  # updated and drawn: the legend and tick labels exist
    texts = [t.get_text() for t in panel.fig.findobj(lambda a: hasattr(a, "get_text"))]
    assert "loss" in texts and any(text.startswith("throughput") for text in texts)
    assert not any(ARABIC_LETTER.search(text) for text in texts)


def test_make_lessons_rebuilds_the_arabic_edition_of_the_lessons_it_ran(monkeypatch, tmp_path):
    from nbaccel.lessons import machine

    ran, saved, built = [], [], []

    def execute(
        path, write=True, core=None
    ):  # no kernels: a notebook whose first output is the machine
        ran.append(path)
        cell = nbformat.v4.new_code_cell("print(machine())")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{machine()}\n")]
        return nbformat.v4.new_notebook(cells=[cell])

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "save", lambda notebook, path: saved.append(path))
    monkeypatch.setattr(edition, "build", lambda path: built.append(path) or path)
    other = (tmp_path / "not_a_lesson.ipynb").resolve()
    flagship = (runner.NOTEBOOKS / runner.FLAGSHIP).resolve()
    assert runner.main(["lessons", "--no-load-check", str(flagship), str(other)]) == 0
    assert ran == saved == [flagship, other] and built == [flagship]
    built.clear()
    arabic = str(edition.ARABIC / runner.FLAGSHIP)
    assert runner.main(["lessons", "--no-load-check", arabic]) == 0
    assert built == []  # an Arabic notebook run by name keeps its own outputs


@pytest.mark.parametrize("english", LESSONS, ids=lambda p: p.stem)
def test_a_solutions_code_is_the_english_one(english):
    """A solution lives in Markdown (lessonbuild.exercises): its translation changes the words
    around the code, never the code the exercise test runs."""
    from lessonbuild import exercises

    source, arabic = read(english), read(edition.ARABIC / english.name)
    for mine, theirs in zip(source.cells, arabic.cells, strict=True):
        if mine.cell_type == "markdown" and exercises.tagged(mine, exercises.SOLUTION):
            shown = theirs.source.replace(edition.LRI, "").replace(edition.PDI, "")
            assert exercises.FENCE.findall(shown) == exercises.FENCE.findall(mine.source), (
                f"{english.name}: the Arabic solution's code differs from the English:\n{shown}"
            )


def test_the_build_refuses_a_translated_solution_whose_code_differs():
    from lessonbuild import exercises

    english = next(
        read(lesson)
        for lesson in LESSONS
        if any(exercises.tagged(c, exercises.SOLUTION) for c in read(lesson).cells)
    )
    index = next(i for i, c in enumerate(english.cells) if exercises.tagged(c, exercises.SOLUTION))
    source = english.cells[index].source
    changed = source.replace("```python\n", "```python\nx = 0  # not the English code\n", 1)
    with pytest.raises(edition.Stale, match=rf"cell {index}: a solution's code must be"):
        edition.translate(english, [edition.Section(index, edition.digest(source), changed)], "x")
