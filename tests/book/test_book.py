"""The book builds, and its executed pages follow changes in the code they import.

Both tests go through tools/build_book.py, the same entry point as `make book`.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

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


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """The whole book (six languages) built without execution; (html folder, build output, seconds)."""
    tmp_path = tmp_path_factory.mktemp("book")
    # The main build's output and cache must survive a test build.
    main_build = [REPO_ROOT / "_build/html/index.html", REPO_ROOT / "_build/.jupyter_cache"]
    before = [mtime(p) for p in main_build]
    stdout, seconds = build_book("--no-execute", "--output", tmp_path)
    assert [mtime(p) for p in main_build] == before
    # Execution off means the execution cache is never even opened.
    assert not (tmp_path / "_build" / ".jupyter_cache").exists()
    return tmp_path / "_build" / "html", stdout, seconds


def test_book_builds_without_execution(book):
    html, stdout, seconds = book
    print(f"\nno-execute build of the book: {seconds:.1f} s")

    assert stdout.splitlines()[-1] == str(html / "index.html")
    assert (html / "index.html").is_file()
    assert (html / "chapters/en/01-dataloader-workers.html").is_file()
    assert seconds <= 60, f"no-execute build took {seconds:.1f} s, budget is 60 s"

    # No page loads a script or a style sheet from the network (MathJax comes from _static).
    for page in html.rglob("*.html"):
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?:[^"]+)"', page.read_text(encoding="utf-8"))
        assert not remote, (page.relative_to(html), remote)
    assert (html / "_static" / "mathjax" / "tex-mml-chtml.js").is_file()

    # Every chapter page: the theme's launch button and the header badge open this very
    # notebook in Colab (both come from the repository URL in _config.yml).
    import headers

    for notebook in headers.notebooks(REPO_ROOT):
        page = (html / notebook.relative_to(REPO_ROOT).with_suffix(".html")).read_text(encoding="utf-8")
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
"""


def write_tiny_book(root: Path):
    (root / "_config.yml").write_text(TINY_CONFIG)
    (root / "_toc.yml").write_text(TINY_TOC)
    (root / "index.md").write_text("# Tiny book\n\nOne executed page.\n")
    (root / "code").mkdir()
    (root / "code" / "marker.py").write_text('VALUE = "first-value"\n')
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Page"),
        # Notebooks run in their own folder (the book root here), so "code" resolves.
        nbformat.v4.new_code_cell('import sys; sys.path.insert(0, "code"); import marker; print(marker.VALUE)'),
        # Shows which interpreter ran the kernel: it must be the one running the tests.
        nbformat.v4.new_code_cell('print("kernel-prefix:", sys.prefix)'),
    ]
    nbformat.write(nb, root / "page.ipynb")


def test_cache_follows_code_changes(tmp_path):
    write_tiny_book(tmp_path)
    page = tmp_path / "_build" / "html" / "page.html"

    stdout, first = build_book("--root", tmp_path)
    # Progress: the notebook, n of N and its seconds, then the totals.
    assert re.search(r"^\[ 1/1\] page\.ipynb  executing\.\.\. \d+\.\d s$", stdout, flags=re.M), stdout
    assert re.search(r"^Notebooks: 1 executed in \d+\.\d s, 0 from the cache$", stdout, flags=re.M), stdout
    html = page.read_text()
    assert "first-value" in html
    assert f"kernel-prefix: {sys.prefix}" in html

    # The notebook is unchanged, so only the fingerprint of code/ can trigger this rerun.
    (tmp_path / "code" / "marker.py").write_text('VALUE = "second-value"\n')
    _, second = build_book("--root", tmp_path)
    html = page.read_text()
    assert "second-value" in html
    assert "first-value" not in html

    stdout, unchanged = build_book("--root", tmp_path)
    print(
        f"\ntiny book: first build {first:.1f} s, after code change {second:.1f} s, no-change rebuild {unchanged:.1f} s"
    )
    assert "second-value" in page.read_text()
    assert "--all" not in stdout, "nothing changed, the rebuild should be incremental"
    assert unchanged <= 10, f"no-change rebuild took {unchanged:.1f} s, target is 10 s"


