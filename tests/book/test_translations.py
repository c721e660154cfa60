"""Translations: every chapter in every language, the same code, the glossary's terms, fresh.

Each check is shown to fail on a broken input in the `*_catches_*` tests below.
"""

import copy
import pathlib
import re
import shutil
import string
import subprocess
import sys
import xml.dom.minidom

import markdown_it
import nbformat
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
import headers  # noqa: E402
import translations  # noqa: E402
from distcourse.runtime import i18n, languages  # noqa: E402

ENGLISH = translations.english_chapters(ROOT)
PAIRS = [(en, lang) for lang in translations.TRANSLATED for en in ENGLISH]
PAIR_IDS = [f"{lang}-{en.stem[:2]}" for en, lang in PAIRS]


def test_there_are_thirteen_english_chapters_and_five_languages():
    assert len({p.name[:2] for p in ENGLISH}) == 13  # a chapter may come in parts: 04-ddp, 04-ddp-in-practice
    assert translations.TRANSLATED == ["ru", "zh-CN", "zh-TW", "pt-BR", "ko"]


@pytest.mark.parametrize("english, lang", PAIRS, ids=PAIR_IDS)
def test_chapter_is_translated(english, lang):
    path = translations.translation_of(english, lang)
    assert path.exists(), f"missing translation: {path.relative_to(ROOT)}"
    meta = translations.recorded(translations.read(path))
    assert meta.get("language") == lang and meta.get("english") == f"chapters/en/{english.name}"
    assert re.fullmatch(r"[0-9a-f]{12}", meta.get("english_prose", "")), "no English revision recorded"
    assert meta.get("english_cells"), "no per-cell English fingerprints recorded (tools/translations.py mark-current)"


@pytest.mark.parametrize("english, lang", PAIRS, ids=PAIR_IDS)
def test_code_is_the_english_code(english, lang):
    translated = translations.read(translations.translation_of(english, lang))
    problems = translations.code_differences(translations.read(english), translated)
    assert not problems, f"{english.stem} [{lang}]:\n" + "\n".join(problems)


@pytest.mark.parametrize("english, lang", PAIRS, ids=PAIR_IDS)
def test_prose_is_translated(english, lang):
    en, tr = translations.read(english), translations.read(translations.translation_of(english, lang))
    untranslated = [
        i
        for i, (a, b) in enumerate(zip(en.cells, tr.cells))
        if a.cell_type == "markdown" and i > 0 and len(a.source) > 80 and a.source == b.source
    ]
    assert not untranslated, f"{english.stem} [{lang}]: markdown cells still in English: {untranslated}"


@pytest.mark.parametrize("english, lang", PAIRS, ids=PAIR_IDS)
def test_glossary_terms_are_used(english, lang):
    missing = translations.missing_terms(
        translations.read(english), translations.read(translations.translation_of(english, lang)), lang
    )
    assert not missing, f"{english.stem} [{lang}] never writes the glossary term for: " + "; ".join(missing)


def test_glossary_has_every_language():
    for term in translations.glossary():
        assert set(translations.TRANSLATED) <= set(term), term["en"]


def test_parity_check_catches_changed_code_not_comments():
    english = translations.read(ENGLISH[0])
    tr = translations.read(translations.translation_of(ENGLISH[0], "ru"))
    i = next(i for i, c in enumerate(tr.cells) if i > 1 and c.cell_type == "code" and "#" in c.source)
    comment_only = copy.deepcopy(tr)
    comment_only.cells[i].source = comment_only.cells[i].source.replace("#", "# другой комментарий:", 1)
    assert translations.code_differences(english, comment_only) == []
    broken = copy.deepcopy(tr)
    broken.cells[i].source += "\nx = 1"
    assert translations.code_differences(english, broken) == [
        f"cell {i} (id {english.cells[i].id}): code differs from English (run python tools/translations.py sync)"
    ]
    swapped = copy.deepcopy(tr)
    swapped.cells[2], swapped.cells[3] = swapped.cells[3], swapped.cells[2]
    assert "cells differ from the English ones" in translations.code_differences(english, swapped)[0]


def test_glossary_check_catches_a_missing_term():
    english = translations.read(ENGLISH[0])
    untranslated = copy.deepcopy(english)  # an "translation" that is still English
    missing = translations.missing_terms(english, untranslated, "ru")
    assert "'distributed training' -> 'распределённое обучение'" in missing
    # inflected forms count: "распределённого обучения" matches the term
    term = [t for t in translations.glossary() if t["en"][0] == "distributed training"]
    inflected = copy.deepcopy(english)
    inflected.cells[2].source = "Основы распределённого обучения."
    assert translations.missing_terms(english, inflected, "ru", term) == []
    assert translations.missing_terms(english, untranslated, "zh-TW", term) == [
        "'distributed training' -> '分散式訓練'"
    ]


