"""Text inside figures, in the reader's language.

Every chapter exists in six languages with the same code, setup cell included.
The setup cell calls ``set_language()``, which finds the notebook's language
itself (see ``notebook_language``), and the code cells pass every string they
draw into a figure through ``tr()``:

    ax.set_title(tr("Pipeline bubble, p = 2 stages"))
    ax.set_title(tr("All-reduce time, {world} ranks, {backend}").format(world=2, backend="gloo"))

``tr`` looks the English text up in ``locale/<code>.yml`` (English text -> translation).
A small YAML catalog keyed by the English text is used instead of gettext's .po/.mo
files because the catalogs are edited by translators next to the notebooks and
need no compile step; ``tests/test_translations.py`` checks that every ``tr()``
string in the English chapters has an entry in every catalog.

The package itself speaks through ``tr()`` too: exercise verdicts, the lines rank
functions print, table headers and axis labels it draws; ``tools/translations.py``
collects the ``tr("...")`` literals of ``code/distcourse/**/*.py`` as well. Numbers it
shows go through ``number()``, which writes them the reader's way (``1,234.5`` in
English, ``1 234,5`` in Russian, ``1.234,5`` in Brazilian Portuguese). Rank processes of
``launch`` get the notebook's language from the launcher; a script started as a program
(torchrun) reads it from ``DISTCOURSE_LANG`` (``script_language``).

Chinese and Korean labels need a CJK font. ``set_language`` looks for one among
the installed fonts (Noto Sans CJK, Source Han Sans and the usual system fonts);
with ``install_fonts=True`` (the setup cell passes it in Colab) it installs
Debian's ``fonts-noto-cjk`` first if none is present. Without a CJK font only the
figures keep their English text (``figures_in_english``), a one-line message says how to
get one, and everything printed stays in the notebook's language.
"""

from __future__ import annotations

import glob
import json
import operator
import os
import pathlib
import re
import shutil
import string
import subprocess
import unicodedata

import yaml

from . import languages

LANGUAGES = languages.CODES
LOCALE_DIR = pathlib.Path(__file__).resolve().parents[1] / "locale"
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the same YAML subset, parsed in C
# Preferred family first; any of them draws the glyphs (see languages.py).
CJK_FONTS = {lang.code: list(lang.fonts) for lang in languages.LANGUAGES if lang.fonts}
FONT_FILES = [
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/opentype/noto/NotoSansCJK*.ttc",
    "/usr/share/fonts/truetype/noto/NotoSansCJK*.ttc",
]

_language = "en"
_catalog: dict[str, str] = {}


def catalog(code: str) -> dict[str, str]:
    """The figure-text catalog of a language: English text -> translation."""
    languages.get(code)  # a ValueError for a language the course does not have
    if code == "en":
        return {}
    path = LOCALE_DIR / f"{code}.yml"
    try:
        # libyaml's loader when PyYAML has it: every process that writes a translated language (the
        # notebook's kernel, each rank) loads its 100 KB catalog, 0.5 s in pure Python, 0.04 s in C.
        entries = yaml.load(path.read_text(encoding="utf-8"), Loader=SAFE_LOADER) or {}
    except FileNotFoundError:
        raise FileNotFoundError(f"no figure-text catalog for {code!r}: {path} is missing") from None
    if not isinstance(entries, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in entries.items()):
        raise ValueError(f"{path} must map English text to translated text, one string to one string")
    return entries


def cjk_font(code: str, install: bool) -> str | None:
    """The installed font that draws ``code``'s script in figures (installing one if asked), or None."""
    from matplotlib import font_manager

    def installed() -> str | None:
        names = {f.name for f in font_manager.fontManager.ttflist}
        return next((n for n in CJK_FONTS[code] if n in names), None)

    found = installed()
    if found is None:  # matplotlib's font cache may predate the fonts: register the files directly
        for pattern in FONT_FILES:
            for path in glob.glob(pattern):
                font_manager.fontManager.addfont(path)
        found = installed()
    if found is None and install and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "fonts-noto-cjk"],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return cjk_font(code, install=False)
    return found


