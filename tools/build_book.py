#!/usr/bin/env python3
"""Build the course book; the single entry point for `make book` and the tests.

    python tools/build_book.py                  # execute (cached) into _build/html
    python tools/build_book.py --no-execute     # render without running, into _build/noexec
    python tools/build_book.py --root DIR       # the same logic for another book

One book per language, the way Sphinx projects publish translations: `_toc.yml` lists
every language as one part (chapters/<code>/...); each becomes a book of its own, built
with Sphinx's `language` set to that language (the theme then labels its interface in it,
`<html lang>` follows, the sidebar and the search index hold that language only), into
_build/html/<code>/. _build/html/index.html, the front door, opens the book of the
browser's language and lists them all;
tools/course_book.py links each page to the same page in the other books. Parts that
are not one language's (the glossary, the translation status) go into every book. A
book whose `_toc.yml` has no language parts is built as one book, as before.

Why this wrapper exists: with `execute_notebooks: cache`, Jupyter Book 1.0.4 keys each
notebook's cached outputs on its code cells only, and Sphinx re-reads only notebooks whose
file changed. An edit to `code/distcourse/*.py` changes neither, so the pages would keep the
outputs of the old code. We therefore fingerprint, per notebook, what its execution reads
outside the notebook (tools/notebook_inputs.py: the modules it imports, transitively, its
language's figure-text catalog, the project's config): when a notebook's fingerprint moves,
its cached outputs are dropped and its page is re-read, so it executes again; the other
notebooks stay cached. Editing `capstone.py` re-executes chapter 12 in six languages, a
Korean catalog edit the Korean pages. A no-change rebuild takes about a second.

One execution serves the tests and the book: `make test` executes every notebook under
nbval, and tools/book_cache.py stores each notebook whose cells all passed in this book's
execution cache (record_execution below), keyed as myst-nb looks it up and stamped with the
fingerprint of its inputs. `make book` after `make test` then executes no notebook again and
publishes the very outputs whose asserts passed; on its own it executes what is missing.

Progress: Sphinx's own output goes to _build/build.log (shown from its first problem on
failure); the terminal gets one line per notebook as myst-nb reads it, executed or taken
from the cache: n of N, the notebook, its seconds, and the totals at the end.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
# The venv's own jupyter-book: its kernel then runs on this same interpreter
# (jupyter_client replaces the kernelspec's "python" with sys.executable).
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
# Files besides code/**/*.py whose changes can change what the notebooks print.
INPUT_FILES = ("requirements.txt", "pyproject.toml", "_config.yml")
FINGERPRINT_FILE = ".page-fingerprints.json"  # per notebook: the inputs its page reflects
CACHE_FINGERPRINT_FILE = ".cache-fingerprints.json"  # per notebook: the inputs its cached outputs reflect
# Where a failure shows up in the log: Sphinx warnings/errors and Python tracebacks.
PROBLEM = re.compile(r"WARNING:|ERROR:|CRITICAL:|Exception occurred|Traceback \(most recent")
HEAD_LINES, TAIL_LINES = 100, 40
# Sphinx colours its log even into a file (Jupyter Book never switches colour off).
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def common_inputs(root: Path) -> list[str]:
    """What every notebook's outputs depend on: project config, interpreter, core count."""
    lines = []
    for path in [root / name for name in INPUT_FILES]:
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        lines.append(f"{path.relative_to(root).as_posix()} {digest}")
    # Same code, other interpreter or core count: outputs can differ (e.g. worker counts
    # derived from the cores, version-dependent behaviour), so these count as inputs too.
    lines.append(f"python {sys.version}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines.append(f"cpus {cpus}")
    return lines


def fingerprints(root: Path, notebooks: list[Path] | None = None) -> dict[str, str]:
    """{notebook path relative to root: sha256 of its inputs outside the notebook}, for every
    notebook of the book or for ``notebooks``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import notebook_inputs

    common = common_inputs(root)
    notebooks = book_notebooks(root / "_toc.yml", root) if notebooks is None else notebooks
    return {nb.relative_to(root).as_posix(): notebook_inputs.fingerprint(nb, root, common) for nb in notebooks}


def print_failure(rc: int, log_path: Path) -> None:
    """Print the log from its first problem on (shortened in the middle if long).

    A plain tail is not enough: when a notebook cell fails, the cell's own traceback is
    followed by ~60 lines of Sphinx/click traceback that say nothing about the cause.
    """
    lines = ANSI_ESCAPE.sub("", log_path.read_text(errors="replace")).splitlines()
    first = next((i for i, line in enumerate(lines) if PROBLEM.search(line)), max(0, len(lines) - TAIL_LINES))
    shown = lines[first:]
    if len(shown) > HEAD_LINES + TAIL_LINES:
        skipped = len(shown) - HEAD_LINES - TAIL_LINES
        shown = shown[:HEAD_LINES] + [f"[... {skipped} lines skipped ...]"] + shown[-TAIL_LINES:]
    print(f"\nBuild FAILED (exit code {rc}). Full log: {log_path}", file=sys.stderr)
    print(*shown, sep="\n", file=sys.stderr)


# MathJax 3 for pages with formulas, from package.json (npm ci), served from the book's
# own _static folder so that no page loads a script from a CDN. _config.yml points
# html_static_path and mathjax_path here.
MATHJAX = ("tex-mml-chtml.js", "output/chtml/fonts/woff-v2")
STATIC_VENDOR = Path("_build") / "_static_vendor"


def vendor_mathjax(root: Path) -> None:
    source, target = root / "node_modules" / "mathjax-book" / "es5", root / STATIC_VENDOR / "mathjax"
    target.mkdir(parents=True, exist_ok=True)  # Sphinx warns (an error with -W) if the folder is missing
    if not source.exists():
        print(f"note: {source} is missing (run `npm ci`): formulas will not render", flush=True)
        return
    for part in MATHJAX:
        if (source / part).is_dir():
            shutil.copytree(source / part, target / part, dirs_exist_ok=True)
        else:
            shutil.copy2(source / part, target / part)


def jupyter_book(root: Path, out: Path, config: Path, extra: list, progress=None, toc: Path | None = None) -> int:
    """Run `jupyter-book build`; HTML lands in out/_build/html. Returns its exit code.

    The full log goes to out/_build/build.log; it is shown (from its first problem) only
    on failure.
    """
    log_path = out / "_build" / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(JUPYTER_BOOK),
        "build",
        str(root),
        "--path-output",
        str(out),
        "--config",
        str(config),
        "-W",
        "-n",
        "--keep-going",
        *extra,
    ]
    if toc is not None:
        cmd += ["--toc", str(toc)]
    print(f"$ {' '.join(cmd)}\n  (log: {log_path})", flush=True)
    own_progress = progress is None
    if own_progress:
        progress = Progress(total=len(book_notebooks(toc or root / "_toc.yml", root)))
    # Unbuffered, so that each log line (and so each notebook's progress) arrives when written.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        for line in process.stdout:
            log.write(line)
            progress.line(ANSI_ESCAPE.sub("", line), root)
        rc = process.wait()
    if own_progress:
        progress.summary()
    if rc != 0:
        print_failure(rc, log_path)
    return rc


# myst-nb's log lines, one set per notebook it reads: "<path>.ipynb: <message> [mystnb]".
NB_LOG = re.compile(r"^(?P<path>.+\.ipynb): (?:WARNING: )?(?P<message>.*?) \[mystnb(?:\.\w+)?\]\s*$")


@dataclass
class Progress:
    """Turns myst-nb's log lines into `[ n/N] notebook  seconds` lines, and totals at the end."""

    total: int
    seen: int = 0
    executed: dict = field(default_factory=dict)  # notebook: seconds
    cached: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    started: float = 0.0
    running: bool = False  # a notebook's line is open, waiting for its seconds

    def line(self, text: str, root: Path) -> None:
        match = NB_LOG.match(text.strip())
        if not match:
            return
        path, message = Path(match["path"]), match["message"]
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        if message.startswith("Executing notebook using"):
            self.seen += 1
            self.started, self.running = time.perf_counter(), True
            print(f"[{self.seen:2d}/{self.total}] {name}  executing...", end="", flush=True)
        elif message.startswith("Executed notebook in"):
            self.executed[name], self.running = time.perf_counter() - self.started, False
            print(f" {self.executed[name]:.1f} s", flush=True)
        elif message.startswith("Executing notebook failed"):
            self.failed.append(name)
            self.running = False
            print(f" FAILED after {time.perf_counter() - self.started:.1f} s", flush=True)
        elif message.startswith("Using cached notebook"):
            self.seen += 1
            self.cached.append(name)
            print(f"[{self.seen:2d}/{self.total}] {name}  from the cache", flush=True)

    def summary(self) -> None:
        if self.running:  # the build stopped inside a notebook
            print(f" stopped after {time.perf_counter() - self.started:.1f} s", flush=True)
        if not self.seen:
            return
        seconds = sum(self.executed.values())
        unread = self.total - self.seen
        print(
            f"Notebooks: {len(self.executed)} executed in {seconds:.1f} s, {len(self.cached)} from the cache"
            + (f", {len(self.failed)} failed" if self.failed else "")
            + (f", {unread} unchanged (not re-read)" if unread > 0 else ""),
            flush=True,
        )


def book_notebooks(toc_path: Path, root: Path) -> list:
    """The notebooks a table of contents lists (what an execution can read at most)."""
    toc = yaml.safe_load(toc_path.read_text(encoding="utf8")) or {}
    files, stack = [], [toc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("file") or item.get("root"), str):
                files.append(item.get("file") or item.get("root"))
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend(item)
    paths = [root / (f if f.endswith(".ipynb") else f + ".ipynb") for f in files]
    return sorted({p for p in paths if p.is_file()})


# ------------------------------------------------------------------ one book per language
BOOKS = Path("_build") / "books"  # per language: generated _config.yml, _toc.yml, doctrees, cache


@dataclass
class LanguageBook:
    code: str  # folder under chapters/ (the registry's code)
    config: Path
    toc: Path
    out: Path  # jupyter-book's --path-output: HTML in out/_build/html

    @property
    def html(self) -> Path:
        return self.out / "_build" / "html"


def language_parts(toc: dict) -> tuple[dict, list]:
    """Split the master _toc.yml into {language code: its part} and the shared parts."""
    by_language, shared = {}, []
    for part in toc.get("parts") or []:
        files = [c.get("file", "") for c in part.get("chapters", [])]
        codes = {f.split("/")[1] for f in files if f.startswith("chapters/") and f.count("/") >= 2}
        if len(codes) == 1 and all(f.startswith("chapters/") for f in files):
            by_language[codes.pop()] = part
        else:
            shared.append(part)
    return by_language, shared


def landing_title(root: Path, docname: str) -> str | None:
    """The first heading of a language's landing page: that book's title."""
    path = root / f"{docname}.md"
    if not path.is_file():
        return None
    heading = next((line for line in path.read_text(encoding="utf8").splitlines() if line.startswith("# ")), None)
    return heading[2:].strip() if heading else None


def search_language(code: str) -> str:
    """Sphinx's stemmer where it has one; the course's CJK-aware splitter for zh and ko."""
    return {"en": "en", "ru": "ru", "pt-BR": "pt"}.get(code, "course")


def language_books(root: Path, out: Path, execute: bool) -> list[LanguageBook]:
    """Write each language's _config.yml and _toc.yml under out/_build/books/<code>/.

    Empty when the master _toc.yml has no language parts (then the book is built whole).
    """
    sys.path.insert(0, str(root / "code"))
    from distcourse.runtime import languages

    master_toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf8")) or {}
    by_language, shared = language_parts(master_toc)
    if not by_language:
        return []
    master_config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf8")) or {}
    books = []
    for code, part in by_language.items():
        lang = languages.get(code)
        chapters = [dict(c) for c in part["chapters"]]
        # A translation's landing page is its book's root; English keeps the repository's index.
        landing = f"chapters/{code}/index"
        root_doc = "index" if code == languages.ENGLISH.code else landing
        chapters = [c for c in chapters if c.get("file") != root_doc]
        interface = yaml.safe_load((root / INTERFACE).read_text(encoding="utf8"))
        caption = interface["shared_caption"].get(lang.sphinx)
        shared_parts = [{**p, "caption": caption} if caption and len(shared) == 1 else p for p in shared]
        toc = {
            "format": master_toc.get("format", "jb-book"),
            "root": root_doc,
            "parts": [{**part, "chapters": chapters}, *shared_parts],
        }
        config = yaml.safe_load(yaml.safe_dump(master_config))  # a deep copy
        config["title"] = landing_title(root, root_doc) or config.get("title")
        config.setdefault("execute", {})["execute_notebooks"] = "cache" if execute else "off"
        sphinx = config.setdefault("sphinx", {})
        for name, path in (sphinx.get("local_extensions") or {}).items():
            sphinx["local_extensions"][name] = str((root / path).resolve())
        settings = sphinx.setdefault("config", {})
        settings["language"] = lang.sphinx
        settings["html_search_language"] = search_language(code)
        settings["course_book_language"] = code
        config["author"] = interface["author"].get(lang.sphinx, "")
        settings["locale_dirs"] = [str(compile_interface(interface, lang.sphinx, out / BOOKS / code / "locale"))]
        folder = out / BOOKS / code
        folder.mkdir(parents=True, exist_ok=True)
        book = LanguageBook(code, folder / "_config.yml", folder / "_toc.yml", folder)
        book.config.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False), encoding="utf8")
        book.toc.write_text(yaml.safe_dump(toc, allow_unicode=True, sort_keys=False), encoding="utf8")
        books.append(book)
    return books