# ---------------------------------------------------------------- identifiers in translated prose

CODE_LIKE = re.compile(r"[._()\[\]=]")  # `dist.send`, `set_epoch`, `f(x)`, `mesh["dp"]`, `timeout=`
PLACEHOLDER = re.compile(r"<[^<>]*>")  # `process_group=<its column>`: the words inside are translated
LINE_REFERENCE = re.compile(r":\d+(?:-\d+)?$")  # pt-BR cites source lines as `stage.py:844-847`
SETTING = re.compile(r"([A-Za-z_][\w.]*)(=[^\s=]+)")  # `NCCL_SOCKET_IFNAME=eth0` where English says "both `=eth0`"


def code_spans(markdown: str) -> list[str]:
    """The inline code of a markdown cell as the page shows it: a line break inside a span is a space."""
    tokens = markdown_it.MarkdownIt("commonmark").parse(markdown)
    inline = [child for token in tokens if token.type == "inline" for child in token.children or []]
    return [child.content for child in inline if child.type == "code_inline"]


def written_in(span: str, english: str) -> bool:
    """Whether ``english`` (whitespace collapsed) writes the code of ``span``: verbatim, with any text in
    a ``<placeholder>``, without a trailing line reference, or a setting ``NAME=value`` in its two parts."""
    span = LINE_REFERENCE.sub("", " ".join(span.split()))
    pattern = PLACEHOLDER.pattern.join(re.escape(part) for part in PLACEHOLDER.split(span))
    if re.search(pattern, english):
        return True
    setting = SETTING.fullmatch(span)
    return bool(setting) and all(part in english for part in setting.groups())


def stale_identifiers(english: nbformat.NotebookNode, translated: nbformat.NotebookNode) -> list[str]:
    """Each code span of a translated markdown cell that its English cell (the same cell id) does not write.

    A span counts when it looks like code (one of ``._()[]=``). A translation may name an identifier
    that the English cell leaves implicit ("the tour ran all of these": `collectives.tour` ran ...), so
    a span the English notebook writes in another cell is accepted too: what fails is code the English
    chapter does not contain at all, as when a function is renamed and a translation keeps the old name.
    """
    cells = {cell.get("id"): " ".join(cell.source.split()) for cell in english.cells}
    whole = "\n".join(cells.values())
    stale = []
    for i, cell in enumerate(translated.cells):
        if cell.cell_type != "markdown":
            continue
        for span in code_spans(cell.source):
            if CODE_LIKE.search(span) and not written_in(span, cells.get(cell.get("id"), "")):
                if not written_in(span, whole):
                    stale.append(f"cell {i} (id {cell.get('id')}): `{span}`")
    return stale


@pytest.mark.parametrize("english, lang", PAIRS, ids=PAIR_IDS)
def test_identifiers_in_translated_prose_are_the_english_ones(english, lang):
    translated = translations.read(translations.translation_of(english, lang))
    stale = stale_identifiers(translations.read(english), translated)
    assert not stale, f"{english.stem} [{lang}]: code the English chapter does not write:\n" + "\n".join(stale)


def test_identifier_check_catches_a_stale_name():
    english = translations.read(ENGLISH[0])
    i = next(i for i, c in enumerate(english.cells) if c.cell_type == "markdown" and "`" in c.source and i > 1)
    span = code_spans(english.cells[i].source)[0]
    translated = copy.deepcopy(english)
    translated.cells[i].source += "\n\n`distcourse.renamed_helper(x)` и `" + span + "`"
    assert stale_identifiers(english, translated) == [
        f"cell {i} (id {english.cells[i].id}): `distcourse.renamed_helper(x)`"
    ]
    # a translated placeholder, a line reference, a span broken over two lines, a setting written whole
    translated.cells[i].source = "`f(group=<своя строка>)` `module.py:10-12` `a.b\nc` `NCCL_X=eth0`"
    english.cells[i].source = "`f(group=<its row>)` in `module.py` and `a.b c`; set `NCCL_X` (both `=eth0`)"
    assert stale_identifiers(english, translated) == []


