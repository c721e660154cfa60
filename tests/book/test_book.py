"""The book builds, and its executed pages follow changes in the code they import.

Both tests go through tools/build_book.py, the same entry point as `make book`.
"""

import os
import posixpath
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import yaml

from distcourse.runtime import languages

REPO_ROOT = Path(__file__).resolve().parents[2]
# Every test here builds a book (the whole book, or a small one that executes).
pytestmark = pytest.mark.slow


def build_book(*args, timeout=240):
    """Run tools/build_book.py; fail with the tail of its output. Returns (stdout, seconds).

    timeout stays below pytest-timeout's 300 s so a hang reports the build, not pytest.
    """
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "tools/build_book.py", *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-100:])
        pytest.fail(
            f"build_book.py {' '.join(map(str, args))} exited with "
            f"{result.returncode}; last lines of its output:\n{tail}"
        )
    return result.stdout, seconds


def mtime(path: Path):
    return path.stat().st_mtime_ns if path.exists() else None


_WHOLE_BOOK = []  # built once per test session, for this module and tests/book/test_front_door.py


def whole_book(tmp_path_factory):
    """The whole book (six languages) built without execution; (html folder, build output, seconds)."""
    if not _WHOLE_BOOK:
        tmp_path = tmp_path_factory.mktemp("book")
        # The main build's output and cache must survive a test build.
        main_build = [REPO_ROOT / "_build/html/index.html", REPO_ROOT / "_build/.jupyter_cache"]
        before = [mtime(p) for p in main_build]
        stdout, seconds = build_book("--no-execute", "--output", tmp_path)
        assert [mtime(p) for p in main_build] == before
        # Execution off means the execution cache is never even opened.
        assert not (tmp_path / "_build" / ".jupyter_cache").exists()
        _WHOLE_BOOK.append((tmp_path / "_build" / "html", stdout, seconds))
    return _WHOLE_BOOK[0]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    return whole_book(tmp_path_factory)


def page_of(html: Path, notebook: Path) -> Path:
    """Where a chapter's page lies: in its language's book, _build/html/<code>/chapters/<code>/..."""
    relative = notebook.relative_to(REPO_ROOT).with_suffix(".html")
    return html / relative.parts[1] / relative


def test_book_builds_without_execution(book):
    html, stdout, seconds = book
    print(f"\nno-execute build of the book: {seconds:.1f} s")

    assert stdout.splitlines()[-1] == str(html / "index.html")
    # The budget leaves room for a busy machine (95-118 s were measured while two other test runs
    # used both cores) and still catches a build that became several times slower.
    assert seconds <= 180, f"no-execute build took {seconds:.1f} s, budget is 180 s"
    # The root page lets the reader choose a language; each language is a book of its own.
    picker = (html / "index.html").read_text(encoding="utf-8")
    for lang in languages.LANGUAGES:
        assert f'<a href="{lang.code}/index.html" hreflang="{lang.html}">{lang.name}</a>' in picker
        assert (html / lang.code / "index.html").is_file()
        assert (html / lang.code / "_static" / "mathjax" / "tex-mml-chtml.js").is_file()
    assert (html / "en/chapters/en/01-dataloader-workers.html").is_file()

    # No page loads a script, a style sheet or an image from the network (MathJax comes
    # from _static, the Colab badge from assets/).
    for page in html.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?:[^"]+)"', text)
        remote += re.findall(r'<img[^>]+src="(https?:[^"]+)"', text)
        assert not remote, (page.relative_to(html), remote)

    # Every chapter page: the theme's launch button and the header badge open this very
    # notebook in Colab (both come from the repository URL in _config.yml).
    import headers

    for notebook in headers.notebooks(REPO_ROOT):
        page = page_of(html, notebook).read_text(encoding="utf-8")
        colab_links = re.findall(r'href="(https://colab\.research\.google\.com/github/[^"]+)"', page)
        assert colab_links == [headers.colab_url(notebook, REPO_ROOT)] * 2, (notebook, colab_links)


TINY_CONFIG = """\
title: Cache test book
author: tests
only_build_toc_files: true
exclude_patterns: [_build, code]
execute:
  execute_notebooks: cache
  timeout: 120
sphinx:
  config:
    nb_execution_raise_on_error: true
"""

TINY_TOC = """\
format: jb-book
root: index
chapters:
  - file: page
  - file: other
"""


def tiny_notebook(module: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"# Page using {module}"),
        # Notebooks run in their own folder (the book root here), so "code" resolves.
        nbformat.v4.new_code_cell(f'import sys; sys.path.insert(0, "code"); import {module}; print({module}.VALUE)'),
        # Shows which interpreter ran the kernel: it must be the one running the tests.
        nbformat.v4.new_code_cell('print("kernel-prefix:", sys.prefix)'),
    ]
    return nb