INTERFACE = Path("tools") / "book_interface.yml"


def compile_interface(interface: dict, locale: str, folder: Path) -> Path:
    """tools/book_interface.yml's strings for one locale as gettext catalogs (Babel, as Sphinx uses).

    folder/<locale>/LC_MESSAGES/{sphinx,booktheme}.mo; returns folder (a Sphinx locale_dirs entry).
    """
    from babel.messages.catalog import Catalog
    from babel.messages.mofile import write_mo

    messages = folder / locale / "LC_MESSAGES"
    messages.mkdir(parents=True, exist_ok=True)
    for domain in ("sphinx", "booktheme"):
        catalog = Catalog(locale=locale, domain=domain)
        for msgid, texts in interface[domain].items():
            if texts.get(locale):
                catalog.add(msgid, texts[locale])
        with open(messages / f"{domain}.mo", "wb") as f:
            write_mo(f, catalog)
    search_page_catalog(interface, locale, messages)
    return folder.resolve()


def search_page_catalog(interface: dict, locale: str, messages: Path) -> None:
    """Sphinx's JavaScript catalog (sphinx.js) for the search page, with its empty entries filled.

    The search page's JavaScript reads translations from sphinx.js, not from the .mo files, and
    Sphinx takes the first sphinx.js it finds in locale_dirs before its own. Its packaged
    Russian catalog translates "Search finished, found ..." as "", so a Russian reader saw an
    empty result line. This copy fills such entries from book_interface.yml's "sphinx" domain
    and drops the rest, which then fall back to English instead of to nothing.
    """
    import sphinx

    packaged = Path(sphinx.__file__).parent / "locale" / locale / "LC_MESSAGES" / "sphinx.js"
    if not packaged.is_file():
        return
    text = packaged.read_text(encoding="utf-8")
    head, body = text.split("(", 1)
    catalog = json.loads(body[: body.rindex(")")])
    for msgid, translated in list(catalog["messages"].items()):
        if translated and (not isinstance(translated, list) or all(translated)):
            continue
        fill = interface["sphinx"].get(msgid, {}).get(locale)
        if fill:
            catalog["messages"][msgid] = fill
        else:
            del catalog["messages"][msgid]
    (messages / "sphinx.js").write_text(
        f"{head}({json.dumps(catalog, ensure_ascii=False, indent=1)});\n", encoding="utf-8"
    )


