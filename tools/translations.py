"""Translations of the chapters: extract, apply, sync code from English, report freshness.

Every chapter lives in `chapters/en/` and, translated, in `chapters/<lang>/` under
the same file name. A translation has the same cells as the English notebook, in
the same order, with the same cell ids and metadata. Markdown cells are
translated; code cells are the English code, whose comments may be translated.
The first two cells (header and setup) are written by `tools/headers.py`.

Each translation records, in ``metadata.distcourse.translation``, the
fingerprint of the English prose it was translated from (``english_prose``: a
hash of the English markdown cells and code comments) and of each cell's prose
(``english_cells``). When the English prose changes, the translation is *behind*:
the book shows it on the page and on the status page, ``status`` names the cells
whose English changed, and ``apply`` refuses a work file that leaves one of them
as it was; the tests do not fail. Code drift does fail the tests.

    python tools/translations.py extract ru 03            # work file for a translator (stdout)
    python tools/translations.py apply ru work/03.txt     # build chapters/ru/03-*.ipynb from it
    python tools/translations.py sync                     # copy English code into every translation
    python tools/translations.py status [--check]         # chapter x language: current / behind / missing

The work file is plain text: one section per cell that needs translating,
introduced by a line ``%%% title``, ``%%% markdown <cell id>`` or
``%%% code <cell id>`` (code cells appear only when they contain comments).
A text format of our own, rather than jupytext, because a translator must see
exactly the cells that carry prose and nothing else, keyed by cell id.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import pathlib
import re
import sys
import tokenize

import nbformat
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import headers  # noqa: E402  (it also makes this checkout's distcourse importable)
from distcourse.runtime import languages  # noqa: E402

TRANSLATED = [lang.code for lang in languages.TRANSLATED]
GLOSSARY = ROOT / "assets" / "glossary.yml"
HEADER, SETUP = 0, 1  # cells written by tools/headers.py
SECTION = re.compile(r"^%%% (title|markdown|code)(?: (\S+))?\s*$", re.M)


# ---------------------------------------------------------------- notebooks


def english_chapters(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    # By stem, so that a chapter in two parts reads in order: 04-ddp before 04-ddp-in-practice.
    return sorted((root / "chapters" / "en").glob("[0-9][0-9]-*.ipynb"), key=lambda p: p.stem)


def chapter(number: str, root: pathlib.Path = ROOT) -> pathlib.Path:
    """The English chapter named by its number ("03") or, for a chapter in several parts,
    by the file name's stem ("04-ddp-in-practice")."""
    chapters = english_chapters(root)
    found = [p for p in chapters if p.stem == number]
    if not found and number.isdigit():
        found = [p for p in chapters if p.name.startswith(f"{int(number):02d}-")]
    if not found:
        raise SystemExit(f"no English chapter {number!r} in chapters/en/")
    if len(found) > 1:
        raise SystemExit(f"chapter {number!r} has several parts; name one: {', '.join(p.stem for p in found)}")
    return found[0]


def translation_of(english: pathlib.Path, lang: str) -> pathlib.Path:
    return english.parents[1] / lang / english.name


def read(path: pathlib.Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def write(nb: nbformat.NotebookNode, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    partial.replace(path)  # readers never see a half-written notebook


# ---------------------------------------------------------------- comments


def split_comments(source: str) -> list[tuple[str, str]]:
    """Each line as (code, comment): the comment starts at its '#', the code is rstripped."""
    lines = source.split("\n")
    comments: dict[int, int] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0] - 1] = tok.start[1]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # not Python that tokenizes: treat every line as code
    return [
        (line[: comments[i]].rstrip(), line[comments[i] :]) if i in comments else (line.rstrip(), "")
        for i, line in enumerate(lines)
    ]


def code_without_comments(source: str) -> str:
    """The code of a cell with comments removed; lines that held only a comment are dropped."""
    return "\n".join(code for code, comment in split_comments(source) if code or not comment).strip("\n")


def comments_of(source: str) -> list[str]:
    return [comment for _, comment in split_comments(source) if comment]