def write_tiny_book(root: Path):
    """Two pages: page.ipynb imports code/marker.py (which imports helper.py), other.ipynb code/other.py."""
    (root / "_config.yml").write_text(TINY_CONFIG)
    (root / "_toc.yml").write_text(TINY_TOC)
    (root / "index.md").write_text("# Tiny book\n\nTwo executed pages.\n")
    (root / "code").mkdir()
    (root / "code" / "helper.py").write_text('SUFFIX = "-value"\n')
    (root / "code" / "marker.py").write_text('from helper import SUFFIX\nVALUE = "first" + SUFFIX\n')
    (root / "code" / "other.py").write_text('VALUE = "other-first"\n')
    nbformat.write(tiny_notebook("marker"), root / "page.ipynb")
    nbformat.write(tiny_notebook("other"), root / "other.ipynb")


def test_cache_follows_code_changes(tmp_path):
    write_tiny_book(tmp_path)
    page, other = tmp_path / "_build" / "html" / "page.html", tmp_path / "_build" / "html" / "other.html"

    stdout, first = build_book("--root", tmp_path)
    # Progress: the notebook, n of N and its seconds, then the totals.
    assert re.search(r"^\[ \d/2\] page\.ipynb  executing\.\.\. \d+\.\d s$", stdout, flags=re.M), stdout
    assert re.search(r"^Notebooks: 2 executed in \d+\.\d s, 0 from the cache$", stdout, flags=re.M), stdout
    html = page.read_text()
    assert "first-value" in html and "other-first" in other.read_text()
    assert f"kernel-prefix: {sys.prefix}" in html

    # Neither notebook changed: only the fingerprint of what page.ipynb imports (through
    # marker.py, helper.py) can trigger this rerun, and other.ipynb must not run again.
    (tmp_path / "code" / "helper.py").write_text('SUFFIX = "-changed"\n')
    stdout, second = build_book("--root", tmp_path)
    assert "first-changed" in page.read_text() and "first-value" not in page.read_text()
    assert re.search(r"^Notebooks: 1 executed in \d+\.\d s, 0 from the cache, 1 unchanged", stdout, flags=re.M), stdout
    assert "Inputs changed for 1 of 2 notebooks" in stdout

    stdout, unchanged = build_book("--root", tmp_path)
    print(
        f"\ntiny book: first build {first:.1f} s, after code change {second:.1f} s, no-change rebuild {unchanged:.1f} s"
    )
    assert "first-changed" in page.read_text() and "other-first" in other.read_text()
    assert "Inputs changed" not in stdout and "Re-reading" not in stdout, "nothing changed: incremental"
    assert unchanged <= 10, f"no-change rebuild took {unchanged:.1f} s, target is 10 s"


def test_the_tests_execution_feeds_the_book(tmp_path, request):
    """`make book` right after `make test` executes no notebook again and shows the tested outputs.

    Each page prints a token that its execution also appends to a file: a page whose HTML shows
    the token of the tests' run, with one line in the file, was not executed again by the book.
    """
    write_tiny_book(tmp_path)
    for name in ("page", "other"):
        nb = nbformat.read(tmp_path / f"{name}.ipynb", as_version=4)
        nb.cells.append(
            nbformat.v4.new_code_cell(
                f"import os, uuid; token = uuid.uuid4().hex; print('token:', token)\n"
                f"open('runs-{name}.txt', 'a').write(token + '\\n')\n"
                f"assert os.environ.get('TINY_BOOK_FAIL') != '{name}'"
            )
        )
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    # A display updated in place, as the launcher shows the ranks' output: the page shows its last state.
    nb = nbformat.read(tmp_path / "page.ipynb", as_version=4)
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "from IPython.display import display\n"
            "view = display({'text/plain': 'live ' + 'view'}, raw=True, display_id=True)\n"
            "print('betw' + 'een')\n"
            "view.update({'text/plain': 'final ' + 'view'}, raw=True)"
        )
    )
    nbformat.write(nb, tmp_path / "page.ipynb")

    def tokens(name):
        return (tmp_path / f"runs-{name}.txt").read_text().split()

    def page(name):
        return (tmp_path / "_build" / "html" / f"{name}.html").read_text()

    def nbval(fail=""):
        """The notebooks under nbval, as `make test` runs them, with the plugin conftest.py registers."""
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "tools"), "TINY_BOOK_FAIL": fail}
        args = ["-p", "book_cache", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider"]
        command = [sys.executable, "-m", "pytest", *args, "page.ipynb", "other.ipynb"]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)

    assert request.config.pluginmanager.has_plugin("book_cache"), "conftest.py does not register tools/book_cache.py"

    # other.ipynb fails an assert: only page.ipynb's run may reach the book.
    tested = nbval(fail="other")
    assert tested.returncode == 1 and "book cache: 1 notebooks stored" in tested.stdout, tested.stdout[-3000:]
    stdout, _ = build_book("--root", tmp_path)
    assert re.search(r"^\[ \d/2\] page\.ipynb  from the cache$", stdout, flags=re.M), stdout
    assert re.search(r"^Notebooks: 1 executed in \d+\.\d s, 1 from the cache$", stdout, flags=re.M), stdout
    assert len(tokens("page")) == 1 and tokens("page")[0] in page("page")
    assert "final view" in page("page") and "live view" not in page("page") and "between" in page("page")
    assert len(tokens("other")) == 2 and tokens("other")[1] in page("other")

    # Both pass: the book (built before) shows this run's outputs and executes nothing.
    tested = nbval()
    assert tested.returncode == 0 and "book cache: 2 notebooks stored" in tested.stdout, tested.stdout[-3000:]
    stdout, seconds = build_book("--root", tmp_path)
    print(f"\ntiny book after its tests: {seconds:.1f} s, nothing executed")
    assert re.search(r"^Notebooks: 0 executed in 0\.0 s, 2 from the cache$", stdout, flags=re.M), stdout
    assert len(tokens("page")) == 2 and tokens("page")[1] in page("page") and tokens("page")[0] not in page("page")
    assert len(tokens("other")) == 3 and tokens("other")[2] in page("other")


