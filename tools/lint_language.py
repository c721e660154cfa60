#!/usr/bin/env python3
"""A language lint: no English on a translated page, one term per concept, each language's typography.

    python tools/lint_language.py                    # the whole repository; exit 1 on any finding
    python tools/lint_language.py --rule terms --lang pt-BR
    python tools/lint_language.py --summary          # counts per rule and language
    python tools/lint_language.py --rule outputs _build/books/ru/_build/jupyter_execute   # executed notebooks

One line per finding, ``path:cell N: rule: message`` (``path:line N`` in catalogs and Python files).
The rules:

code        an English sentence that reaches the reader without ``tr()``: a string literal (f-strings:
            their constant parts) that flows into ``print``/``say``, a table or a figure call, in
            ``code/distcourse/**/*.py`` and in the English chapters' code cells (the translations run the
            same code). "English" means at least two English words (one in figure text), not counting
            identifiers, API and collective names, units and format fields (``assets/terms.yml``: allow).
terms       a rendering the course does not use, per language (``assets/terms.yml``), in the
            translated chapters' markdown and code comments and in ``code/distcourse/locale/<lang>.yml``.
typography  each language's conventions in prose (markdown minus code, math, URLs, HTML and link targets):
            ru no-break spaces between a number and its unit and inside grouped numbers, « » quotes;
            zh-CN and zh-TW full-width punctuation next to Han characters and no line break between two Han
            characters (the browser renders it as a space); pt-BR decimal commas and thousands dots; ko and
            Chinese ``10%`` without a space; ko no line break between a word and its gloss in parentheses
            (``이벤트\n(`Event`)는`` renders as ``이벤트 (…)는``); every language: emphasis that CommonMark
            leaves unclosed (the page shows literal ``**``: ``**`code`**는``), found by rendering with
            markdown-it-py, MyST's parser.
outputs     an English sentence in the outputs of a translated notebook: a line that shows a string the
            course itself can print (a literal of the package or of an English chapter's code, two English
            words or more, tr()'s argument included: printed in English, its catalog entry is missing).
            What torch, gloo or Python print (errors, warnings, logs) may be quoted in any language. The
            committed notebooks carry no outputs: CI checks them as nbval executes the translated chapters
            (the hook at the end of conftest.py calls :func:`check_nbval_item`; no notebook runs twice), and
            this command checks executed notebooks given as paths (e.g. the book build's jupyter_execute).
comments    a code comment of a translated chapter left as the English chapter has it, when it is a
            sentence (four plain words or more, little else): a comment the English gained after the
            translation was made ("translations.py sync" copies new lines in English). Code, commands
            and quoted messages in comments may stay as they are.
particles   ko: the particle after code or a Latin word (은/는, 이/가, 을/를, 과/와, 으로/로, 이라/라 ...) chosen
            by how the word is read, not spelled: `set_epoch`은 (셋 에폭), `DataLoader`는, `NCCL`로 (니클: ㄹ
            takes 로); an expression by its last word. Readings: ``assets/terms.yml`` (particles), then a
            spelling rule that answers only when sure (-m, -n, -ng, -l; -k/-t/-p after a consonant ...).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import io
import json
import re
import sys
import time
import tokenize
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TERMS = ROOT / "assets" / "terms.yml"
CHAPTERS = ROOT / "chapters"
PACKAGE = ROOT / "code" / "distcourse"
LOCALE = PACKAGE / "locale"
RULES = ("code", "terms", "typography", "outputs", "particles", "comments")
SETUP = 1  # the setup cell, written by tools/headers.py: its code and comments stay English by design

# Placeholders for what prose checks must not read: a code span, a math span.
CODE, MATH = "\ue000", "\ue001"
HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
CJK_PUNCT = "\u3000-\u303f\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"
HANGUL = "\uac00-\ud7a3\u1100-\u11ff\u3130-\u318f"
SCRIPT = {"ru": "\u0400-\u04ff", "zh-CN": HAN, "zh-TW": HAN, "ko": HANGUL + HAN}


@dataclass(frozen=True, order=True)
class Finding:
    path: str  # relative to the repository root
    where: str  # "cell 12", "line 40"
    rule: str
    lang: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.where}: {self.rule}: {self.message}"


def relative(path: Path) -> str:
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


@cache
def config() -> dict:
    return yaml.safe_load(TERMS.read_text(encoding="utf-8"))


def translated_languages() -> list[str]:
    return sorted(p.name for p in CHAPTERS.iterdir() if p.is_dir() and p.name != "en")


def notebook_language(nb: dict, path: Path) -> str:
    """A translation records its language in its metadata; otherwise the chapters/<lang>/ folder says it."""
    recorded = nb.get("metadata", {}).get("distcourse", {}).get("translation", {}).get("language")
    if recorded:
        return recorded
    parts = Path(path).parts
    return parts[parts.index("chapters") + 1] if "chapters" in parts[:-2] else "en"


def read_notebook(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def source_of(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def is_notes(cell: dict) -> bool:
    return cell.get("metadata", {}).get("slideshow", {}).get("slide_type") == "notes"


# ================================================================ prose


@cache
def markdown_parser():
    from markdown_it import MarkdownIt
    from mdit_py_plugins.dollarmath import dollarmath_plugin

    # CommonMark with tables and $math$: what MyST renders (its other extensions do not change emphasis).
    return MarkdownIt("commonmark").use(dollarmath_plugin).enable("table")


URL = re.compile(r"https?://\S+|www\.\S+")


def prose_blocks(markdown: str) -> list[str]:
    """The text a reader reads, one string per paragraph, heading or table cell.

    Code spans and math become placeholders (CODE, MATH); fenced code, HTML, images and link
    targets are dropped; a line break inside a paragraph stays a "\\n" (it renders as a space).
    """
    blocks = []
    for token in markdown_parser().parse(markdown):
        if token.type != "inline":
            continue
        parts = []
        for child in token.children or []:
            if child.type == "text":
                parts.append(URL.sub(CODE, child.content))
            elif child.type in ("softbreak", "hardbreak"):
                parts.append("\n")
            elif child.type == "code_inline":
                parts.append(CODE)
            elif child.type in ("math_inline", "math_single", "math_inline_double"):
                parts.append(MATH)
        text = "".join(parts)
        if text.strip():
            blocks.append(text)
    return blocks


# A delimiter run left as text that touches a word or a code span: emphasis CommonMark did not close
# ("**`code`**는", "**修复方法：**在"). "2 ** 3", spaced on both sides, is an operator.
EMPHASIS_LEFT = re.compile(r"(?:\*\*|__)(?=\S)|(?<=\S)(?:\*\*|__)|^(?:\*\*|__)$")


def unclosed_emphasis(markdown: str) -> list[str]:
    """Literal ``**``/``__`` left in the rendered text: emphasis CommonMark did not close."""
    found = []
    for token in markdown_parser().parse(markdown):
        for child in token.children or []:
            if child.type == "text" and EMPHASIS_LEFT.search(child.content):
                found.append(token.content.strip().replace("\n", " "))
                break
    return found


def comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment in Python source; the text without its '#'."""
    found = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                found.append((tok.start[0], tok.string.lstrip("#").strip()))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return found