FRONT_DOOR = Path("tools") / "book_templates" / "front-door.html"


def write_front_door(root: Path, html: Path, books: list[LanguageBook]) -> None:
    """_build/html/index.html: the course's front door, in the theme's look.

    One entry per book: the language's name for itself, the book's title and one sentence on
    what the course is, each in that language (tools/book_interface.yml: front_door). Its
    script opens the book of the browser's language on a first visit; the template says when
    it does not.
    """
    import jinja2

    sys.path.insert(0, str(root / "code"))
    from distcourse.runtime import languages

    interface = yaml.safe_load((root / INTERFACE).read_text(encoding="utf8"))
    words = interface["front_door"]
    entries = []
    for book in books:
        lang = languages.get(book.code)
        entries.append(
            {
                "code": book.code,
                "name": lang.name,
                "html": lang.html,
                "href": f"{book.code}/index.html",
                "title": yaml.safe_load(book.config.read_text(encoding="utf8")).get("title", ""),
                "sentence": words["sentence"].get(lang.sphinx, ""),
                "choose": words["choose"].get(lang.sphinx, ""),
            }
        )
    english = next((b for b in books if b.code == languages.ENGLISH.code), books[0])
    template = jinja2.Environment(autoescape=True, keep_trailing_newline=True).from_string(
        (root / FRONT_DOOR).read_text(encoding="utf8")
    )
    page = template.render(
        title=yaml.safe_load((root / "_config.yml").read_text(encoding="utf8")).get("title", ""),
        description=next((e["sentence"] for e in entries if e["code"] == english.code), ""),
        books=entries,
        hrefs={entry["code"]: entry["href"] for entry in entries},
        # The theme's style sheets, from a book that ships them (no copy, no network).
        static=f"{english.code}/_static",
    )
    (html / "index.html").write_text(page, encoding="utf8")