# ---------------------------------------------------------------- six languages, six books

LANGUAGE_LINK_CASES = [
    ("en", "ru"),
    ("ru", "zh-TW"),
    ("zh-CN", "ko"),
    ("ko", "pt-BR"),
    ("pt-BR", "zh-CN"),
    ("zh-TW", "en"),
]
INTERFACE = yaml.safe_load((REPO_ROOT / "tools" / "book_interface.yml").read_text(encoding="utf-8"))


def test_translated_pages_say_they_are_translations_once_and_are_current(book):
    html, _, _ = book
    import translations

    for english in translations.english_chapters(REPO_ROOT):
        for lang in translations.TRANSLATED:
            page = page_of(html, translations.translation_of(english, lang)).read_text(encoding="utf-8")
            page = page[page.index("<article") :]  # the chapter itself, without the theme's sidebars
            notice = page.find("translation-current")
            assert notice != -1, f"{lang}/{english.stem}: no 'translation is current' notice"
            assert "translation-behind" not in page
            assert notice < page.find("<h2"), "the notice is not near the top of the page"
            # One notice: the header line written for Colab readers gives way to it.
            assert "translation-status.html" not in page[: page.find("<h2")], f"{lang}/{english.stem}"


def test_status_page_lists_every_translation_as_current(book):
    html, _, _ = book
    import translations

    expected = len(translations.english_chapters(REPO_ROOT)) * len(translations.TRANSLATED)
    page = (html / "en" / "translation-status.html").read_text(encoding="utf-8")
    assert page.count("✅ current") == expected, page.count("✅ current")
    assert f"{expected} current, 0 behind, 0 missing" in page
    glossary = (html / "ru" / "glossary.html").read_text(encoding="utf-8")
    assert "分散式訓練" in glossary and "распределённое обучение" in glossary


@pytest.mark.parametrize("code", languages.CODES)
def test_each_book_holds_its_language_only(book, code):
    """Sphinx's language, <html lang>, the sidebar and the search index: one language per book."""
    html, _, _ = book
    lang = languages.get(code)
    toc = yaml.safe_load((REPO_ROOT / "_toc.yml").read_text(encoding="utf-8"))
    own = next(part for part in toc["parts"] if part["caption"] == lang.name)
    page = (html / code / "chapters" / code / "03-collectives.html").read_text(encoding="utf-8")
    assert re.search(r'<html lang="' + re.escape(lang.html) + '"', page)
    sidebar = page[page.index('class="bd-links') : page.index("</nav>", page.index('class="bd-links'))]
    # Sidebar links are relative to the page (chapters/<code>/): resolve them to book paths.
    hrefs = re.findall(r'href="([^"#:]+)\.html', sidebar)
    linked = {posixpath.normpath(posixpath.join(f"chapters/{code}", href)) for href in hrefs}
    # The page itself is the sidebar's current entry (href="#"); a translated book's root page
    # is chapters/<code>/index.
    home = {"index", f"chapters/{code}/index", "glossary", "translation-status", "tested-with"}
    chapters = {c["file"] for c in own["chapters"]} - home - {f"chapters/{code}/03-collectives"}
    assert linked - home == chapters, linked
    assert re.search(r'<a class="current reference internal" href="#">', sidebar)
    captions = re.findall(r'class="caption-text">([^<]+)<', sidebar)
    assert captions == [lang.name, INTERFACE["shared_caption"][lang.sphinx]], captions
    index = (html / code / "searchindex.js").read_text(encoding="utf-8")
    others = [other.code for other in languages.LANGUAGES if other.code != code]
    assert f'"chapters/{code}/03-collectives"' in index
    assert not any(f'"chapters/{other}/' in index for other in others)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from cdp import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("no chromium (tools/install_browser.sh installs it when run as root)")
    b = Browser(str(tmp_path_factory.mktemp("chromium-profile")))
    yield b
    b.close()