def strip_magics(source: str) -> str:
    """A code cell as Python: IPython's %magics and !shell lines become blank lines (line numbers kept)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


# ================================================================ English words

WORD = re.compile(r"[A-Za-z][A-Za-z'’]*(?:-[A-Za-z]+)*")
BACKTICKS = re.compile(r"(`+).+?\1", re.S)
FIELD = re.compile(r"\{[^{}]*\}|%[-+ #0]*\d*(?:\.\d+)?[sdrfegx%]")
ESCAPES = re.compile(r"\\[nrt]")


@cache
def allowed_words() -> frozenset[str]:
    """Identifiers, API and collective names and units: never counted as English words."""
    allow = config()["allow"]
    return frozenset(w.lower() for group in allow.values() for w in group)


def english_words(text: str, fields: bool = True) -> list[str]:
    """The English words of ``text``: not identifiers (``get_rank()``, ``dp.device_ids``, ``--nnodes``,
    ``key=value``, CamelCase, ACRONYMS, anything with a digit), not allowed names or units; with
    ``fields``, ``text`` is a format string whose ``{fields}`` are not words."""
    text = BACKTICKS.sub(" ", ESCAPES.sub(" ", text))
    text = URL.sub(" ", FIELD.sub(" ", text) if fields else text)
    words = []
    for chunk in text.split():
        chunk = chunk.strip("()[]{}<>:;,.!?\"'«»“”‘’…*|")
        if not chunk or re.search(r"[\d_./\\=#@$<>+*^~|]", chunk) or chunk.startswith("-"):
            continue
        if not WORD.fullmatch(chunk):
            continue
        if re.search(r"[A-Z]", chunk[1:]):  # CamelCase, ACRONYM, mixed: an identifier
            continue
        if chunk.lower() in allowed_words() or (len(chunk) == 1 and chunk not in "aAI"):
            continue
        words.append(chunk)
    return words


# ================================================================ rule: code

PRINTING = {"print", "say", "display", "Markdown", "HTML", "Latex", "write"}  # every positional argument
FIGURE = {
    "set_title": None,
    "set_xlabel": None,
    "set_ylabel": None,
    "set_zlabel": None,
    "suptitle": None,
    "title": None,
    "xlabel": None,
    "ylabel": None,
    "figtext": None,
    "text": None,
    "annotate": 0,
    "set_xticklabels": 0,
    "set_yticklabels": 0,
    "legend": None,
    "bar": 0,  # categorical bars: their labels are tick labels
    "barh": 0,
    "table": None,
}
DISPLAYED_KEYWORDS = set(
    "label labels title xlabel ylabel text s desc postfix unit cellText rowLabels colLabels headers".split()
)
# Callees whose string arguments are keys, patterns or paths, not text shown to the reader.
NOT_SHOWN = set(
    "startswith endswith split rsplit partition rpartition strip lstrip rstrip get pop setdefault "
    "index find rfind count getattr hasattr setattr isinstance sub subn match search fullmatch "
    "findall finditer compile escape Path open getenv encode decode key_line all_json json loads "
    "dumps warn filterwarnings simplefilter".split()
)


def callee(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def is_tr(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and callee(node.func) == "tr"


def field_name(node: ast.expr) -> str | None:
    """The name a field shows: ``x`` for ``{x}``, ``join`` for ``{waits.join}``, ``k`` for ``{d["k"]}``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return None


def joined_text(node: ast.JoinedStr) -> str:
    """An f-string's constant parts, each field as "{}". A label that is the name of the field after it
    (``f"join: {waits.join}"``) is that field's name, an identifier: it is returned in backticks."""
    parts = []
    for i, value in enumerate(node.values):
        if isinstance(value, ast.Constant):
            text = str(value.value)
            after = node.values[i + 1] if i + 1 < len(node.values) else None
            name = field_name(after.value) if isinstance(after, ast.FormattedValue) else None
            if name:
                text = re.sub(rf"(?<![\w`]){re.escape(name)}(\s*[:=]\s*)$", rf"`{name}`\1", text)
            parts.append(text)
        else:
            parts.append("{}")
    return "".join(parts)


class Strings:
    """The string literals whose text can reach the reader through an expression."""

    def __init__(self, assignments: dict[str, list[ast.expr]], through_tr: bool = False):
        self.assignments = assignments
        self.through_tr = through_tr  # also the English inside tr() (what a missing catalog entry shows)

    def shown(self, node: ast.expr | None, seen: frozenset = frozenset()):
        """Yield (node, text) for every literal in ``node`` that ends up in its value.

        ``seen``: the names followed to get here. A value reached through a name is followed
        into string methods and table builders only: ``sample = generate(model, "prompt")``
        shows what generate returns, not its prompt."""
        if node is None:
            return
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                yield node, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node, joined_text(node)
            for value in node.values:
                if isinstance(value, ast.FormattedValue):
                    yield from self.shown(value.value, seen)
        elif isinstance(node, ast.BinOp):
            yield from self.shown(node.left, seen)
            yield from self.shown(node.right, seen)
        elif isinstance(node, ast.IfExp):
            yield from self.shown(node.body, seen)
            yield from self.shown(node.orelse, seen)
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                yield from self.shown(value, seen)
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            for element in node.elts:
                yield from self.shown(element, seen)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                yield from self.shown(key, seen)
                yield from self.shown(value, seen)
        elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            yield from self.shown(node.elt, seen)
        elif isinstance(node, ast.DictComp):
            yield from self.shown(node.key, seen)
            yield from self.shown(node.value, seen)
        elif isinstance(node, ast.Starred):
            yield from self.shown(node.value, seen)
        elif isinstance(node, ast.Subscript):
            if isinstance(node.value, (ast.List, ast.Tuple, ast.Dict)):  # a literal table, indexed
                yield from self.shown(node.value, seen)
        elif isinstance(node, ast.Name):
            if node.id not in seen and len(seen) < 3:
                for value in self.assignments.get(node.id, []):
                    yield from self.shown(value, seen | {node.id})
        elif isinstance(node, ast.Call):
            yield from self.call(node, seen)

    def call(self, node: ast.Call, seen: frozenset):
        name = callee(node.func) or ""
        if name == "tr" and self.through_tr:
            yield from self.shown(node.args[0] if node.args else None, seen)
            return
        if name == "tr" or name in NOT_SHOWN:
            return
        string_method = isinstance(node.func, ast.Attribute) and name in STRING_METHODS
        if seen and not string_method and not re.search("table|markdown", name, re.I):
            return
        arguments = node.args
        if string_method:
            if self.through_tr or not is_tr(node.func.value):
                yield from self.shown(node.func.value, seen)
            arguments = node.args[1:] if name == "replace" else node.args
        for argument in arguments:
            yield from self.shown(argument, seen)
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in DISPLAYED_KEYWORDS or name in ("format", "dict"):
                yield from self.shown(keyword.value, seen)


STRING_METHODS = {"format", "join", "replace", "ljust", "rjust", "center", "upper", "lower", "capitalize"}


