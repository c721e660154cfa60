"""Sphinx extension of the course book: translation notices, the status page, the glossary, search.

Loaded through ``sphinx.local_extensions`` in ``_config.yml``.

* On every translated chapter page, right below its title, a notice says that the
  page is a translation of the English chapter and whether the English prose has
  changed since (``tools/translations.py`` computes both from the notebooks, so the
  notice is decided when the page is built, not when it was translated).
* ``{translation-status}`` renders the chapter x language table (current / behind / missing).
* ``{course-glossary}`` renders ``assets/glossary.yml`` as a table.
* The pages every language book shares (the glossary, the translation status, tested-with)
  carry that book's own title (``tools/book_interface.yml``: ``page_titles``); each book is
  tagged ``book_<locale>`` so that their ``{only}`` blocks show the book's language only, and
  the status table speaks it (``translation_status``).
* Chapter pages carry their own language in ``<html lang>`` (from the registry of languages).
* Built as one book per language (``tools/build_book.py`` sets ``course_book_language``):
  a language switcher in the sidebar leads to the same page in the other books; links to
  pages of another language's book (landing pages, the chapter headers written for Colab)
  point into that book; the header's language line and translation line, which Colab
  readers need, give way to the switcher and to the notice above.
* The search index splits Chinese, Japanese and Korean text into overlapping
  two-character pieces, in the index and in the query, so that a search for a
  CJK word finds pages in every language (Sphinx's own English splitter would
  keep a whole CJK sentence as one word; its Chinese splitter drops Cyrillic).
"""

from __future__ import annotations

import pathlib
import re
import sys

import yaml
from docutils import nodes
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.search.en import SearchEnglish
from sphinx.transforms.post_transforms import SphinxPostTransform
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


# ------------------------------------------------------------ one book per language
TEMPLATES = ROOT / "tools" / "book_templates"
LANDING = re.compile(r"^chapters/(?P<lang>[^/]+)/index$")


def book_of(docname: str) -> str | None:
    """The language book that holds ``docname`` (a chapter or a landing page), if any."""
    if docname == "index":
        return languages.ENGLISH.code
    match = re.match(r"^chapters/(?P<lang>[^/]+)/", docname)
    return match["lang"] if match and match["lang"] in languages.BY_CODE else None


def book_url(from_doc: str, book: str, target: str) -> str:
    """Relative URL from page ``from_doc`` of one book to page ``target`` of book ``book``.

    The books lie side by side: _build/html/<code>/<docname>.html.
    """
    return "../" * from_doc.count("/") + f"../{book}/{target}.html"


def counterpart(pagename: str, code: str) -> str | None:
    """The page of book ``code`` that shows what ``pagename`` shows, if it exists."""
    if pagename == "index" or LANDING.match(pagename):
        target = "index" if code == languages.ENGLISH.code else f"chapters/{code}/index"
    elif match := CHAPTER.match(pagename):
        target = f"chapters/{code}/{match['name']}"
    else:
        return pagename  # the glossary, the status page, search: in every book
    return target if any((ROOT / f"{target}{suffix}").is_file() for suffix in (".ipynb", ".md")) else None


class CrossBookLinks(SphinxPostTransform):
    """Links to pages of another language's book become links into that book.

    MyST turns ``[Русский](../ru/03-collectives.ipynb)`` into a reference to a document
    of this project, and warns when it is not part of this build. Runs just before
    MyST's own resolver (priority 9) and leaves every other reference to it.
    """

    default_priority = 8

    def run(self, **kwargs):
        if not self.config.course_book_language:
            return
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
                continue
            target = node["reftarget"]
            book = book_of(target)
            if target in self.env.all_docs or book is None:
                continue
            url = book_url(node.get("refdoc", self.env.docname), book, target)
            if node.get("reftargetid"):
                url += "#" + node["reftargetid"]
            reference = nodes.reference("", "", refuri=url, internal=False, classes=["course-other-language"])
            reference += [child.deepcopy() for child in node.children]
            node.replace_self(reference)


def header_lines_give_way(app, doctree) -> None:
    """In a language book, drop the Colab header's language line and translation line.

    The sidebar's switcher and the translation notice say the same on the book page; the
    lines stay in the notebooks, where Colab readers need them.
    """
    if not app.config.course_book_language or not CHAPTER.match(app.env.docname):
        return
    labels = tuple(lang.other_languages for lang in languages.LANGUAGES)
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None:
        return
    for paragraph in [child for child in section.children[:6] if isinstance(child, nodes.paragraph)]:
        first = paragraph.children[0] if paragraph.children else None
        language_line = isinstance(first, nodes.strong) and first.astext().startswith(labels)
        translation_line = any(
            ref.get("reftarget") == "translation-status" for ref in paragraph.findall(addnodes.pending_xref)
        )
        if language_line or translation_line:
            paragraph.parent.remove(paragraph)