@pytest.mark.parametrize("code", languages.CODES)
def test_book_page_in_a_browser(book, browser, code):
    """What a reader of each language sees: the interface, the switcher, no notes, no remote image."""
    html, _, _ = book
    lang = languages.get(code)
    browser.open((html / code / "chapters" / code / "05-checkpoints.html").as_uri())
    seen = browser.wait_for(
        "document.readyState === 'complete' && ({"
        " lang: document.documentElement.lang,"
        " search: document.querySelector('.search-button-field .search-button__default-text, input[name=q]')"
        "   ?.getAttribute('placeholder') || document.querySelector('.search-button__default-text')?.textContent,"
        " top: document.querySelector('#pst-back-to-top')?.textContent.trim(),"
        " switcher: [...document.querySelectorAll('nav.course-languages a')].map(a => [a.textContent, a.href]),"
        " images: [...document.images].map(i => i.src).filter(s => !s.startsWith('file:')),"
        " text: document.querySelector('article').innerText })"
    )
    assert seen["lang"] == lang.html
    if code != "en":
        assert seen["top"] == INTERFACE["sphinx"]["Back to top"][lang.sphinx], seen["top"]
    assert seen["images"] == []
    names = [name for name, _ in seen["switcher"]]
    assert names == [other.name for other in languages.LANGUAGES if other.code != code]
    for (name, href), other in zip(seen["switcher"], [o for o in languages.LANGUAGES if o.code != code]):
        assert href.endswith(f"/{other.code}/chapters/{other.code}/05-checkpoints.html"), (name, href)
        assert Path(href.removeprefix("file://")).is_file(), href
    # Speaker notes stay in the slides: a sentence from one is nowhere on the page.
    import translations

    notes = [
        c.source
        for c in translations.read(REPO_ROOT / "chapters" / code / "05-checkpoints.ipynb").cells
        if c.metadata.get("slideshow", {}).get("slide_type") == "notes"
    ]
    assert notes
    for note in notes:
        first_words = " ".join(note.split()[:6])
        assert first_words not in " ".join(seen["text"].split()), first_words


@pytest.mark.parametrize("start, target", LANGUAGE_LINK_CASES, ids=[f"{a}-to-{b}" for a, b in LANGUAGE_LINK_CASES])
def test_language_switcher_opens_the_same_chapter(book, browser, start, target):
    html, _, _ = book
    chapter = "03-collectives.html"
    browser.open((html / start / "chapters" / start / chapter).as_uri())
    name = languages.get(target).name
    clicked = browser.evaluate(
        "(() => { const a = [...document.querySelectorAll('nav.course-languages a')]"
        f".find(a => a.textContent.trim() === {name!r});"
        " if (!a) return null; a.click(); return a.getAttribute('href'); })()"
    )
    assert clicked == f"../../../{target}/chapters/{target}/{chapter}", clicked
    landed = browser.wait_for(
        f"location.href.endsWith('/{target}/chapters/{target}/{chapter}') && "
        "document.readyState === 'complete' && document.querySelector('h1').textContent"
    )
    title = nbformat.read(REPO_ROOT / "chapters" / target / "03-collectives.ipynb", as_version=4).cells[0].source
    assert landed.strip().rstrip("#").strip() == title.splitlines()[0].lstrip("# ").strip()


SEARCHES = [
    ("分布式训练", "zh-CN"),
    ("分散式訓練", "zh-TW"),
    ("분산", "ko"),
    ("распределённое", "ru"),
    ("treinamento", "pt-BR"),
    ("all_reduce", "en"),
]


@pytest.mark.parametrize("query, code", SEARCHES, ids=[c for _, c in SEARCHES])
def test_search_finds_pages_of_its_own_language(book, browser, query, code):
    html, _, _ = book
    browser.open((html / code / "search.html").as_uri() + "?q=" + query)
    found = browser.wait_for(
        "(() => { const r = [...document.querySelectorAll('#search-results li a')];"
        " return document.querySelector('#search-results p')?.textContent && r.map(a => a.href); })()",
        timeout=30,
    )
    assert any(f"/{code}/chapters/{code}/" in href for href in found), (query, found[:5])
    assert all(f"/{code}/" in href for href in found), found[:5]
