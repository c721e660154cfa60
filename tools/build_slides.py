#!/usr/bin/env python3
"""Build reveal.js slides of every chapter, in every language, that work offline.

    python tools/build_slides.py                   # all decks, executed
    python tools/build_slides.py --lang en --chapter 01 --out DIR
    python tools/build_slides.py --no-execute      # faster, slides without outputs

Writes ``_build/slides/<lang>/<chapter>.slides.html`` and copies what they load
(reveal.js, jQuery, require.js, MathJax, all installed by ``npm ci`` from
package.json) into ``_build/slides/_vendor``; every deck refers to those files by
relative paths, so the whole ``_build/slides`` folder can be copied to a USB
stick and opened without a network. Speaker notes (cells of slide type
``notes``) open with the ``s`` key.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys

import nbformat
from nbclient import NotebookClient
from nbconvert import SlidesExporter

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))  # this checkout's package, whether installed or not
from distcourse.runtime import languages  # noqa: E402

NODE_MODULES = ROOT / "node_modules"
TEMPLATES = ROOT / "tools" / "slides_template"
# What the decks load, copied from node_modules (MathJax without its unpacked
# sources, tests and the font formats that CommonHTML output does not use).
VENDOR = {
    "reveal.js": ["dist", "plugin"],
    "jquery": ["dist/jquery.min.js"],
    "requirejs": ["require.js"],
    "mathjax": [
        "MathJax.js",
        "config",
        "extensions",
        "jax/input/TeX",
        "jax/output/CommonHTML",
        "jax/element",
        "localization",
        "fonts/HTML-CSS/TeX/woff",
    ],
}


def copy_vendor(out: pathlib.Path) -> None:
    for package, parts in VENDOR.items():
        source = NODE_MODULES / package
        if not source.exists():
            sys.exit(f"build_slides: {source} is missing; run `npm ci` (make slides does)")
        for part in parts:
            src, dst = source / part, out / "_vendor" / package / part
            if src.is_dir():
                shutil.copytree(src, dst, dirs_exist_ok=True)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)


def exporter() -> SlidesExporter:
    vendor = "../_vendor"  # decks live one folder below _vendor
    return SlidesExporter(
        template_name="offline-reveal",
        extra_template_basedirs=[str(TEMPLATES)],
        reveal_url_prefix=f"{vendor}/reveal.js",
        jquery_url=f"{vendor}/jquery/dist/jquery.min.js",
        require_js_url=f"{vendor}/requirejs/require.js",
        mathjax_url=f"{vendor}/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe",
        reveal_scroll=True,
        reveal_theme="white",  # its font ships with reveal.js; "simple" imports Google Fonts
    )


def slide_count(html: str) -> tuple[int, int]:
    """(slides, slides including sub-slides). nbconvert wraps each slide and its
    sub-slides in an outer <section>, so outer sections are the slides."""
    outer = len(re.findall(r"<section[^>]*>\s*<section", html))
    return outer, len(re.findall(r"<section", html)) - outer


def without_badge(nb) -> None:
    """The Colab badge is an image on Google's servers: on slides, keep a plain link."""
    header = nb.cells[0]
    header.source = re.sub(r"\[!\[Open In Colab\]\([^)]*\)\]\(([^)]*)\)", r"[Open in Colab](\1)", header.source)


def build(notebook: pathlib.Path, out: pathlib.Path, execute: bool) -> tuple[pathlib.Path, tuple[int, int]]:
    nb = nbformat.read(notebook, as_version=4)
    if execute:
        NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(notebook.parent)}}).execute()
    without_badge(nb)
    html, _ = exporter().from_notebook_node(nb, resources={"metadata": {"name": notebook.stem}})
    target = out / notebook.parent.name / f"{notebook.stem}.slides.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(html, encoding="utf-8")
    return target, slide_count(html)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lang", action="append", choices=languages.CODES, help="language folder(s), default: all")
    parser.add_argument("--chapter", default="", help="only chapters whose file name starts with this")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "_build" / "slides")
    parser.add_argument("--no-execute", action="store_true", help="do not run the notebooks first")
    args = parser.parse_args()
    notebooks = [
        nb
        for nb in sorted((ROOT / "chapters").glob(f"*/{args.chapter}*.ipynb"))
        if nb.name[:2].isdigit() and (not args.lang or nb.parent.name in args.lang)
    ]
    if not notebooks:
        sys.exit("build_slides: no chapter matches")
    copy_vendor(args.out)
    for notebook in notebooks:
        target, (slides, with_sub) = build(notebook, args.out, execute=not args.no_execute)
        print(f"{slides:3d} slides ({with_sub:3d} with sub-slides)  {target}")
    print(f"open {args.out.resolve()}/<lang>/<chapter>.slides.html in a browser (no network needed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