def merge_comments(english: str, translated: str) -> str:
    """English code, with the translated comments kept wherever the code next to them is unchanged.

    An end-of-line comment is kept when its line's code is unchanged; a block of
    comment lines when the code line that follows it (the code it describes) is
    unchanged and the block has as many lines as the English one. A code line
    that occurs several times in a cell is told apart by its occurrence number.
    Every other comment comes from the English cell.
    """

    def anchors(pairs):
        """For each line: the key of the code it belongs to, as (code, occurrence)."""
        seen, keys = {}, []
        for code, _ in pairs:
            stripped = code.strip()
            if stripped:
                seen[stripped] = seen.get(stripped, 0) + 1
            keys.append((stripped, seen.get(stripped, 0)) if stripped else None)
        return keys

    def comments(source):
        pairs = split_comments(source)
        keys, found, block = anchors(pairs), {}, []
        for (code, comment), key in zip(pairs, keys):
            if comment and not code:
                block.append(comment)
                continue
            if block:
                found[("above", key)] = block
                block = []
            if comment:
                found[("inline", key)] = [comment]
        if block:
            found[("above", "end")] = block
        return found

    ours = comments(translated)
    pairs = split_comments(english)
    keys = anchors(pairs)
    lines = english.split("\n")
    out = list(lines)
    block: list[int] = []
    for i, ((code, comment), key) in enumerate(zip(pairs + [("", "")], keys + [None])):
        if i < len(pairs) and comment and not code:
            block.append(i)
            continue
        if block:
            kept = ours.get(("above", key if i < len(pairs) else "end"))
            if kept and len(kept) == len(block):
                for j, text in zip(block, kept):
                    out[j] = lines[j][: len(lines[j]) - len(lines[j].lstrip())] + text
            block = []
        if i < len(pairs) and comment:
            kept = ours.get(("inline", key))
            if kept:
                out[i] = lines[i][: lines[i].index(comment)] + kept[0]
    return "\n".join(out)


# ---------------------------------------------------------------- prose fingerprint


def prose(nb: nbformat.NotebookNode) -> list[str]:
    """What a translator translates: the title, the markdown cells, the code comments."""
    parts = [nb.cells[HEADER].source.splitlines()[0]]
    for i, cell in enumerate(nb.cells):
        if i in (HEADER, SETUP):
            continue
        if cell.cell_type == "markdown":
            parts.append(cell.source)
        elif cell.cell_type == "code":
            parts.extend(comments_of(cell.source))
    return parts


def prose_fingerprint(nb: nbformat.NotebookNode) -> str:
    digest = hashlib.sha256("\x00".join(prose(nb)).encode("utf-8")).hexdigest()
    return digest[:12]


def cell_prose(nb: nbformat.NotebookNode) -> dict[str, str]:
    """The prose of each cell that has some, by cell id ("title" for the chapter's title)."""
    parts = {"title": nb.cells[HEADER].source.splitlines()[0]}
    for i, cell in enumerate(nb.cells):
        if i in (HEADER, SETUP):
            continue
        if cell.cell_type == "markdown":
            parts[cell.get("id")] = cell.source
        elif cell.cell_type == "code" and comments_of(cell.source):
            parts[cell.get("id")] = "\n".join(comments_of(cell.source))
    return parts


def cell_fingerprints(nb: nbformat.NotebookNode) -> dict[str, str]:
    """A short hash of each cell's prose, by cell id: what a translation records of the English
    it follows, so that a later change names the cells it touched (``changed_cells``)."""
    return {key: hashlib.sha256(text.encode("utf-8")).hexdigest()[:8] for key, text in cell_prose(nb).items()}


def recorded(nb: nbformat.NotebookNode) -> dict:
    return nb.metadata.get("distcourse", {}).get("translation", {})


def changed_cells(english: nbformat.NotebookNode, translated: nbformat.NotebookNode) -> list[str] | None:
    """Ids of the cells whose English prose changed since the translation recorded it; None when the
    translation is behind but records no per-cell fingerprints (then any cell may have changed)."""
    was = recorded(translated)
    if was.get("english_prose") == prose_fingerprint(english):
        return []
    cells = was.get("english_cells")
    if not cells:
        return None
    return [key for key, value in cell_fingerprints(english).items() if cells.get(key) != value]