@pytest.mark.parametrize("lang", translations.TRANSLATED)
def test_figure_text_catalog_is_complete(lang):
    catalog = i18n.catalog(lang)
    needed = translations.figure_texts(ROOT)
    missing = sorted(set(needed) - set(catalog))
    assert not missing, f"code/distcourse/locale/{lang}.yml lacks: {missing}"
    stale = sorted(set(catalog) - set(needed))
    assert not stale, f"code/distcourse/locale/{lang}.yml has entries no chapter uses: {stale}"
    for english, translated in catalog.items():
        assert translated.strip(), f"{lang}: empty translation of {english!r}"
        # The same placeholder names; a translation may format a value its own way ({n} for {n:,d}):
        # numbers the package formats itself arrive as text, already in the reader's locale.
        assert placeholder_names(english) == placeholder_names(translated), (
            f"{lang}: placeholders differ in {english!r} -> {translated!r}"
        )


def placeholder_names(text: str) -> list[str]:
    """The fields of a str.format template, without their format specs: "{n:,d} {m}" -> ["m", "n"]."""
    return sorted(field for _, field, _, _ in string.Formatter().parse(text) if field is not None)


def test_placeholder_names_ignore_the_format_spec():
    assert placeholder_names("MLP with {n:,d} parameters, {world} ranks") == ["n", "world"]
    assert placeholder_names("MLP с {n} параметрами, рангов: {world}") == ["n", "world"]
    assert placeholder_names("{ms:.0f} ms") != placeholder_names("{s:.0f} ms")


def test_figure_text_follows_the_language(capsys):
    try:
        assert i18n.set_language("ru") == "ru"
        assert i18n.tr("Pipeline bubble, p = 2 stages") == i18n.catalog("ru")["Pipeline bubble, p = 2 stages"]
        assert i18n.tr("not a catalogued text") == "not a catalogued text"
        with pytest.raises(ValueError, match="unknown language 'xx'"):
            i18n.set_language("xx")
    finally:
        i18n.set_language("en")
    assert i18n.tr("Pipeline bubble, p = 2 stages") == "Pipeline bubble, p = 2 stages"