# ---------------------------------------------------------------- six languages in one book

LANGUAGE_LINK_CASES = [
    ("en", "ru"),
    ("ru", "zh-TW"),
    ("zh-CN", "ko"),
    ("ko", "pt-BR"),
    ("pt-BR", "zh-CN"),
    ("zh-TW", "en"),
]


def test_translated_pages_say_they_are_translations_and_are_current(book):
    html, _, _ = book
    import translations

    for english in translations.english_chapters(REPO_ROOT):
        for lang in translations.TRANSLATED:
            page = (html / "chapters" / lang / english.with_suffix(".html").name).read_text(encoding="utf-8")
            page = page[page.index("<article") :]  # the chapter itself, without the theme's sidebars
            notice = page.find("translation-current")
            assert notice != -1, f"{lang}/{english.stem}: no 'translation is current' notice"
            assert "translation-behind" not in page
            assert notice < page.find("<h2"), "the notice is not near the top of the page"


def test_status_page_lists_every_translation_as_current(book):
    html, _, _ = book
    page = (html / "translation-status.html").read_text(encoding="utf-8")
    assert page.count("✅ current") == 40, page.count("✅ current")
    assert "40 current, 0 behind, 0 missing" in page
    glossary = (html / "glossary.html").read_text(encoding="utf-8")
    assert "分散式訓練" in glossary and "распределённое обучение" in glossary


def test_part_captions_are_in_their_own_language(book):
    html, _, _ = book
    sidebar = (html / "index.html").read_text(encoding="utf-8")
    for name in ["English", "Русский", "简体中文", "繁體中文", "Português (Brasil)", "한국어"]:
        assert re.search(r'class="caption-text">' + re.escape(name) + "<", sidebar), name


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from cdp import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("no chromium (tools/install_browser.sh installs it when run as root)")
    b = Browser(str(tmp_path_factory.mktemp("chromium-profile")))
    yield b
    b.close()


@pytest.mark.parametrize("start, target", LANGUAGE_LINK_CASES, ids=[f"{a}-to-{b}" for a, b in LANGUAGE_LINK_CASES])
def test_language_link_opens_the_same_chapter(book, browser, start, target):
    html, _, _ = book
    import headers

    chapter = "03-collectives.html"
    browser.open((html / "chapters" / start / chapter).as_uri())
    name = headers.LANGUAGES[target]
    clicked = browser.evaluate(
        f"(() => {{ const a = [...document.querySelectorAll('article a')].find(a => a.textContent.trim() === {name!r});"
        " if (!a) return null; a.click(); return a.getAttribute('href'); })()"
    )
    assert clicked == f"../{target}/{chapter}", clicked
    landed = browser.wait_for(
        f"location.href.endsWith('/chapters/{target}/{chapter}') && "
        "document.readyState === 'complete' && document.querySelector('h1').textContent"
    )
    title = nbformat.read(REPO_ROOT / "chapters" / target / "03-collectives.ipynb", as_version=4).cells[0].source
    assert landed.strip().rstrip("#").strip() == title.splitlines()[0].lstrip("# ").strip()


SEARCHES = [
    ("分布式训练", "chapters/zh-CN/"),
    ("分散式訓練", "chapters/zh-TW/"),
    ("분산", "chapters/ko/"),
    ("распределённое", "chapters/ru/"),
    ("treinamento", "chapters/pt-BR/"),
    ("all_reduce", "chapters/en/"),
]


@pytest.mark.parametrize("query, folder", SEARCHES, ids=[f for _, f in SEARCHES])
def test_search_finds_pages_in_every_language(book, browser, query, folder):
    html, _, _ = book
    browser.open((html / "search.html").as_uri() + "?q=" + query)
    found = browser.wait_for(
        "(() => { const r = [...document.querySelectorAll('#search-results li a')];"
        " return document.querySelector('#search-results p')?.textContent && r.map(a => a.href); })()",
        timeout=30,
    )
    assert any(folder in href for href in found), (query, found[:5])