def record_english(nb: nbformat.NotebookNode, english: nbformat.NotebookNode) -> None:
    """Record that ``nb`` follows the English prose of ``english`` as it is now."""
    meta = nb.metadata.setdefault("distcourse", {}).setdefault("translation", {})
    meta["english_prose"] = prose_fingerprint(english)
    meta["english_cells"] = cell_fingerprints(english)


# ---------------------------------------------------------------- parity


def code_differences(english: nbformat.NotebookNode, translated: nbformat.NotebookNode) -> list[str]:
    """Why the translation's code is not the English code; empty when it is."""
    problems = []
    en_ids = [c.get("id") for c in english.cells]
    tr_ids = [c.get("id") for c in translated.cells]
    if en_ids != tr_ids:
        first = next((i for i, (a, b) in enumerate(zip(en_ids, tr_ids)) if a != b), min(len(en_ids), len(tr_ids)))
        return [
            f"cells differ from the English ones (English has {len(en_ids)} cells, the translation "
            f"{len(tr_ids)}; first difference at cell {first})"
        ]
    for i, (en, tr) in enumerate(zip(english.cells, translated.cells)):
        if en.cell_type != tr.cell_type:
            problems.append(f"cell {i} (id {en.get('id')}): {tr.cell_type} instead of {en.cell_type}")
        elif en.cell_type == "code" and code_without_comments(en.source) != code_without_comments(tr.source):
            problems.append(
                f"cell {i} (id {en.get('id')}): code differs from English (run python tools/translations.py sync)"
            )
        if i not in (HEADER, SETUP) and en.metadata != tr.metadata:
            problems.append(f"cell {i} (id {en.get('id')}): metadata differs from English")
    return problems


# ---------------------------------------------------------------- glossary


def glossary(path: pathlib.Path = GLOSSARY) -> list[dict]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))["terms"]


def _normalize(text: str) -> str:
    return text.lower().replace("ё", "е").replace("-", " ").replace("\u00a0", " ")


def _pattern(term: str, lang: str) -> re.Pattern:
    """A term matches in any grammatical form: in Russian and Portuguese each word of
    four or more letters may change its last two letters (case, number); in Korean
    particles follow the term; in Chinese the term is matched as written."""
    words = _normalize(term).split()
    if lang in ("ru", "pt-BR"):
        parts = [re.escape(w[:-2] if len(w) > 4 else w) + r"\w*" for w in words]
        return re.compile(r"\b" + r"\s+".join(parts))
    return re.compile(r"\s*".join(re.escape(w) for w in words))


CODE_SPAN = re.compile(r"(`+).+?\1", re.S)


def english_uses(term: dict, text: str) -> bool:
    """Whether the English prose uses the term; a code span (`torch.utils.checkpoint`) is a name, not the term."""
    text = CODE_SPAN.sub(" ", text)
    return any(re.search(r"\b" + re.escape(_normalize(m)) + r"\b", _normalize(text)) for m in term["en"])


def missing_terms(
    english: nbformat.NotebookNode, translated: nbformat.NotebookNode, lang: str, terms: list[dict] | None = None
) -> list[str]:
    """Glossary terms the English chapter uses but the translation never writes."""
    en_text, tr_text = "\n".join(prose(english)), _normalize("\n".join(prose(translated)))
    out = []
    for term in glossary() if terms is None else terms:
        accepted = term[lang] if isinstance(term[lang], list) else [term[lang]]
        if english_uses(term, en_text) and not any(_pattern(a, lang).search(tr_text) for a in accepted):
            out.append(f"{term['en'][0]!r} -> {accepted[0]!r}")
    return out


# ---------------------------------------------------------------- figure text


PACKAGE = "package"  # where figure_texts records the texts of the package's own tr() calls


def _tr_literals(source: str) -> list[str]:
    """The string literals passed to ``tr()`` (or ``i18n.tr()``) in Python ``source``."""
    import ast

    return [
        node.args[0].value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "tr")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "tr")
        )
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]