def assignments(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """name -> the expressions assigned to it (plain `x = ...`, `x |= ...`, `x += ...`) anywhere in ``tree``."""
    found: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name) and node.value:
            found.setdefault(node.target.id, []).append(node.value)
    return found


PLOTTING = set(
    "plot bar barh scatter step hist errorbar fill_between fill_betweenx axhline axvline axhspan "
    "axvspan hlines vlines stackplot broken_barh stem loglog semilogx semilogy pie boxplot violinplot "
    "imshow set bar_label set_xticks set_yticks".split()
)


def sinks(tree: ast.AST):
    """Yield (expression, minimum English words) for everything ``tree`` shows the reader.

    What a module returns for a chapter to print (a dict of results, say) is not followed: most
    such strings are keys the chapter looks up. When printed, they show up in the outputs rule."""
    displayed_dicts = set(config()["code"]["displayed_dicts"])
    printing = PRINTING | set(config()["code"]["printing"])
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = callee(node.func)
            if name == "write" and not (
                isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in ("stdout", "stderr")
            ):
                continue
            if name in printing:
                for argument in node.args:
                    yield argument, 2
            elif name in FIGURE:
                position = FIGURE[name]
                for i, argument in enumerate(node.args):
                    if position is None or i == position:
                        yield argument, 1
            for keyword in node.keywords:
                if keyword.arg in DISPLAYED_KEYWORDS:
                    yield keyword.value, 1 if name in FIGURE or name in PLOTTING else 2
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in displayed_dicts
                ):
                    yield target.slice, 2