def _language_of(notebook: dict) -> str:
    """A translated chapter records its language in its metadata; English ones record none."""
    return notebook.get("metadata", {}).get("distcourse", {}).get("translation", {}).get("language", "en")


def notebook_language() -> str:
    """The language of the running chapter.

    In order: ``DISTCOURSE_LANG``; the notebook file named by ``JPY_SESSION_NAME``
    (Jupyter Server sets it); the working folder when it is ``chapters/<lang>``
    (Jupyter, VS Code, nbval and Jupyter Book run a notebook in its own folder);
    in Colab, the open notebook's metadata; otherwise English.
    """
    if os.environ.get("DISTCOURSE_LANG"):
        return os.environ["DISTCOURSE_LANG"]
    session = os.environ.get("JPY_SESSION_NAME", "")
    if session.endswith(".ipynb") and os.path.isfile(session):
        with open(session, encoding="utf-8") as f:
            return _language_of(json.load(f))
    here = pathlib.Path.cwd()
    if here.parent.name == "chapters" and here.name in LANGUAGES:
        return here.name
    try:
        from google.colab import _message  # Colab's own channel to the notebook it shows

        return _language_of(_message.blocking_request("get_ipynb", timeout_sec=10)["ipynb"])
    except Exception:  # not in Colab, or Colab did not answer: English
        return "en"


def set_language(code: str | None = None, install_fonts: bool = False) -> str:
    """Text in language ``code`` (default: the notebook's) from now on, figures included
    where a font draws its script.

    Returns the language in effect."""
    global _language, _catalog
    code = notebook_language() if code is None else code
    entries = catalog(code)
    import matplotlib

    family, font = ["DejaVu Sans"], None
    if code in CJK_FONTS:
        font = cjk_font(code, install_fonts)
        if font is None:
            print(  # in the notebook's language: the notebook can show it, the figures cannot
                tr(
                    "No Chinese/Korean font found, so figures keep their English text. "
                    "To get translated figures install one (Debian/Ubuntu/Colab: apt-get install fonts-noto-cjk) "
                    "and run this cell again.",
                    language=code,
                )
            )
        else:
            family.append(font)  # matplotlib falls back to it for glyphs DejaVu Sans lacks
    matplotlib.rcParams["font.family"] = family
    _language, _catalog = code, entries
    figures_in_english(entries if code in CJK_FONTS and font is None else None)
    return code


_to_english: list[tuple[re.Pattern, str, list[str]]] | None = None


def _pattern(translated: str) -> tuple[re.Pattern, list[str]] | None:
    """A regex that matches ``translated`` with its ``{fields}`` filled in, and the fields' names."""
    try:
        parts = list(string.Formatter().parse(translated))
    except ValueError:
        return None
    regex, names = "", []
    for literal, field, _spec, _conversion in parts:
        regex += re.escape(literal)
        if field is not None:
            regex += "(.+?)"
            names.append(field)
    return re.compile(regex + r"\Z", re.S), names


def english(text: str) -> str:
    """The English of a translated (and possibly formatted) catalog text; ``text`` when none matches."""
    if _to_english is None or text.isascii():  # English, numbers and tick labels pass as they are
        return text
    for pattern, source, names in _to_english:
        found = pattern.match(text)
        if found:
            values = dict(zip(names, found.groups()))
            parts = string.Formatter().parse(source)
            return "".join(lit + (values.get(f, "") if f is not None else "") for lit, f, _s, _c in parts)
    if "\n" in text:
        return "\n".join(english(line) for line in text.split("\n"))
    return text