def figure_texts(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
    """Every string literal passed to ``tr()``, with where it is used: the English chapters'
    code cells (by chapter number) and the package's modules, ``code/distcourse/**/*.py``
    (as :data:`PACKAGE`: verdicts, rank output, table headers and axis labels it makes)."""
    found: dict[str, list[str]] = {}

    def add(text: str, where: str) -> None:
        if where not in found.setdefault(text, []):
            found[text].append(where)

    for path in english_chapters(root):
        for cell in read(path).cells:
            if cell.cell_type == "code":
                for text in _tr_literals(cell.source):
                    add(text, path.stem[:2])
    for path in sorted((root / "code" / "distcourse").rglob("*.py")):
        for text in _tr_literals(path.read_text(encoding="utf-8")):
            add(text, PACKAGE)
    return found


# ---------------------------------------------------------------- work files


def extract(english: nbformat.NotebookNode, base: nbformat.NotebookNode | None = None) -> str:
    """The work file for a translator; from ``base`` (an existing translation) when given."""
    source = base or english
    out = ["%%% title", source.cells[HEADER].source.splitlines()[0]]
    for i, cell in enumerate(source.cells):
        if i in (HEADER, SETUP):
            continue
        if cell.cell_type == "markdown" or (cell.cell_type == "code" and comments_of(cell.source)):
            out += [f"%%% {cell.cell_type} {cell.get('id')}", cell.source]
    return "\n".join(out) + "\n"


def parse(text: str) -> tuple[str, dict[str, str]]:
    title, cells = None, {}
    marks = list(SECTION.finditer(text))
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = text[m.end() + 1 : nxt.start() if nxt else len(text)].strip("\n")
        if m.group(1) == "title":
            title = body.strip()
        else:
            cells[m.group(2)] = body
    if not title or not title.startswith("# "):
        raise ValueError("the work file needs a '%%% title' section with the chapter's '# ' title line")
    return title, cells


def apply(
    english_path: pathlib.Path, lang: str, text: str, unchanged: tuple[str, ...] = ()
) -> tuple[pathlib.Path, list[str]]:
    """Build the translation from a work file. Returns its path and any glossary gaps.

    Raises ValueError, and writes nothing, if a cell is unknown or its code differs, or if the
    English of a cell changed since the existing translation was made and the work file leaves
    that cell's translation as it was (a translation would be marked current while it still says
    the old English). ``unchanged`` names such cells after a translator checked that they
    already say what the new English says ("all": every one of them)."""
    english = read(english_path)
    title, cells = parse(text)
    out = translation_of(english_path, lang)
    if out.exists():
        stale = untouched_changes(english, read(out), title, cells)
        stale = [] if "all" in unchanged else [key for key in stale if key not in unchanged]
        if stale:
            raise ValueError(
                f"the English of cell(s) {', '.join(stale)} changed since {out.name} was translated, and the "
                "work file keeps their old translation: translate them, or, if they already say what the new "
                "English says, name them with --unchanged"
            )
    nb = copy.deepcopy(english)
    by_id = {c.get("id"): c for c in nb.cells}
    unknown = set(cells) - set(by_id)
    if unknown:
        raise ValueError(f"cell ids not in the English chapter: {', '.join(sorted(unknown))}")
    for cell_id, body in cells.items():
        cell = by_id[cell_id]
        if cell.cell_type == "code" and code_without_comments(body) != code_without_comments(cell.source):
            raise ValueError(f"code cell {cell_id}: only comments may change in a code cell")
        if cell.cell_type == "code" and cell.source.endswith("\n") and not body.endswith("\n"):
            body += "\n"  # the work file's sections lose their last newline; the code keeps the English one
        cell.source = body
    nb.cells[HEADER].source = title + "\n"
    nb.metadata.setdefault("distcourse", {})["translation"] = {
        "language": lang,
        "english": f"chapters/en/{english_path.name}",
    }
    record_english(nb, english)
    write(nb, out)
    headers.update(out, english_path.parents[2])  # its setup cell and language links
    return out, missing_terms(english, read(out), lang)


def untouched_changes(
    english: nbformat.NotebookNode, existing: nbformat.NotebookNode, title: str, cells: dict[str, str]
) -> list[str]:
    """Cells whose English changed since ``existing`` was translated and whose translation the work
    file (``title``, ``cells``) leaves as it was."""
    changed = changed_cells(english, existing)
    old = cell_prose(existing)
    if changed is None:  # no per-cell record: every cell may have changed
        changed = list(old)
    kinds = {c.get("id"): c.cell_type for c in english.cells}
    new = {"title": title}
    for key, body in cells.items():
        new[key] = "\n".join(comments_of(body)) if kinds.get(key) == "code" else body
    # A cell the English gained and the work file does not translate would stay in English.
    return [key for key in changed if (new.get(key, old.get(key)) == old[key] if key in old else key not in new)]


def sync(translated_path: pathlib.Path, root: pathlib.Path = ROOT) -> bool:
    """Make the translation's code cells the English ones, keeping translated comments.

    Cells are matched by id. A cell the English gained is copied in English (the
    prose fingerprint stays, so the status page shows the chapter as behind)."""
    english = read(root / "chapters" / "en" / translated_path.name)
    translated = read(translated_path)
    old = {c.get("id"): c for c in translated.cells}
    cells = []
    for i, en in enumerate(english.cells):
        cell = copy.deepcopy(en)
        mine = old.get(en.get("id"))
        if mine is not None and i != SETUP:  # the setup cell is the same everywhere
            if en.cell_type == "markdown":
                cell.source = mine.source
            elif en.cell_type == "code":
                cell.source = merge_comments(en.source, mine.source)
        cells.append(cell)
    before = nbformat.writes(translated)
    translated.cells = cells
    write(translated, translated_path)
    headers.update(translated_path, root)
    return nbformat.writes(read(translated_path)) != before


# ---------------------------------------------------------------- status


def status(root: pathlib.Path = ROOT) -> list[dict]:
    """One row per chapter and language: current, behind (English prose changed) or missing."""
    rows = []
    for english_path in english_chapters(root):
        english = read(english_path)
        now = prose_fingerprint(english)
        for lang in TRANSLATED:
            path = translation_of(english_path, lang)
            row = {"chapter": english_path.stem, "language": lang, "path": path, "english_prose": now}
            if not path.exists():
                row.update(state="missing", code=[])
            else:
                nb = read(path)
                was = recorded(nb).get("english_prose")
                row.update(
                    state="current" if was == now else "behind",
                    translated_from=was,
                    code=code_differences(english, nb),
                    cells=changed_cells(english, nb),
                )
            rows.append(row)
    return rows


def cmd_extract(args) -> int:
    english_path = chapter(args.chapter)
    existing = translation_of(english_path, args.lang)
    base = read(existing) if args.lang != "en" and existing.exists() else None
    sys.stdout.write(extract(read(english_path), base))
    return 0


def cmd_apply(args) -> int:
    number = args.chapter or re.match(r"\d+", args.workfile.name).group(0)
    try:
        out, gaps = apply(chapter(number), args.lang, args.workfile.read_text(encoding="utf-8"), tuple(args.unchanged))
    except ValueError as error:
        print(f"not applied: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out.relative_to(ROOT)}")
    for gap in gaps:
        english, translated = gap.split(" -> ")
        print(f"glossary: the English uses {english}, the translation never writes {translated}")
    return 1 if gaps else 0


def cmd_sync(args) -> int:
    paths = args.paths or [
        p for lang in TRANSLATED for p in sorted((ROOT / "chapters" / lang).glob("[0-9][0-9]-*.ipynb"))
    ]
    for path in paths:
        if sync(path.resolve()):
            print(f"updated {path.resolve().relative_to(ROOT)}")
    return 0


def mark_current(english_path: pathlib.Path, lang: str, cells: tuple[str, ...]) -> list[str]:
    """Record that the translation into ``lang`` follows the current English of ``cells`` (cell ids
    from ``status``; "all": every changed cell) and return the changed cells still not recorded.

    Only the named cells are recorded: a cell whose English changed after the translator looked
    (or that the translator did not carry) stays behind and ``status`` keeps naming it. The whole
    translation is current once no changed cell is left.
    """
    english = read(english_path)
    path = translation_of(english_path, lang)
    nb = read(path)
    now = cell_fingerprints(english)
    changed = changed_cells(english, nb)
    if changed is None:  # no per-cell record: any cell may have changed
        changed = list(now)
    named = changed if "all" in cells else list(cells)
    unknown = [key for key in named if key not in now]
    if unknown:
        raise ValueError(f"{path.relative_to(ROOT)}: no cell with prose has the id(s) {', '.join(unknown)}")
    left = [key for key in changed if key not in named]
    if not left:
        record_english(nb, english)
    else:
        meta = nb.metadata.setdefault("distcourse", {}).setdefault("translation", {})
        meta["english_cells"] = {**meta.get("english_cells", {}), **{key: now[key] for key in named}}
    write(nb, path)
    return left


def cmd_mark_current(args) -> int:
    english_path = chapter(args.chapter)
    for lang in args.langs or TRANSLATED:
        try:
            left = mark_current(english_path, lang, tuple(args.cell))
        except ValueError as err:
            print(err, file=sys.stderr)
            return 1
        path = translation_of(english_path, lang).relative_to(ROOT)
        print(f"{path}: " + (f"still behind in cells {', '.join(left)}" if left else "follows the current English"))
    return 0


def cmd_figure_texts(args) -> int:
    from distcourse.runtime import i18n

    try:
        have = i18n.catalog(args.lang)
    except FileNotFoundError:
        have = {}
    for text, used_in in figure_texts().items():
        chapters = [c for c in used_in if c != PACKAGE]
        where = ([f"chapter {', '.join(chapters)}"] if chapters else []) + [PACKAGE] * (PACKAGE in used_in)
        print("# " + ", ".join(where))
        print(yaml.safe_dump({text: have.get(text, "")}, allow_unicode=True, width=1000).rstrip())
    return 0


def cmd_status(args) -> int:
    bad = 0
    for row in status():
        cells = row.get("cells")
        where = "" if row["state"] != "behind" else f" (cells {', '.join(cells)})" if cells else " (cells not recorded)"
        print(f"{row['chapter']:32s} {row['language']:6s} {row['state']}{where}")
        for problem in row["code"]:
            print(f"    code drift: {problem}")
        bad += row["state"] == "missing" or bool(row["code"])
    return 1 if args.check and bad else 0


def parser() -> argparse.ArgumentParser:
    """One subcommand per ``cmd_*`` function above."""
    top = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    chapter_help = "chapter number, e.g. 03, or a part's file stem, e.g. 04-ddp-in-practice"
    p = sub.add_parser("extract", help="print the work file of a chapter")
    p.add_argument("lang", choices=languages.CODES)
    p.add_argument("chapter", help=chapter_help)
    p.set_defaults(run=cmd_extract)
    p = sub.add_parser("apply", help="build a translation from a work file")
    p.add_argument("lang", choices=TRANSLATED)
    p.add_argument("workfile", type=pathlib.Path)
    p.add_argument("--chapter", help="chapter number or stem (default: the digits the work file's name starts with)")
    p.add_argument(
        "--unchanged",
        action="append",
        default=[],
        metavar="CELL_ID",
        help="a cell whose English changed but whose translation already says the same (repeatable; 'all': every one)",
    )
    p.set_defaults(run=cmd_apply)
    p = sub.add_parser("sync", help="copy the English code cells into every translation")
    p.add_argument("paths", nargs="*", type=pathlib.Path)
    p.set_defaults(run=cmd_sync)
    p = sub.add_parser(
        "mark-current",
        help="record that the named cells of translations follow the current English prose "
        "(after carrying an English edit into them)",
    )
    p.add_argument("chapter", help=chapter_help)
    p.add_argument("langs", nargs="*", help="default: every translation")
    p.add_argument(
        "--cell",
        action="append",
        required=True,
        metavar="CELL_ID",
        help="a cell whose translation now says what its English says (repeatable; ids from status; "
        "'all': every changed cell)",
    )
    p.set_defaults(run=cmd_mark_current)
    p = sub.add_parser("figure-texts", help="print a figure-text catalog template (YAML) for a language")
    p.add_argument("lang", choices=TRANSLATED)
    p.set_defaults(run=cmd_figure_texts)
    p = sub.add_parser("status", help="chapter x language: current, behind or missing")
    p.add_argument("--check", action="store_true", help="exit 1 on a missing translation or code drift")
    p.set_defaults(run=cmd_status)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