INTERFACE = ROOT / "tools" / "book_interface.yml"
FIRST_HEADING = re.compile(r"^# .*$", re.M)


def interface() -> dict:
    """tools/book_interface.yml: the book's interface strings per language."""
    return yaml.safe_load(INTERFACE.read_text(encoding="utf8"))


def shared_page_title(app, docname, source) -> None:
    """A shared page (glossary, translation status, tested-with) titled in its book's language.

    The pages are one source in every book; their first heading is replaced by the title that
    tools/book_interface.yml (page_titles) gives the book's language, so that the sidebar, the
    heading and the browser tab of the Korean book say 용어집, those of the Russian one Глоссарий.
    """
    if not app.config.course_book_language:
        return
    titles = interface()["page_titles"].get(docname)
    if not titles:
        return
    app.env.note_dependency(str(INTERFACE))
    title = titles.get(app.config.language)
    if title:
        source[0] = FIRST_HEADING.sub(lambda _: f"# {title}", source[0], count=1)


def language_switcher(app, pagename, templatename, context, doctree) -> None:
    """``course_languages`` for tools/book_templates/language-switcher.html."""
    book = app.config.course_book_language
    if not book:
        return
    items = []
    for lang in languages.LANGUAGES:
        target = counterpart(pagename, lang.code)
        if lang.code != book and target is not None:
            items.append({"name": lang.name, "lang": lang.html, "href": book_url(pagename, lang.code, target)})
    context["course_languages"] = items
    context["course_languages_label"] = languages.get(book).other_languages


def tag_book_language(app, config) -> None:
    """Tag ``book_<locale>`` (book_en, book_zh_TW...): ``{only}`` blocks of the shared pages pick it."""
    app.tags.add(f"book_{config.language or 'en'}")


def add_language_switcher(app, config) -> None:
    """The switcher in the sidebar, and the interface strings the themes leave in English.

    tools/book_templates also replaces two one-line components of sphinx-book-theme whose
    tooltips are written in English rather than through gettext.
    """
    if not config.course_book_language:
        return
    config.templates_path.insert(0, str(TEMPLATES))
    search = interface()["search_bar_text"].get(config.language)
    if search:
        config.html_theme_options = {**config.html_theme_options, "search_bar_text": search}
    for folder in config.locale_dirs:  # compiled by tools/build_book.py; "sphinx" is read by Sphinx itself
        app.add_message_catalog("booktheme", folder)
    sidebar = ["navbar-logo.html", "icon-links.html", "search-button-field.html"]
    config.html_sidebars = {"**": [*sidebar, "language-switcher.html", "sbt-sidebar-nav.html"]}


class TranslationStatus(SphinxDirective):
    """The chapter x language table, computed from the notebooks at build time.

    Its words are the book's language's (tools/book_interface.yml: translation_status).
    """

    def run(self):
        for path in (ROOT / "chapters").glob("*/[0-9][0-9]-*.ipynb"):
            self.env.note_dependency(str(path))
        self.env.note_dependency(str(INTERFACE))
        words = {
            key: texts.get(self.config.language, texts["en"])
            for key, texts in interface()["translation_status"].items()
        }
        rows = translations.status(ROOT)
        translated = languages.TRANSLATED
        states = ("current", "behind", "missing")
        lines = [
            f"| {words['chapter']} | " + " | ".join(lang.name for lang in translated) + " |",
            "|---|" + "---|" * len(translated),
        ]
        for english_path in translations.english_chapters(ROOT):
            cells = []
            for lang in (lang.code for lang in translated):
                row = next(r for r in rows if r["chapter"] == english_path.stem and r["language"] == lang)
                mark = words[row["state"]] + (words["code_differs"] if row["code"] else "")
                cells.append(mark if row["state"] == "missing" else f"[{mark}](chapters/{lang}/{english_path.name})")
            lines.append(f"| [{english_path.stem}](chapters/en/{english_path.name}) | " + " | ".join(cells) + " |")
        counts = {state: sum(r["state"] == state for r in rows) for state in states}
        lines += ["", words["summary"].format(**counts, total=len(rows))]
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
    # Set by tools/build_book.py in each language's book; None: one book with every language.
    app.add_config_value("course_book_language", None, "html")
    app.connect("config-inited", add_language_switcher)
    app.connect("config-inited", tag_book_language)
    app.connect("source-read", shared_page_title)
    app.connect("doctree-read", header_lines_give_way)
    app.connect("html-page-context", language_switcher)
    app.add_post_transform(CrossBookLinks)
    app.add_search_language(CourseSearch)
    app.connect("doctree-read", add_translation_notice)
    app.connect("html-page-context", set_page_language)
    app.add_directive("translation-status", TranslationStatus)
    app.add_directive("course-glossary", CourseGlossary)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
