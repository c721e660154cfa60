"""Sphinx extension of the course book: translation notices, the status page, the glossary, search.

Loaded through ``sphinx.local_extensions`` in ``_config.yml``.

* On every translated chapter page, right below its title, a notice says that the
  page is a translation of the English chapter and whether the English prose has
  changed since (``tools/translations.py`` computes both from the notebooks, so the
  notice is decided when the page is built, not when it was translated).
* ``{translation-status}`` renders the chapter x language table (current / behind / missing).
* ``{course-glossary}`` renders ``assets/glossary.yml`` as a table.
* Chapter pages carry their own language in ``<html lang>`` (from the registry of languages).
* The search index splits Chinese, Japanese and Korean text into overlapping
  two-character pieces, in the index and in the query, so that a search for a
  CJK word finds pages in every language (Sphinx's own English splitter would
  keep a whole CJK sentence as one word; its Chinese splitter drops Cyrillic).
"""

from __future__ import annotations

import pathlib
import re
import sys

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.search.en import SearchEnglish
from sphinx.util.docutils import SphinxDirective

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "code")]
import translations  # noqa: E402
from distcourse.runtime import languages  # noqa: E402

CHAPTER = re.compile(r"^chapters/(?P<lang>[^/]+)/(?P<name>\d\d-[^/]+)$")

# Title, text while the translation is current, text once the English has changed: per language.
NOTICE = {lang.code: lang.notice for lang in languages.TRANSLATED}


def english_title(nb) -> str:
    return nb.cells[0].source.splitlines()[0].lstrip("# ").strip()


def add_translation_notice(app, doctree) -> None:
    docname = app.env.docname
    match = CHAPTER.match(docname)
    if not match or match["lang"] not in NOTICE:
        return
    english_path = ROOT / "chapters" / "en" / f"{match['name']}.ipynb"
    translated_path = ROOT / f"{docname}.ipynb"
    if not english_path.exists() or not translated_path.exists():
        return
    app.env.note_dependency(str(english_path))
    english, translated = translations.read(english_path), translations.read(translated_path)
    now = translations.prose_fingerprint(english)
    was = translations.recorded(translated).get("english_prose", "?")
    title, current, behind = NOTICE[match["lang"]]
    state = "current" if was == now else "behind"
    text = (current if state == "current" else behind).format(title=english_title(english), was=was, now=now)
    notice = nodes.admonition(
        "",
        nodes.title(text=title),
        nodes.paragraph(text=text),
        classes=["tip" if state == "current" else "warning", f"translation-{state}"],
    )
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None:
        doctree.insert(0, notice)
    else:
        section.insert(1, notice)  # right after the chapter title


def set_page_language(app, pagename, templatename, context, doctree) -> None:
    """``<html lang>`` of a page under ``chapters/<code>/``: its own language, not the book's.

    Screen readers pick their voice by it, browsers their fonts (Simplified and Traditional
    Chinese differ in glyphs), search engines their audience.
    """
    parts = pagename.split("/")
    if len(parts) > 2 and parts[0] == "chapters" and parts[1] in languages.BY_CODE:
        context["language"] = languages.BY_CODE[parts[1]].html


class TranslationStatus(SphinxDirective):
    """The chapter x language table, computed from the notebooks at build time."""

    def run(self):
        for path in (ROOT / "chapters").glob("*/[0-9][0-9]-*.ipynb"):
            self.env.note_dependency(str(path))
        rows = translations.status(ROOT)
        translated = languages.TRANSLATED
        marks = {"current": "✅ current", "behind": "⚠️ behind", "missing": "❌ missing"}
        lines = [
            "| chapter | " + " | ".join(lang.name for lang in translated) + " |",
            "|---|" + "---|" * len(translated),
        ]
        for english_path in translations.english_chapters(ROOT):
            cells = []
            for lang in (lang.code for lang in translated):
                row = next(r for r in rows if r["chapter"] == english_path.stem and r["language"] == lang)
                mark = marks[row["state"]] + (" (code differs)" if row["code"] else "")
                cells.append(mark if row["state"] == "missing" else f"[{mark}](chapters/{lang}/{english_path.name})")
            lines.append(f"| [{english_path.stem}](chapters/en/{english_path.name}) | " + " | ".join(cells) + " |")
        counts = {state: sum(r["state"] == state for r in rows) for state in marks}
        lines += [
            "",
            f"{counts['current']} current, {counts['behind']} behind, {counts['missing']} missing "
            f"({len(rows)} chapter translations).",
        ]
        container = nodes.container(classes=["translation-status"])
        self.state.nested_parse(StringList(lines, source="translation-status"), self.content_offset, container)
        return [container]


class CourseGlossary(SphinxDirective):
    """assets/glossary.yml as a table: one row per key term, one column per language."""

    def run(self):
        self.env.note_dependency(str(translations.GLOSSARY))
        lines = [
            "| " + " | ".join(lang.name for lang in languages.LANGUAGES) + " |",
            "|---" * len(languages.LANGUAGES) + "|",
        ]
        for term in translations.glossary():
            cells = [term["en"][0]] + [
                " / ".join(term[lang]) if isinstance(term[lang], list) else term[lang]
                for lang in translations.TRANSLATED
            ]
            lines.append("| " + " | ".join(cells) + " |")
        container = nodes.container(classes=["course-glossary"])
        self.state.nested_parse(StringList(lines, source="glossary"), self.content_offset, container)
        return [container]


CJK = (  # Hangul Jamo, CJK radicals, kana, bopomofo, Hangul compatibility, CJK ideographs, Hangul, compatibility
    "\u1100-\u11ff\u2e80-\u2fdf\u3040-\u30ff\u3100-\u312f\u3130-\u318f"
    "\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
)
_CJK_RUN = re.compile(f"[{CJK}]+")


class CourseSearch(SearchEnglish):
    """English search (Porter stemming), with CJK runs indexed as overlapping pairs of characters."""

    lang = "course"
    language_name = "English with CJK"
    js_splitter_code = r"""
function splitQuery(query) {
  const cjk = /[%s]+/u;
  const out = [];
  for (const word of query.split(/[^\p{Letter}\p{Number}_\p{Emoji_Presentation}]+/gu)) {
    if (!word) continue;
    for (const part of word.split(new RegExp("([%s]+)", "u"))) {
      if (!part) continue;
      if (!cjk.test(part)) { out.push(part); continue; }
      if (part.length === 1) { out.push(part); continue; }
      for (let i = 0; i + 1 < part.length; i++) out.push(part.slice(i, i + 2));
    }
  }
  return out;
}
""" % (CJK, CJK)  # noqa: UP031  (the JavaScript's own braces make str.format awkward)

    def split(self, input: str) -> list[str]:
        words = []
        for word in super().split(input):
            pieces = re.split(f"([{CJK}]+)", word)
            for piece in pieces:
                if not piece:
                    continue
                if _CJK_RUN.fullmatch(piece) and len(piece) > 1:
                    words.extend(piece[i : i + 2] for i in range(len(piece) - 1))
                else:
                    words.append(piece)
        return words

    def stem(self, word: str) -> str:
        return word if _CJK_RUN.search(word) else super().stem(word)

    def word_filter(self, word: str) -> bool:
        return bool(_CJK_RUN.search(word)) or super().word_filter(word)


def setup(app):
    app.add_search_language(CourseSearch)
    app.connect("doctree-read", add_translation_notice)
    app.connect("html-page-context", set_page_language)
    app.add_directive("translation-status", TranslationStatus)
    app.add_directive("course-glossary", CourseGlossary)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