def publish(books: list[LanguageBook], html: Path, root: Path) -> None:
    """Copy each language's HTML to html/<code>/ and write the front door at html/index.html."""
    html.mkdir(parents=True, exist_ok=True)
    for book in books:
        target = html / book.code
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(book.html, target)
    write_front_door(root, html, books)


def build_languages(root: Path, out: Path, execute: bool, extra: list) -> int | None:
    """Build every language's book into out/_build/html/<code>/; None if there are none."""
    books = language_books(root, out, execute)
    if not books:
        return None
    vendor_mathjax(root)
    progress = Progress(total=sum(len(book_notebooks(book.toc, root)) for book in books))

    def build(numbered):
        n, book = numbered
        print(f"--- book {n}/{len(books)}: {book.code}", flush=True)
        return book.code, jupyter_book(root, book.out, book.config, extra, progress, book.toc)

    # Without execution a build is one busy Python process: two at a time use both cores of
    # a small machine. Executing books run one at a time, so that each notebook's ranks have
    # the machine to themselves (and its progress line stays whole). With every notebook in
    # the cache (after `make test`) nothing executes: two at a time again.
    to_execute = execute and any(not_cached(root, book) for book in books)
    jobs = 1 if to_execute else min(2, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        failed = [code for code, rc in pool.map(build, enumerate(books, 1)) if rc != 0]
    progress.summary()
    if failed:
        print(f"Books that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    publish(books, out / "_build" / "html", root)
    return 0


def not_cached(root: Path, book: LanguageBook) -> list[Path]:
    """The notebooks of ``book`` that its build would execute: those without outputs in its cache."""
    import nbformat
    from jupyter_cache import get_cache

    named = (yaml.safe_load(book.config.read_text(encoding="utf8")).get("execute") or {}).get("cache")
    folder = (root / named).resolve() if named else book.out / "_build" / ".jupyter_cache"
    cache = get_cache(folder) if folder.is_dir() else None
    missing = []
    for notebook in book_notebooks(book.toc, root):
        try:
            cache.match_cache_notebook(nbformat.read(notebook, as_version=4))
        except (AttributeError, KeyError):  # no cache yet, or no match
            missing.append(notebook)
    return missing


def read_stamps(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_stamps(path: Path, stamps: dict) -> None:
    """Replace the stamp file whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(stamps, indent=1, sort_keys=True) + "\n")
    partial.replace(path)


# ------------------------------------------------------------------ executions from the tests


def book_root_of(notebook: Path) -> Path | None:
    """The book (a folder with _config.yml and _toc.yml) whose table of contents lists ``notebook``."""
    notebook = notebook.resolve()
    for folder in notebook.parents:
        if (folder / "_toc.yml").is_file() and (folder / "_config.yml").is_file():
            return folder if notebook in book_notebooks(folder / "_toc.yml", folder) else None
    return None


def part_files(part) -> set[str]:
    """The documents a part (or any piece of a table of contents) lists, without suffixes."""
    found = set()
    if isinstance(part, dict):
        if isinstance(part.get("file"), str):
            found.add(part["file"].removesuffix(".ipynb"))
        for value in part.values():
            found |= part_files(value) if isinstance(value, (dict, list)) else set()
    elif isinstance(part, list):
        for value in part:
            found |= part_files(value)
    return found


def execution_caches(root: Path, notebook: Path) -> list[Path]:
    """Where the book looks ``notebook``'s outputs up: myst-nb's cache of each book that lists it.

    myst-nb's cache is <jupyter-book's --path-output>/_build/.jupyter_cache unless _config.yml
    names one: with language books, _build/books/<code>/_build/.jupyter_cache of the notebook's
    language (every language's for a shared part), else _build/.jupyter_cache.
    """
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf8")) or {}
    if (config.get("execute") or {}).get("cache"):
        return [(root / config["execute"]["cache"]).resolve()]
    by_language, shared = language_parts(yaml.safe_load((root / "_toc.yml").read_text(encoding="utf8")) or {})
    if not by_language:
        return [root / "_build" / ".jupyter_cache"]
    name = notebook.resolve().relative_to(root).with_suffix("").as_posix()
    codes = [code for code, part in by_language.items() if name in part_files(part)]
    if name in part_files(shared):
        codes = list(by_language)
    return [root / BOOKS / code / "_build" / ".jupyter_cache" for code in codes]


def record_execution(root: Path, notebook: Path, executed, seconds: float, inputs: str) -> list[Path]:
    """Store ``executed`` (``notebook`` with the outputs of a run whose cells all passed) as the
    book's execution of it; returns the caches written.

    Keyed as myst-nb looks a notebook up (jupyter-cache's hash of the code cells' sources and
    metadata, and the kernelspec), under the notebook's resolved path, with the run's seconds.
    ``inputs`` is the notebook's fingerprint (fingerprints()) when the run started and ended:
    build_executed() then keeps these outputs while the inputs stay the same. The notebook's
    page stamp is dropped, so the next build re-reads the page and shows this execution.
    """
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    root, notebook = root.resolve(), notebook.resolve()
    caches = execution_caches(root, notebook)
    for folder in caches:
        bundle = CacheBundleIn(executed, str(notebook), data={"execution_seconds": seconds})
        get_cache(folder).cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
    name, build = notebook.relative_to(root).as_posix(), root / "_build"
    write_stamps(build / CACHE_FINGERPRINT_FILE, {**read_stamps(build / CACHE_FINGERPRINT_FILE), name: inputs})
    pages = read_stamps(build / FINGERPRINT_FILE)
    if pages.pop(name, None) is not None:
        write_stamps(build / FINGERPRINT_FILE, pages)
    return caches


def drop_cached(root: Path, stale: list[str]) -> None:
    """Remove the cached outputs of ``stale`` notebooks from every execution cache of the book."""
    from jupyter_cache import get_cache

    paths = {str((root / name).resolve()) for name in stale}
    caches = [root / "_build" / ".jupyter_cache", *(root / BOOKS).glob("*/_build/.jupyter_cache")]
    for folder in caches:
        if not folder.is_dir():
            continue
        cache = get_cache(folder)
        for record in cache.list_cache_records():
            if record.uri in paths:
                cache.remove_cache(record.pk)


def build_executed(root: Path) -> int:
    """Cached execution into root/_build/html; a notebook whose inputs changed executes again.

    Two stamps per notebook, because the cache and the pages go stale separately:
      _build/.page-fingerprints.json    inputs each rendered page reflects; written only
                                        after a successful build
      _build/.cache-fingerprints.json   inputs each notebook's cached outputs were made with
    After a failed build (say, one broken cross-reference) the cache already holds outputs
    of the current code, so the retry re-reads those pages but re-executes nothing cached.
    """
    build = root / "_build"
    build.mkdir(parents=True, exist_ok=True)
    pages_stamp, cache_stamp = build / FINGERPRINT_FILE, build / CACHE_FINGERPRINT_FILE
    new = fingerprints(root)
    cached, pages = read_stamps(cache_stamp), read_stamps(pages_stamp)
    stale_cache = [nb for nb, digest in new.items() if cached.get(nb) != digest]
    if stale_cache:
        print(f"Inputs changed for {len(stale_cache)} of {len(new)} notebooks: dropping their cached outputs.")
        # jupyter-cache keys on code cells only; it would serve outputs of the old code.
        drop_cached(root, stale_cache)
        write_stamps(cache_stamp, {**cached, **new})
    stale_pages = [nb for nb, digest in new.items() if pages.get(nb) != digest]
    if stale_pages:
        print(f"Re-reading {len(stale_pages)} pages whose inputs changed.")
        # Sphinx re-reads a page whose source is newer than its last read: touch those only.
        for nb in stale_pages:
            (root / nb).touch()
    rc = build_languages(root, root, True, [])
    if rc is None:
        vendor_mathjax(root)
        rc = jupyter_book(root, root, root / "_config.yml", [])
    if rc == 0 and stale_pages:
        write_stamps(pages_stamp, {**pages, **new})
    return rc


def build_unexecuted(root: Path, out: Path) -> int:
    """Render with execution off into out/_build/html.

    Separate output, doctrees and (unused) cache: the main build in _build/html stays as is.
    """
    out.mkdir(parents=True, exist_ok=True)
    rc = build_languages(root, out, False, [])
    if rc is not None:
        return rc
    # Jupyter Book's CLI cannot override single settings, so build from a modified copy of
    # the config. Its only setting resolved relative to the config file's folder is
    # sphinx.local_extensions; make those paths absolute so the copy may live anywhere.
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf8")) or {}
    config.setdefault("execute", {})["execute_notebooks"] = "off"
    local_ext = (config.get("sphinx") or {}).get("local_extensions") or {}
    for name, path in local_ext.items():
        local_ext[name] = str((root / path).resolve())
    config_copy = out / "_config.noexec.yml"
    config_copy.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False), encoding="utf8")
    vendor_mathjax(root)
    return jupyter_book(root, out, config_copy, [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=REPO_ROOT,
        help="book folder with _config.yml and _toc.yml (default: this repository)",
    )
    parser.add_argument(
        "--no-execute", action="store_true", help="do not run notebooks; build into --output instead of _build/html"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="with --no-execute: output folder (default: ROOT/_build/noexec); HTML goes to OUTPUT/_build/html",
    )
    args = parser.parse_args()
    root = args.root.resolve()
    if args.output and not args.no_execute:
        parser.error("--output only applies to --no-execute")

    start = time.perf_counter()
    if args.no_execute:
        out = (args.output or root / "_build" / "noexec").resolve()
        rc = build_unexecuted(root, out)
    else:
        out = root
        rc = build_executed(root)
    if rc == 0:
        print(f"Built in {time.perf_counter() - start:.1f} s")
        print(out / "_build" / "html" / "index.html")
    return rc


if __name__ == "__main__":
    sys.exit(main())