def untranslated(source: str) -> list[tuple[int, str]]:
    """(line, text) of each English string literal in ``source`` that reaches the reader without tr()."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    strings = Strings(assignments(tree))
    found, reported = [], set()
    for expression, minimum in sinks(tree):
        for node, text in strings.shown(expression):
            words = english_words(text)
            if len(words) >= minimum and id(node) not in reported:
                reported.add(id(node))
                found.append((node.lineno, text))
    return sorted(found)


def shorten(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def check_code_source(source: str, path: str, where) -> list[Finding]:
    """The code rule over one module or code cell; ``where(line)`` names the place."""
    return [
        Finding(path, where(line), "code", "en", f"English text without tr(): {shorten(text)!r}")
        for line, text in untranslated(source)
    ]


def check_module(path: Path) -> list[Finding]:
    if relative(path) in config()["code"]["skip"]:
        return []
    return check_code_source(path.read_text(encoding="utf-8"), relative(path), lambda n: f"line {n}")


def check_code_notebook(path: Path, nb: dict) -> list[Finding]:
    """The code rule over an English chapter's code cells (the setup cell is tools/headers.py's)."""
    findings = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code" and i != SETUP:
            findings += check_code_source(strip_magics(source_of(cell)), relative(path), lambda n, i=i: f"cell {i}")
    return findings


def check_code() -> list[Finding]:
    findings = [finding for module in sorted(PACKAGE.rglob("*.py")) for finding in check_module(module)]
    for path in sorted((CHAPTERS / "en").glob("*.ipynb")):
        findings += check_code_notebook(path, read_notebook(path))
    return findings


# ================================================================ texts of a translation


@dataclass
class Text:
    """One piece of translated text: a prose block, a comment or a catalog value."""

    path: str
    where: str
    kind: str  # prose, notes, comments, catalog
    text: str


def notebook_texts(path: Path, nb: dict | None = None) -> list[Text]:
    nb = nb or read_notebook(path)
    name, texts = relative(path), []
    for i, cell in enumerate(nb["cells"]):
        source = source_of(cell)
        if cell["cell_type"] == "markdown":
            kind = "notes" if is_notes(cell) else "prose"
            texts += [Text(name, f"cell {i}", kind, block) for block in prose_blocks(source)]
        elif cell["cell_type"] == "code" and i != SETUP:
            texts += [Text(name, f"cell {i}", "comments", BACKTICKS.sub(CODE, c)) for _, c in comments(source)]
    return texts


def catalog_texts(path: Path) -> list[Text]:
    """Each value of a figure-text catalog, with the line of its key."""
    node = yaml.compose(path.read_text(encoding="utf-8"))
    name = relative(path)
    return [
        Text(name, f"line {key.start_mark.line + 1}", "catalog", BACKTICKS.sub(CODE, value.value))
        for key, value in (node.value if node else [])
        if isinstance(value, yaml.ScalarNode)
    ]


def markdown_texts(path: Path) -> list[Text]:
    """A translated landing page (chapters/<lang>/index.md), one text per paragraph."""
    texts, name = [], relative(path)
    source = path.read_text(encoding="utf-8")
    if source.startswith("---"):
        source = "\n" * source.count("\n", 0, source.find("\n---", 3) + 4) + source[source.find("\n---", 3) + 4 :]
    for token in markdown_parser().parse(source):
        if token.type == "inline" and token.map:
            texts += [Text(name, f"line {token.map[0] + 1}", "prose", b) for b in prose_blocks(token.content)]
    return texts


# ================================================================ rule: terms


@dataclass
class Term:
    forbidden: re.Pattern
    preferred: str
    why: str
    unless: re.Pattern | None
    kinds: tuple[str, ...]
    only: tuple[str, ...]  # path globs; empty: everywhere

    def applies(self, text: Text) -> bool:
        if text.kind not in self.kinds:
            return False
        return not self.only or any(fnmatch.fnmatch(text.path, glob) for glob in self.only)


@cache
def terms(lang: str) -> list[Term]:
    kinds_default = ("prose", "notes", "comments", "catalog")
    found = []
    for entry in config()["terms"].get(lang) or []:
        found.append(
            Term(
                re.compile(entry["forbidden"]),
                entry["preferred"],
                entry.get("why", ""),
                re.compile(entry["unless"]) if entry.get("unless") else None,
                tuple(entry.get("in", kinds_default)),
                tuple(entry.get("only", ())),
            )
        )
    return found


def flatten(text: str) -> str:
    """Line breaks as spaces, placeholders as "`…`": how a term regex sees prose."""
    return text.replace("\n", " ").replace(CODE, "`…`").replace(MATH, "$…$")


@cache
def pending_terms() -> frozenset[str]:
    """Findings left to the editors of chapters being rewritten: "path:cell N: text" (assets/terms.yml)."""
    return frozenset(config().get("pending", {}).get("terms", []))


def check_terms_text(text: Text, lang: str) -> list[Finding]:
    findings = []
    flat = flatten(text.text)
    for term in terms(lang):
        if not term.applies(text):
            continue
        for match in term.forbidden.finditer(flat):
            window = flat[max(0, match.start() - 60) : match.end() + 60]
            if term.unless and term.unless.search(window):
                continue
            if f"{text.path}:{text.where}: {match.group(0).strip()}" in pending_terms():
                continue
            why = f" ({term.why})" if term.why else ""
            message = f"{match.group(0)!r}: write {term.preferred}{why}"
            findings.append(Finding(text.path, text.where, "terms", lang, message))
    return findings


# ================================================================ rule: typography

RU_UNITS = (
    r"мкс|мс|нс|мин|ч|с|Б|байта|байтов|байт|бита|битов|бит|[КкМГТ]и?Б(?:/с)?|[МГ]бит/с|Гбит/с|"
    r"млн|млрд|тыс\.|%|[kKMGT]i?B(?:/s)?|T?FLOP/s|GT/s|ГТ/с|Гц|ГГц|°C|ms|µs|мкм"
)
RU_NUMBER_UNIT = re.compile(rf"(?<![\w.,])(\d+(?:,\d+)?)[ \n]({RU_UNITS})(?![\w/])")
RU_GROUPED = re.compile(r"(?<![\d.,])\d{1,3}(?:[ \n]\d{3})+(?![\d])")
RU_NUMBER_NBSP = re.compile(r"(?<![\d.,])\d{1,3}(?:[\u00a0\u202f]\d{3})+(?![\d])")
ZH_HALF = re.compile(rf"(?<=[{HAN}])[ ]?[,;:?!]|[,;:?!][ ]?(?=[{HAN}])|(?<=[{HAN}])\.(?=\s|$)")
ZH_PARENS = re.compile(r"\(([^()\n]*)\)")
# Inside ASCII parentheses, what may keep them: math ("(p-1)", "(批大小 × 序列长度)") and tuples or
# argument lists without Chinese ("(h, 4h)", "(mean, variance)", "(...)").
MATHLIKE = re.compile(r"[×·+=/−*^<>≤≥∝]|\w-\w")
TUPLE = re.compile(rf"^[^{HAN}]*(?:,|\.\.\.|['\"])[^{HAN}]*$")
LINE_BREAK = re.compile(rf"[{HAN}{CJK_PUNCT}]\n[{HAN}{CJK_PUNCT}]")
ZH_SPACE_AFTER = re.compile(r"[。，；：？！、] +(?=[^\s|*])")  # full-width punctuation carries its own space
# ko: a gloss in parentheses on the next source line: "CUDA 이벤트\n(`torch.cuda.Event`)는" renders as
# "이벤트 (…)는"; the gloss belongs to the word ("30분(`default_pg_timeout`)이고"). A gloss is what a
# particle follows, or a parenthesis without Korean; math, a tuple "(edp, tp)" and an aside may start a line.
KO_GLOSS_BREAK = re.compile(r"[\uac00-\ud7a3]\n\(([^()\n]*)\)(?=([\uac00-\ud7a3])?)")
# ru: a dash between parts of a sentence has a no-break space before it (style sheet); a table cell "| — |"
# and a line that starts with the dash are not that.
RU_DASH = re.compile(r"(?<=[^\s|]) —")
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # invisible on the page, breaks search and copy
# zh-TW: a bold run-in label keeps its full stop (or ？！) outside, "**容量**。", as about 90 labels of the book do.
# A label opens a line or a list item, or follows a full stop or colon; a "**" elsewhere may close a span.
ZH_TW_LABEL = re.compile(r"(?m)(?:^(?:[ \t]*(?:[-*]|\d+\.)[ \t]+)?|(?<=[。：]))\*\*([^*\n]{1,40}?)([。？！])\*\*")
KO_NOT_GLOSS = re.compile(rf"[×·+=/−*^<>≤≥∝]|^[^{HANGUL}]*,[^{HANGUL}]*$")
SPACE_PERCENT = re.compile(r"(?<![\d.,])(\d+(?:[.,]\d+)?)[ \u00a0\u202f]%")
PT_DECIMAL_UNITS = (
    r"x|×|%|s|ms|µs|us|ns|min|h|[kKMGT]i?B(?:/s)?|bytes?|bits?|T?FLOP/s|GT/s|vezes|milhões|bilhões|mil|[MB]\b"
)
PT_DECIMAL = re.compile(rf"(?<![\w.,])(0|[1-9]\d*)\.(\d+)(?![\d.])(\s?(?:{PT_DECIMAL_UNITS})(?!\w))?")
PT_THOUSANDS = re.compile(r"(?<![\w.,#$=/-])(\d{4,})(?![.,]\d|\d|\w)")
PT_COUNTED = re.compile(r"\s+(?:por|passos|bytes|amostras|tokens|entradas|vezes|parâmetros|valores|elementos|linhas)\b")
PT_VERSION_BEFORE = re.compile(
    r"\b(?:PyTorch|torch|Python|PCIe|CUDA|NCCL|torchvision|versão|versões|version|v|Gen|SM|Ubuntu|[aà]|d[ao]|n[ao]|e|ou|até|desde)\s*$"
)


def zh_parens(text: str) -> list[str]:
    """ASCII parentheses next to or around Chinese; a math-like tuple "(批大小 × 序列长度)" may keep them."""
    found = []
    for match in ZH_PARENS.finditer(text):
        before, after = text[max(0, match.start() - 2) : match.start()], text[match.end() : match.end() + 2]
        near = re.search(rf"[{HAN}]\s?$", before) or re.match(rf"\s?[{HAN}]", after)
        inside = re.search(rf"[{HAN}]", match.group(1))
        if (near or inside) and not MATHLIKE.search(match.group(1)) and not TUPLE.match(match.group(1)):
            found.append(match.group(0))
    return found


def pt_numbers(text: str, kind: str) -> list[str]:
    """Decimal points and ungrouped thousands where pt-BR writes 1,5 and 1.024."""
    problems = []
    for match in PT_DECIMAL.finditer(text):
        whole, fraction, unit = match.group(1), match.group(2), match.group(3)
        if len(fraction) == 3 and whole != "0":
            continue  # 1.024: a pt-BR thousands dot
        before = text[max(0, match.start() - 30) : match.start()]
        if unit or (kind != "comments" and whole == "0" and not PT_VERSION_BEFORE.search(before)):
            problems.append(f"decimal point in {match.group(0).strip()!r}: write a decimal comma")
    if kind == "comments":
        return problems
    for match in PT_THOUSANDS.finditer(text):
        number, before = match.group(1), text[max(0, match.start() - 24) : match.start()]
        after = text[match.end() : match.end() + 3]
        if 1900 <= int(number) <= 2099 and not PT_COUNTED.match(text[match.end() :]):
            continue  # a year: (Dean et al., 2012), dezembro de 2025; but "2000 por padrão" is a count
        if re.search(r"(?:[×x=]|\bportas?\b\D{0,12})\s*$", before, re.I) or re.match(r"\s*[×x]", after):
            continue  # a dimension, an assignment or a port: 1024 × 1024, h = 8192, porta 29500
        problems.append(f"{number!r} without a thousands dot: write {int(number):,}".replace(",", "."))
    return problems


def check_typography_text(text: Text, lang: str) -> list[Finding]:
    """The typography of one text; comments and catalog values get the checks that apply to them."""
    body, problems = text.text, []
    prose = text.kind in ("prose", "notes")
    for match in CONTROL.finditer(body):
        context = shorten(flatten(body[max(0, match.start() - 20) : match.end() + 20]), 50)
        problems.append(f"control character U+{ord(match.group(0)):04X} in {context!r}")
    if lang == "ru" and prose:
        for match in RU_NUMBER_UNIT.finditer(body):
            number, unit = match.group(1), match.group(2)
            if unit == "с" and "," not in number and not re.match(r"\s*(?:[,.;:)!?»—–/]|$)", body[match.end() :]):
                continue  # "ранг 1 с рангом 0": the preposition, not seconds
            problems.append(f"no-break space between {number!r} and {unit!r} (U+00A0)")
        for match in RU_GROUPED.finditer(body):
            problems.append(f"grouped number {match.group(0)!r}: separate thousands with U+00A0 or U+202F")
        if '"' in body.replace(CODE, "").replace(MATH, ""):
            problems.append(f"straight quotes in {shorten(flatten(body), 60)!r}: write « »")
        for match in RU_DASH.finditer(body):
            context = flatten(body[max(0, match.start() - 12) : match.end() + 8])
            problems.append(f"ordinary space before the dash in {context!r}: write a no-break space (U+00A0)")
    if lang in ("zh-CN", "zh-TW") and text.kind != "comments":
        for match in ZH_HALF.finditer(body):
            context = flatten(body[max(0, match.start() - 8) : match.end() + 8])
            problems.append(f"half-width {match.group(0).strip()!r} next to Chinese in {context!r}: use full-width")
        for parens in zh_parens(body):
            problems.append(f"ASCII parentheses {shorten(parens, 40)!r} next to Chinese: use （ ）")
        if prose:
            for match in LINE_BREAK.finditer(body):
                pair = f"{match.group(0)[0]!r} and {match.group(0)[2]!r}"
                problems.append(f"line break between {pair}: it renders as a space")
    if lang == "ko" and prose:
        for match in KO_GLOSS_BREAK.finditer(body):
            inside, particle = match.group(1), match.group(2)
            if (particle or not re.search(f"[{HANGUL}]", inside)) and not KO_NOT_GLOSS.search(inside):
                gloss = shorten(flatten(f"({inside})"), 40)
                problems.append(f"line break before the gloss {gloss!r}: it renders as a space; attach it to the word")
    if lang in ("zh-CN", "zh-TW", "ko") and text.kind != "comments":
        for match in SPACE_PERCENT.finditer(body):
            problems.append(f"space before % in {match.group(0)!r}: write {match.group(1)}%")
    if lang == "pt-BR":
        problems += pt_numbers(body, text.kind)
    return [Finding(text.path, text.where, "typography", lang, p) for p in problems]


def check_emphasis(path: Path, nb: dict, lang: str) -> list[Finding]:
    findings = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            for paragraph in unclosed_emphasis(source_of(cell)):
                message = f"literal ** on the page (emphasis not closed) in {shorten(paragraph, 70)!r}"
                findings.append(Finding(relative(path), f"cell {i}", "typography", lang, message))
            if lang in ("zh-CN", "zh-TW"):  # read the source: "**标签。** 正文" needs its space after the **
                for match in ZH_SPACE_AFTER.finditer(source_of(cell)):
                    context = source_of(cell)[max(0, match.start() - 8) : match.end() + 8].replace("\n", " ")
                    message = f"space after the full-width {match.group(0).strip()!r} in {context!r}: remove it"
                    findings.append(Finding(relative(path), f"cell {i}", "typography", lang, message))
            if lang == "zh-TW":  # the markers are gone from the prose texts: read the cell's source
                for match in ZH_TW_LABEL.finditer(source_of(cell)):
                    label, mark = match.groups()
                    message = f"punctuation inside the bold label {match.group(0)!r}: write **{label}**{mark}"
                    findings.append(Finding(relative(path), f"cell {i}", "typography", lang, message))
    return findings


# ================================================================ rule: particles
#
# Korean particles come in pairs chosen by the sound that ends the word before them: 은/는, 이/가, 을/를,
# 과/와, 으로/로 (ㄹ takes 로), 이라/라, 이면/면 ... After code or a Latin word the choice follows how
# the word is READ, not its spelling: `set_epoch`은 (셋 에폭), `DataLoader`는 (데이터로더), `NCCL`로 (니클).
# An expression is read by its last word (`f(x, True)`를: 트루). The reading comes from the table in
# assets/terms.yml (particles.ko.readings), then from a spelling rule that answers only when it is sure;
# a word neither knows is not judged.

VOWEL, RIEUL, CONSONANT = "a vowel", "ㄹ", "a consonant"  # how a reading ends: no final consonant, ㄹ, another one

# (form after a final consonant, form after a vowel, copula): a copula's 이 may stay after a vowel
# (데이터로더이며 and 데이터로더며 are both right), so only its missing 이 after a consonant is wrong.
PAIRS = "은/는 이/가 을/를 과/와 과의/와의 과는/와는 과도/와도"
COPULAS = "이나/나 이라/라 이라고/라고 이라는/라는 이라면/라면 이면/면 이며/며 이고/고 이든/든 이든지/든지 이랑/랑"
PARTICLE_PAIRS = [(*p.split("/"), False) for p in PAIRS.split()] + [(*p.split("/"), True) for p in COPULAS.split()]
RO = ["", "는", "도", "서", "써", "의", "만", "부터"]  # 으로/로 and what may follow it
PARTICLES = {form for a, b, _ in PARTICLE_PAIRS for form in (a, b)} | {p + s for p in ("으로", "로") for s in RO}
HANGUL_RUN = re.compile("[\uac00-\ud7a3]+")

LETTER_NAMES = "에이 비 씨 디 이 에프 지 에이치 아이 제이 케이 엘 엠 엔 오 피 큐 알 에스 티 유 브이 더블유 엑스 와이 지"
LETTERS = dict(zip("abcdefghijklmnopqrstuvwxyz", LETTER_NAMES.split()))
SINO = dict(zip("0123456789", "영 일 이 삼 사 오 육 칠 팔 구".split()))


def final_of(hangul: str) -> str:
    """How a Korean reading ends: VOWEL, RIEUL (ㄹ) or CONSONANT."""
    jong = (ord(hangul.strip()[-1]) - 0xAC00) % 28
    return VOWEL if jong == 0 else RIEUL if jong == 8 else CONSONANT


@cache
def readings() -> dict[str, str | None]:
    """The table of readings, lower case; a word read two ways (shape: 셰이프, 셰입) maps to None."""
    entry = config().get("particles", {}).get("ko", {})
    table = {str(k).lower(): str(v) for k, v in entry.get("readings", {}).items()}
    return table | {str(word).lower(): None for word in entry.get("either", [])}


def number_final(digits: str) -> str:
    """A number read in Sino-Korean: 1 일, 2 이, 10 십, 1,024 ... 이십사, 0.5 영점 오."""
    digits = digits.replace(",", "")
    if "." in digits:
        return final_of(SINO[digits[-1]])
    stripped = digits.rstrip("0")
    if not stripped or stripped == digits:
        return final_of(SINO[digits[-1]])
    return CONSONANT  # 십, 백, 천, 만, 억: all end in a consonant


def spelled_final(word: str) -> str | None:
    """An English word's ending as Korean reads it, from its spelling; None where the spelling does not tell.

    Loanword spelling: a final -m, -n, -ng is a batchim (스트림, 토큰, 링), -l is ㄹ (모델); -k, -t, -p after
    a consonant take 으 (랭크, 리스트, 점프), most other endings a vowel (-d 드, -s 스, -x 스, -ch 치, -f 프,
    -r and -er 어, -y 이, a silent -e after the consonant it sounds: 리듀스, but 타임, 파이프라인, 샘플).
    -t and -p after a short vowel are a batchim (셋, 스텝), -ck is ㄱ (스택); what stays open is left out."""
    w = word.lower()
    if len(w) < 2 or not w.isalpha():
        return None
    last, before = w[-1], w[-2]
    vowels = "aeiou"
    if last == "e":
        if before in vowels or before in "rwy":
            return VOWEL  # true, core, eye
        return {"m": CONSONANT, "n": CONSONANT, "l": RIEUL}.get(before, VOWEL)  # time, line, module; reduce
    if last == "h":
        return VOWEL if before in "cpst" else None  # batch 배치, graph 그래프, depth 뎁스, flush 플러시
    if last in "aiouywdsxzfvr":
        return VOWEL  # cuda, key, flow, load, args, index, buf, tensor
    if last in "mn":
        return CONSONANT  # stream 스트림, token 토큰
    if last == "l":
        return RIEUL  # model 모델
    if last == "g":
        return CONSONANT if before == "n" else VOWEL  # ring 링; log 로그, config 컨피그
    if last == "c":
        return CONSONANT if w.endswith("ic") else VOWEL if before == "n" else None  # metric 메트릭; sync 싱크
    if last not in "ktp" or before == last:
        return None  # -b (잡, 허브), -j, -q, app 앱
    if before not in vowels:
        return CONSONANT if w.endswith("ck") else VOWEL  # stack 스택; rank 랭크, list 리스트, jump 점프
    if len(w) >= 3 and w[-3] in vowels:  # a long vowel or a diphthong
        if w.endswith(("out", "eep", "eap", "ook")):
            return CONSONANT  # timeout 타임아웃, sleep 슬립, heap 힙, hook 훅
        return VOWEL if w.endswith(("ait", "eat", "eet", "oat", "oot", "oop", "eak", "eek")) else None
    if last == "p" or (last == "t" and before in "aeou"):
        return CONSONANT  # step 스텝, map 맵; set 셋, format 포맷, input 인풋, robot 로봇
    return None  # -it (커밋, 비트), -k after a short vowel


def word_final(token: str, glued_digits_ok: bool = True) -> str | None:
    """How a token (an identifier, an English word, a number) is read at its end, or None if unsure."""
    table = readings()
    if token.lower() in table:
        return table[token.lower()] and final_of(table[token.lower()])
    if re.fullmatch(r"\d+(?:[.,]\d+)*", token):
        return number_final(token)
    pieces = [
        p for chunk in re.split(r"[_.\-]+", token) for p in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", chunk)
    ]
    if not pieces:
        return None
    last = pieces[-1]
    if last.isdigit():
        # glued to letters (fp16, FSDP2, stage0): English or Korean numerals, both heard: leave it
        return number_final(last) if len(pieces) == 1 else None
    if last.lower() in table:
        return table[last.lower()] and final_of(table[last.lower()])
    if len(last) == 1:
        return final_of(LETTERS[last.lower()])
    if not re.search("[AEIOUaeiou]", last):
        return final_of(LETTERS[last[-1].lower()])  # an acronym spelled letter by letter: DDP, SGD, tp
    if len(last) == 2:
        return None  # ep (이피), io, up: a word or letters
    return spelled_final(last)


def code_final(code: str) -> str | None:
    """How a code span is read at its end: the last word of an expression (`f(x, True)`: True)."""
    text = code.strip()
    if text.endswith("*"):
        return None  # SLURM_*: a pattern, read as the names it stands for
    while True:
        stripped = text.rstrip(" )]}>'\"`,;:*").removesuffix("...").removesuffix("…").rstrip("(")
        if stripped == text:
            break
        text = stripped
    match = re.search(r"[A-Za-z0-9_]+$", text)
    if not match:
        return None
    number = re.search(r"(?<![\w.])\d+(?:\.\d+)?$", text)  # a number of its own: range(3) 삼, seed=0 영, 1.0 영
    return number_final(number.group(0)) if number else word_final(match.group(0))


def particle_problem(final: str | None, particle: str) -> str | None:
    """The particle to write instead of ``particle`` after a word read with ``final``, or None if right."""
    if final is None:
        return None
    for ro in ("으로", "로"):
        if particle.startswith(ro) and particle[len(ro) :] in RO:
            right = "로" if final in (VOWEL, RIEUL) else "으로"
            return right + particle[len(ro) :] if ro != right else None
    for after_consonant, after_vowel, copula in PARTICLE_PAIRS:
        if particle == after_consonant and final == VOWEL and not copula:
            return after_vowel
        if particle == after_vowel and final != VOWEL:
            return after_consonant
    return None


# A Latin word or a number in prose, then the Korean right after it.
PROSE_WORD = re.compile(
    r"(?<![\w.%])(?<!\d/)([A-Za-z][A-Za-z0-9]*(?:[-.][A-Za-z0-9]+)*|\d+(?:[.,]\d+)*%?)(?=[\uac00-\ud7a3])"
)


def particle_findings(segments: list[tuple[bool, str]]) -> list[str]:
    """The wrong particles in a text given as (is_code, text) segments, in order."""
    problems = []
    for i, (is_code, text) in enumerate(segments):
        if is_code:
            if i + 1 < len(segments) and not segments[i + 1][0]:
                run = HANGUL_RUN.match(segments[i + 1][1])
                if run and run.group(0) in PARTICLES:
                    final = code_final(text)
                    right = particle_problem(final, run.group(0))
                    if right:
                        code = f"`{shorten(text, 60)}`"
                        problems.append(f"{code}{run.group(0)}: write {code}{right} (read ending in {final})")
            continue
        for match in PROSE_WORD.finditer(text):
            run = HANGUL_RUN.match(text, match.end())
            word = match.group(1)
            if not run or run.group(0) not in PARTICLES:
                continue
            final = VOWEL if word.endswith("%") else word_final(word)  # 퍼센트
            right = particle_problem(final, run.group(0))
            if right:
                problems.append(f"{word}{run.group(0)}: write {word}{right} (read ending in {final})")
    return problems


def segments_of_markdown(markdown: str) -> list[tuple[int, list[tuple[bool, str]]]]:
    """(first line, segments) of each paragraph, heading or table cell: (is_code, text) in order; math,
    images and HTML break the text, emphasis and links do not (**`Join`으로**)."""
    blocks = []
    for token in markdown_parser().parse(markdown):
        if token.type != "inline":
            continue
        segments: list[tuple[bool, str]] = []
        for child in token.children or []:
            if child.type == "text":
                segments.append((False, URL.sub(" ", child.content)))
            elif child.type in ("softbreak", "hardbreak"):
                segments.append((False, "\n"))
            elif child.type == "code_inline":
                segments.append((True, child.content))
            elif not re.fullmatch(r"(?:strong|em|link)_(?:open|close)", child.type):
                segments.append((False, " "))
        blocks.append(((token.map or [0])[0], segments))
    return blocks


def segments_of_plain(text: str) -> list[tuple[bool, str]]:
    """A comment or a catalog value: `code` in backticks, the rest text."""
    parts = re.split(r"(`+)(.+?)\1", text)
    segments = [(False, parts[0])]
    for i in range(1, len(parts), 3):
        segments += [(True, parts[i + 1]), (False, parts[i + 2])]
    return segments


def particle_texts(path: Path, nb: dict | None = None) -> list[tuple[str, list[tuple[bool, str]]]]:
    """(where, segments) of every Korean text of a notebook, a catalog (locale/ko.yml) or a landing page."""
    path, texts = Path(path), []
    if path.suffix == ".ipynb":
        for i, cell in enumerate((nb or read_notebook(path))["cells"]):
            source = source_of(cell)
            if cell["cell_type"] == "markdown":
                texts += [(f"cell {i}", segments) for _, segments in segments_of_markdown(source)]
            elif cell["cell_type"] == "code" and i != SETUP:
                texts += [(f"cell {i}", segments_of_plain(c)) for _, c in comments(source)]
    elif path.suffix == ".yml":
        node = yaml.compose(path.read_text(encoding="utf-8"))
        for key, value in node.value if node else []:
            if isinstance(value, yaml.ScalarNode):
                texts.append((f"line {key.start_mark.line + 1}", segments_of_plain(value.value)))
    elif path.suffix == ".md":
        texts += [(f"line {line + 1}", s) for line, s in segments_of_markdown(path.read_text(encoding="utf-8"))]
    return texts


def check_particles(path: Path, lang: str, nb: dict | None = None) -> list[Finding]:
    """The particles rule (Korean only) over a notebook, a catalog or a landing page, less the findings
    that assets/terms.yml lists as pending (chapters being rewritten by others)."""
    if lang != "ko":
        return []
    name = relative(path)
    pending = set(config().get("particles", {}).get("ko", {}).get("pending", []))
    return [
        Finding(name, where, "particles", lang, f"particle chosen by spelling, not sound: {problem}")
        for where, segments in particle_texts(path, nb)
        for problem in particle_findings(segments)
        if f"{name}: {problem.split(': write ')[0]}" not in pending
    ]


# ================================================================ rule: outputs
#
# An output line is English the course wrote when it contains a string literal of the package or of
# an English chapter's code (its constant parts, in order) with at least two English words, and no
# letter of the page's script. Matching the course's own literals, rather than judging any English,
# lets a chapter quote what torch, gloo or Python print (an error message, a warning, a log line):
# those are not the course's sentences and stay English on every page. A literal inside tr() counts
# too: printed in English, its catalog entry is missing.


@dataclass(frozen=True)
class Literal:
    text: str
    words: frozenset[str]  # its English words, lower case
    pattern: re.Pattern  # its constant parts in order, anything between them


def literal_pattern(text: str) -> re.Pattern | None:
    parts = [part.strip() for part in FIELD.split(text)]
    parts = [part for part in parts if part]
    return re.compile(".*?".join(re.escape(part) for part in parts)) if parts else None


def shown_literals(source: str) -> list[str]:
    """The string literals of ``source`` that reach the reader, through tr() or not: what the code
    rule follows, plus what functions return (a module's report, printed by the chapter)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    strings = Strings(assignments(tree), through_tr=True)
    expressions = [expression for expression, _ in sinks(tree)]
    expressions += [n.value for n in ast.walk(tree) if isinstance(n, (ast.Return, ast.Yield)) and n.value]
    return [text for expression in expressions for _, text in strings.shown(expression)]


def literal_index(sources: list[str]) -> dict[str, tuple[Literal, ...]]:
    """The shown literals of ``sources`` with two English words or more, indexed by each of their words."""
    index: dict[str, list[Literal]] = {}
    for text in {t for source in sources for t in shown_literals(source)}:
        for line in ESCAPES.sub("\n", text).split("\n"):
            words = frozenset(w.lower() for w in english_words(line))
            pattern = literal_pattern(line) if len(words) >= 2 else None
            if pattern is not None:
                literal = Literal(line, words, pattern)
                for word in words:
                    index.setdefault(word, []).append(literal)
    return {word: tuple(literals) for word, literals in index.items()}


@cache
def course_literals() -> dict[str, tuple[Literal, ...]]:
    """What the course can print: the package's modules and the English chapters' code cells."""
    sources = [module.read_text(encoding="utf-8") for module in sorted(PACKAGE.rglob("*.py"))]
    for path in sorted((CHAPTERS / "en").glob("*.ipynb")):
        sources += [strip_magics(source_of(c)) for c in read_notebook(path)["cells"] if c["cell_type"] == "code"]
    return literal_index(sources)


@cache
def output_allow() -> list[re.Pattern]:
    return [re.compile(p) for p in config()["outputs"]["allow"]]


def english_literal(line: str, lang: str, literals: dict | None = None) -> Literal | None:
    """The course's English literal that ``line`` shows untranslated, if any."""
    if lang in SCRIPT and re.search(f"[{SCRIPT[lang]}]", line):
        return None
    if any(p.search(line) for p in output_allow()):
        return None
    words = {w.lower() for w in english_words(line, fields=False)}
    if len(words) < 2:
        return None
    literals = course_literals() if literals is None else literals
    for word in words:
        for literal in literals.get(word, ()):
            if literal.words <= words and literal.pattern.search(line) and not kept_in_catalog(literal, lang):
                return literal
    return None


@cache
def catalog_values(lang: str) -> tuple[str, ...]:
    path = LOCALE / f"{lang}.yml"
    if not path.exists():
        return ()
    return tuple(str(v) for v in (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).values())


def kept_in_catalog(literal: Literal, lang: str) -> bool:
    """Whether the language's own catalog writes these English words on purpose (pt-BR keeps
    "world size", as its community does): then they are a term of that language, not a slip."""
    return any(literal.pattern.search(value) for value in catalog_values(lang))


HTML_SKIP = re.compile(r"<(style|script)\b.*?</\1>", re.S | re.I)
TAG = re.compile(r"<[^>]+>")


def output_lines(outputs: list) -> list[str]:
    """What a reader sees of a cell's outputs, line by line: stdout, Markdown/HTML/plain results.
    stderr is left out: it holds warnings, progress bars and tools' logs, not the course's sentences."""
    import html

    lines = []
    for out in outputs or []:
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") == "stdout":
            text = out.get("text", "")
            lines += (text if isinstance(text, str) else "".join(text)).splitlines()
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            join = lambda v: v if isinstance(v, str) else "".join(v)  # noqa: E731
            if "text/markdown" in data:
                lines += [line for block in prose_blocks(join(data["text/markdown"])) for line in block.split("\n")]
            elif "text/html" in data:
                text = TAG.sub("\n", HTML_SKIP.sub("", join(data["text/html"])))
                lines += html.unescape(text).splitlines()
            elif "text/plain" in data and len(data) == 1:
                lines += join(data["text/plain"]).splitlines()
    return [line.replace(CODE, "`…`").replace(MATH, "$…$") for line in lines if line.strip()]


def english_in_outputs(outputs: list, lang: str, literals: dict | None = None) -> list[str]:
    """The lines of a translated cell's outputs (nbformat dicts or nbval's) that show the course's English."""
    return [line for line in output_lines(outputs) if english_literal(line, lang, literals)]


def check_nbval_item(item) -> str | None:
    """For the nbval hook in conftest.py: why an executed cell of a translated chapter fails, or None."""
    outputs = getattr(item, "test_outputs", None)
    parts = Path(str(getattr(item, "path", ""))).parts
    if not outputs or len(parts) < 3 or parts[-3] != "chapters" or parts[-2] in ("en", "chapters"):
        return None
    english = english_in_outputs(outputs, parts[-2])
    if not english:
        return None
    lines = "\n".join(f"    {shorten(line, 110)}" for line in english)
    return (
        f"English in the outputs of a {parts[-2]} chapter: pass these lines through tr() "
        f"and give them catalog entries (tools/lint_language.py, rule outputs):\n{lines}"
    )


def check_outputs(path: Path, nb: dict, lang: str) -> list[Finding]:
    findings = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            for line in english_in_outputs(cell.get("outputs", []), lang):
                message = f"English output: {shorten(line)!r}"
                findings.append(Finding(relative(path), f"cell {i}", "outputs", lang, message))
    return findings


# ================================================================ rule: comments

PLAIN_WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*[,.:;]?")


def english_comment(text: str) -> bool:
    """A sentence of English: four plain words or more, and little else (not code, a command, a message)."""
    tokens = text.split()
    plain = [t for t in tokens if PLAIN_WORD.fullmatch(t)]
    return len(plain) >= 4 and len(plain) >= 0.75 * len(tokens)


def check_comments(path: Path, nb: dict, lang: str, english: dict | None = None) -> list[Finding]:
    """Comments of a translated notebook that are still the English chapter's (same cell id), word for word."""
    if english is None:
        source = CHAPTERS / "en" / Path(path).name
        if not source.exists():
            return []
        english = read_notebook(source)
    by_id = {cell.get("id"): cell for cell in english["cells"] if cell["cell_type"] == "code"}
    findings = []
    for i, cell in enumerate(nb["cells"]):
        original = by_id.get(cell.get("id"))
        if cell["cell_type"] != "code" or i == SETUP or original is None:
            continue
        kept = {text for _, text in comments(strip_magics(source_of(original)))}
        for _, text in comments(strip_magics(source_of(cell))):
            if text in kept and english_comment(text):
                message = f"comment left in English: {shorten(text, 70)!r}"
                findings.append(Finding(relative(path), f"cell {i}", "comments", lang, message))
    return findings


# ================================================================ running the rules


def lint_notebook(path: Path, nb: dict, rules: set[str]) -> list[Finding]:
    """terms, typography, outputs, particles and comments over one notebook (English: emphasis only)."""
    lang = notebook_language(nb, path)
    findings = []
    if lang != "en":
        for text in notebook_texts(path, nb) if {"terms", "typography"} & rules else []:
            findings += check_text(text, lang, rules)
        if "outputs" in rules:
            findings += check_outputs(path, nb, lang)
        if "particles" in rules:
            findings += check_particles(path, lang, nb)
        if "comments" in rules:
            findings += check_comments(path, nb, lang)
    if "typography" in rules:
        findings += check_emphasis(path, nb, lang)
    return findings


def check_text(text: Text, lang: str, rules: set[str]) -> list[Finding]:
    findings = check_terms_text(text, lang) if "terms" in rules else []
    return findings + (check_typography_text(text, lang) if "typography" in rules else [])


def lint_translation(path: Path, rules: set[str]) -> list[Finding]:
    """The rules over one notebook, catalog (locale/<lang>.yml) or landing page (chapters/<lang>/index.md)."""
    path = Path(path)
    if path.suffix == ".ipynb":
        return lint_notebook(path, read_notebook(path), rules)
    lang = path.stem if path.suffix == ".yml" else path.parent.name
    findings = check_particles(path, lang) if "particles" in rules else []
    if lang == "en" or not {"terms", "typography"} & rules:
        return findings
    texts = catalog_texts(path) if path.suffix == ".yml" else markdown_texts(path)
    return findings + [finding for text in texts for finding in check_text(text, lang, rules)]


def lint_paths(paths: list[Path], rules: set[str]) -> list[Finding]:
    """The rules over the given files; folders are searched for notebooks."""
    files = []
    for path in map(Path, paths):
        files += sorted(path.rglob("*.ipynb")) if path.is_dir() else [path]
    findings = []
    for path in files:
        if path.suffix == ".py" and "code" in rules:
            findings += check_module(path)
        elif path.suffix == ".ipynb":
            nb = read_notebook(path)
            if "code" in rules and notebook_language(nb, path) == "en":
                findings += check_code_notebook(path, nb)
            findings += lint_notebook(path, nb, rules)
        elif path.suffix in (".yml", ".md"):
            findings += lint_translation(path, rules)
    return findings


def lint_repository(rules: set[str], langs: set[str]) -> list[Finding]:
    findings = check_code() if "code" in rules and "en" in langs else []
    for lang in sorted(langs):
        paths = sorted((CHAPTERS / lang).glob("*.ipynb"))
        if lang != "en":
            paths += [p for p in (LOCALE / f"{lang}.yml", CHAPTERS / lang / "index.md") if p.is_file()]
        for path in paths:
            findings += lint_translation(path, rules)
    return findings


def summary(findings: list[Finding], langs: list[str]) -> list[str]:
    counts = Counter((f.rule, f.lang) for f in findings)
    columns = [lang for lang in langs if any(counts[r, lang] for r in RULES)] or langs
    lines = [f"{'rule':12s}" + "".join(f"{lang:>8s}" for lang in columns) + f"{'total':>8s}"]
    for rule in RULES:
        row = [counts[rule, lang] for lang in columns]
        lines.append(f"{rule:12s}" + "".join(f"{n:8d}" for n in row) + f"{sum(row):8d}")
    lines.append(
        f"{'total':12s}"
        + "".join(f"{sum(counts[r, lang] for r in RULES):8d}" for lang in columns)
        + f"{len(findings):8d}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="files or folders to lint (default: the repository)")
    parser.add_argument("--rule", action="append", choices=RULES, help="only this rule (repeatable)")
    parser.add_argument("--lang", action="append", help="only this language (repeatable; the code rule is 'en')")
    parser.add_argument("--summary", action="store_true", help="counts per rule and language instead of the findings")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rules = set(args.rule or RULES)
    all_langs = ["en", *translated_languages()]
    langs = set(args.lang or all_langs)
    unknown = langs - set(all_langs)
    if unknown:
        parser.error(f"unknown language(s) {sorted(unknown)}; the course has {all_langs}")
    findings = lint_paths(args.paths, rules) if args.paths else lint_repository(rules, langs)
    findings = sorted(f for f in set(findings) if f.lang in langs and f.rule in rules)
    if args.summary:
        print(*summary(findings, all_langs), sep="\n")
    elif findings:
        print(*findings, sep="\n")
    seconds = time.perf_counter() - start
    print(
        f"{len(findings)} finding(s) in {seconds:.1f} s" if findings else f"language lint: clean ({seconds:.1f} s)",
        file=sys.stderr,
    )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