@pytest.mark.parametrize("lang", ["zh-CN", "zh-TW", "ko"])
def test_cjk_figure_text_draws_without_missing_glyphs(lang):
    import matplotlib

    if not any(pathlib.Path(p).exists() for p in ["/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc"]):
        pytest.skip("fonts-noto-cjk is not installed (tools/install_browser.sh installs it as root)")
    import warnings

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    try:
        assert i18n.set_language(lang) == lang
        assert matplotlib.rcParams["font.family"][1] == i18n.CJK_FONTS[lang][0]
        fig = plt.figure()
        for i, text in enumerate(i18n.catalog(lang).values()):
            fig.text(0, i / 100, text.replace("$", r"\$"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "Glyph ... missing from font(s)" becomes an error
            fig.canvas.draw()
        plt.close(fig)
    finally:
        i18n.set_language("en")


@pytest.mark.parametrize("lang", translations.TRANSLATED)
def test_diagram_is_translated(lang):
    svg = ROOT / "assets" / f"03-ranks-2-nodes-x-2-gpus.{lang}.svg"
    texts = [n.toxml() for n in xml.dom.minidom.parse(str(svg)).getElementsByTagName("text")]
    english = [
        n.toxml()
        for n in xml.dom.minidom.parse(str(ROOT / "assets/03-ranks-2-nodes-x-2-gpus.svg")).getElementsByTagName("text")
    ]
    assert len(texts) == len(english) and texts != english
    chapter = (ROOT / "chapters" / lang / "03-collectives.ipynb").read_text(encoding="utf-8")
    assert f"../../assets/03-ranks-2-nodes-x-2-gpus.{lang}.svg" in chapter


def test_toc_has_every_chapter_in_every_language_with_native_captions():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    parts = {part["caption"]: [c["file"] for c in part["chapters"]] for part in toc["parts"]}
    for lang, name in ((lang.code, lang.name) for lang in languages.LANGUAGES):
        expected = [f"chapters/{lang}/{p.stem}" for p in ENGLISH]
        if lang != "en":
            expected = [f"chapters/{lang}/index"] + expected
        assert parts[name] == expected
        if lang != "en":
            assert (ROOT / "chapters" / lang / "index.md").exists()


@pytest.mark.parametrize("lang", translations.TRANSLATED)
def test_landing_page_offers_every_language_and_chapter(lang):
    page = (ROOT / "chapters" / lang / "index.md").read_text(encoding="utf-8")
    for other, name in headers.LANGUAGES.items():
        target = "../../index.md" if other == "en" else f"../{other}/index.md"
        assert f"[{name}]({target})" in page, (other, name)
    for english in ENGLISH:
        title = translations.read(ROOT / "chapters" / lang / english.name).cells[0].source.splitlines()[0]
        title = title.lstrip("# ").split(" · ", 1)[1].strip()
        assert f"[{title}]({english.name})" in page, f"the landing page should link {english.name} as {title!r}"
    assert "](../../glossary.md)" in page and "](../../translation-status.md)" in page


def test_english_landing_page_offers_languages_by_native_name():
    page = (ROOT / "index.md").read_text(encoding="utf-8")
    for lang, name in headers.LANGUAGES.items():
        if lang != "en":
            assert f"[{name}](chapters/{lang}/index.md)" in page


@pytest.fixture
def scratch(tmp_path):
    """A copy of the book's sources to break."""
    for part in ("_config.yml", "chapters", "assets"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / part)
    return tmp_path


def test_status_shows_behind_when_english_prose_changes(scratch):
    rows = translations.status(scratch)
    assert {r["state"] for r in rows} == {"current"}, [r for r in rows if r["state"] != "current"]
    english = scratch / "chapters/en/05-checkpoints.ipynb"
    nb = nbformat.read(english, as_version=4)
    nb.cells[2].source += "\n\nOne more sentence."
    nbformat.write(nb, english)
    rows = translations.status(scratch)
    behind = sorted(r["language"] for r in rows if r["state"] == "behind")
    assert behind == sorted(translations.TRANSLATED)
    assert all(r["code"] == [] for r in rows)  # prose drift is not code drift
    (scratch / "chapters/ko/05-checkpoints.ipynb").unlink()
    assert [
        r["state"] for r in translations.status(scratch) if r["language"] == "ko" and r["chapter"] == "05-checkpoints"
    ] == ["missing"]


def test_sync_copies_english_code_and_keeps_translated_comments(scratch):
    english_path = scratch / "chapters/en/01-dataloader-workers.ipynb"
    ru_path = scratch / "chapters/ru/01-dataloader-workers.ipynb"
    en, ru = nbformat.read(english_path, as_version=4), nbformat.read(ru_path, as_version=4)
    i = next(
        i
        for i, c in enumerate(ru.cells)
        if i > 1 and c.cell_type == "code" and any(line.lstrip().startswith("#") for line in c.source.splitlines())
    )
    kept = [line for line in ru.cells[i].source.splitlines() if line.lstrip().startswith("#")]
    en.cells[i].source += "\nprint('a line the English gained')"
    nbformat.write(en, english_path)
    assert translations.code_differences(en, ru)
    translations.sync(ru_path, scratch)
    synced = nbformat.read(ru_path, as_version=4)
    assert translations.code_differences(en, synced) == []
    assert synced.cells[i].source.endswith("print('a line the English gained')")
    assert all(line in synced.cells[i].source for line in kept), "translated comments were lost"
    assert synced.cells[3].source == ru.cells[3].source  # markdown untouched


def test_status_command_fails_on_missing_translation(scratch):
    (scratch / "chapters/pt-BR/02-data-parallel.ipynb").unlink()
    (scratch / "tools").mkdir()
    for tool in ("translations.py", "headers.py"):
        shutil.copy(ROOT / "tools" / tool, scratch / "tools" / tool)
    result = subprocess.run(
        [sys.executable, str(scratch / "tools/translations.py"), "status", "--check"], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "02-data-parallel                 pt-BR  missing" in result.stdout


def _english_cell_changed(scratch, stem: str) -> tuple[pathlib.Path, str]:
    """Change one markdown cell of an English chapter in ``scratch``; its id."""
    english = scratch / f"chapters/en/{stem}.ipynb"
    nb = nbformat.read(english, as_version=4)
    cell = next(c for c in nb.cells[2:] if c.cell_type == "markdown")
    cell.source += "\n\nOne more sentence."
    nbformat.write(nb, english)
    return english, cell.get("id")


def test_apply_refuses_a_work_file_that_keeps_the_old_translation_of_changed_english(scratch):
    english, changed = _english_cell_changed(scratch, "03-collectives")
    ru = scratch / "chapters/ru/03-collectives.ipynb"
    (row,) = [r for r in translations.status(scratch) if r["path"] == ru]
    assert row["state"] == "behind" and row["cells"] == [changed]  # status names the cell
    work = translations.extract(translations.read(english), translations.read(ru))  # the translator's work file
    before = ru.read_bytes()
    with pytest.raises(ValueError, match=f"cell\\(s\\) {changed} changed"):
        translations.apply(english, "ru", work)
    assert ru.read_bytes() == before  # nothing written

    # A translator who checked the cell and found it already right says so: then it applies.
    translations.apply(english, "ru", work, unchanged=(changed,))
    assert translations.changed_cells(translations.read(english), translations.read(ru)) == []

    # Translating the changed cell is the ordinary way: the work file's text of that cell differs.
    english, again = _english_cell_changed(scratch, "03-collectives")
    work = translations.extract(translations.read(english), translations.read(ru))
    old = translations.read(ru)
    text = next(c.source for c in old.cells if c.get("id") == again)
    translations.apply(english, "ru", work.replace(text, text + "\n\nЕщё одно предложение."))
    applied = translations.read(ru)
    assert translations.recorded(applied)["english_prose"] == translations.prose_fingerprint(translations.read(english))
    assert any(c.source.endswith("Ещё одно предложение.") for c in applied.cells)


def test_apply_refuses_a_cell_the_english_gained_left_in_english(scratch):
    english = scratch / "chapters/en/03-collectives.ipynb"
    nb = nbformat.read(english, as_version=4)
    new = nbformat.v4.new_markdown_cell("A new paragraph of English.")
    nb.cells.insert(3, new)
    nbformat.write(nb, english)
    work = translations.extract(
        translations.read(english), translations.read(scratch / "chapters/ko/03-collectives.ipynb")
    )
    with pytest.raises(ValueError, match=new.id):
        translations.apply(english, "ko", work)


def test_mark_current_records_only_the_cells_it_is_told(scratch, monkeypatch):
    monkeypatch.setattr(translations, "ROOT", scratch)
    english = scratch / "chapters/en/03-collectives.ipynb"
    nb = nbformat.read(english, as_version=4)
    first, second = [c for c in nb.cells[2:] if c.cell_type == "markdown"][:2]
    first.source += "\n\nOne more sentence."
    second.source += "\n\nAnother sentence."
    nbformat.write(nb, english)
    zh = scratch / "chapters/zh-TW/03-collectives.ipynb"
    assert sorted(translations.changed_cells(translations.read(english), translations.read(zh))) == sorted(
        [first.id, second.id]
    )
    # A translator who carried the first cell records that one; the second stays behind.
    assert translations.mark_current(english, "zh-TW", (first.id,)) == [second.id]
    assert translations.changed_cells(translations.read(english), translations.read(zh)) == [second.id]
    with pytest.raises(ValueError, match="no-such-cell"):
        translations.mark_current(english, "zh-TW", ("no-such-cell",))
    assert translations.mark_current(english, "zh-TW", (second.id,)) == []
    assert translations.changed_cells(translations.read(english), translations.read(zh)) == []
    # "all" records every changed cell at once.
    assert translations.mark_current(english, "pt-BR", ("all",)) == []
    assert (
        translations.changed_cells(
            translations.read(english), translations.read(scratch / "chapters/pt-BR/03-collectives.ipynb")
        )
        == []
    )


def test_search_index_splits_cjk_text_into_pairs():
    from sphinx.search.en import SearchEnglish

    from course_book import CourseSearch

    text = "本章介绍分布式训练 and gradients, 분산 학습을 and распределённое обучение"
    english = SearchEnglish({}).split(text)
    assert "本章介绍分布式训练" in english and "分布" not in english  # Sphinx alone: one "word" per CJK run
    words = CourseSearch({}).split(text)
    assert {"分布", "布式", "训练", "분산", "학습", "습을", "gradients", "распределённое"} <= set(words)


def test_notebook_language_comes_from_the_notebook(monkeypatch, tmp_path):
    monkeypatch.delenv("DISTCOURSE_LANG", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.chdir(ROOT / "chapters" / "ko")  # Jupyter, nbval, Jupyter Book
    assert i18n.notebook_language() == "ko"
    monkeypatch.setenv("JPY_SESSION_NAME", str(ROOT / "chapters/zh-TW/01-dataloader-workers.ipynb"))
    assert i18n.notebook_language() == "zh-TW"  # Jupyter Server names the notebook
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.chdir(tmp_path)
    assert i18n.notebook_language() == "en"  # nothing to go by
    # every code cell, the setup cell included, is the same in every language
    for english, lang in PAIRS:
        tr = translations.read(translations.translation_of(english, lang))
        en = translations.read(english)
        assert tr.cells[1].source == en.cells[1].source