def figures_in_english(entries: dict[str, str] | None) -> None:
    """Draw figure text in English (``entries``: the catalog to undo) or as given (None).

    Without a CJK font matplotlib would draw empty boxes, but the notebook itself shows
    Chinese and Korean well, so printed text stays translated and only what a figure draws
    goes back to English. Every string a figure draws passes through ``Text.set_text``
    (titles, labels, ticks, legends), so that one method is wrapped, once, and the wrapper
    does nothing while ``_to_english`` is None."""
    global _to_english
    from matplotlib import text as mtext

    if entries is None:
        _to_english = None
        return
    _to_english = []
    for source, translated in sorted(entries.items(), key=lambda kv: -len(kv[1])):  # longest first
        compiled = None if translated.isascii() else _pattern(translated)
        if compiled is not None:
            _to_english.append((compiled[0], source, compiled[1]))
    if not getattr(mtext.Text.set_text, "_distcourse", False):
        original = mtext.Text.set_text

        def set_text(self, s):
            return original(self, english(s) if isinstance(s, str) else s)

        set_text._distcourse = True
        mtext.Text.set_text = set_text


def language() -> str:
    """The language text is written in (figures drawn in English when no font draws its script)."""
    return _language


def use(code: str) -> None:
    """Text in language ``code`` from now on, without touching fonts: for rank processes,
    which print but draw nothing (the launcher passes them the notebook's language)."""
    global _language, _catalog
    _catalog = catalog(code)
    _language = code


def script_language() -> str:
    """The language of a script started as a program (a torchrun worker, ``python -m ...``).

    ``DISTCOURSE_LANG`` when it names one of the course's languages, otherwise English. A
    script calls ``use(script_language())`` before it prints; whoever starts it sets the
    variable (``DISTCOURSE_LANG=ru torchrun ...``). Unlike ``notebook_language`` this never
    guesses from the working folder or asks Colab: a subprocess has no notebook to ask, and
    lines that code reads back keep a fixed tag whatever the language (``result {json}``).
    """
    code = os.environ.get("DISTCOURSE_LANG", "")
    return code if code in LANGUAGES else "en"


def tr(text: str, language: str | None = None) -> str:
    """``text`` (English) in the current language (or ``language``); English when the catalog lacks it."""
    if language is not None and language != _language:
        return catalog(language).get(text, text)
    return _catalog.get(text, text)


def _babel_locale(code: str) -> str:
    return languages.get(code).sphinx


def number(value, digits: int | None = None, *, grouping: bool = True, scientific: bool = False) -> str:
    """``value`` written the way readers of the current language write numbers.

    ``digits``: exactly that many decimals (default: an integer as it is, other values with
    at most 3 decimals); ``grouping``: thousands separators; ``scientific``: ``1.2E-05``
    style with ``digits`` decimals in the mantissa. Uses Babel (CLDR data: a decimal comma
    in Russian and Brazilian Portuguese, a no-break space between thousands in Russian);
    without Babel (the package installed with ``--no-deps``) plain Python formatting.
    """
    try:
        from babel import numbers
    except ImportError:
        numbers = None
    if scientific:
        places = 1 if digits is None else digits
        if numbers is None:
            return f"{value:.{places}e}"
        pattern = "0." + "0" * places + "E00" if places else "0E00"
        return numbers.format_scientific(value, pattern, locale=_babel_locale(_language))
    if numbers is None:
        comma = "," if grouping else ""
        if digits is not None:
            return f"{value:{comma}.{digits}f}"
        try:  # an integer (also numpy's) as it is
            return f"{operator.index(value):{comma}d}"
        except TypeError:  # as Babel's "#,##0.###": up to 3 decimals, no trailing zeros
            return f"{float(value):{comma}.3f}".rstrip("0").rstrip(".")
    whole = "#,##0" if grouping else "0"
    if digits is None:
        pattern = whole + ".###"
    else:
        pattern = whole + ("." + "0" * digits if digits else "")
    return numbers.format_decimal(value, pattern, locale=_babel_locale(_language))


def width(text: str) -> int:
    """Columns ``text`` takes in a monospaced font: two for each wide (CJK) character."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def pad(text, columns: int, align: str = "<") -> str:
    """``text`` padded with spaces to ``columns`` display columns (``align`` ``<`` or ``>``).

    ``f"{label:20s}"`` counts characters, so a Chinese or Korean label, two columns per
    character, pushes the rest of its row to the right; tables that show translated labels
    pad with this instead."""
    text = str(text)
    spaces = " " * max(0, columns - width(text))
    return text + spaces if align == "<" else spaces + text
