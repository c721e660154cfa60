"""Chapter to code, from ``chapters.yml``: the README's chapter map and each notebook's companion code.

python tools/chapter_map.py           # rewrite the chapter map in README.md
python tools/chapter_map.py --check   # exit 1 if README.md's map is not what chapters.yml says
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
START, END = "<!-- chapter-map: generated from chapters.yml by tools/chapter_map.py -->", "<!-- /chapter-map -->"
HEADER = (
    "| Chapter | Notebook (`chapters/<lang>/`) | Module (`code/distcourse/`) | Test (`tests/chapters/`) |\n"
    "|---|---|---|---|"
)


def load(root: pathlib.Path = ROOT) -> list[dict]:
    return yaml.safe_load((root / "chapters.yml").read_text(encoding="utf-8"))


def modules_of(chapter: dict) -> list[str]:
    """The chapter's modules in order of first use, then its scripts and exercise file."""
    modules = [m for names in chapter["notebooks"].values() for m in names]
    return [*dict.fromkeys(modules), *chapter.get("scripts", []), chapter["exercises"]]


def table(chapters: list[dict]) -> str:
    def code(names):
        return ", ".join(f"`{name}`" for name in names)

    rows = [
        f"| {c['chapter']} {c['title']} | {code(n + '.ipynb' for n in c['notebooks'])} | {code(modules_of(c))} "
        f"| {code(c['tests'])} |"
        for c in chapters
    ]
    return "\n".join([HEADER, *rows])


def companion(notebook: str, root: pathlib.Path = ROOT) -> list[str]:
    """Paths (from the repository root) of the code a notebook uses: its modules and exercise file."""
    for chapter in load(root):
        if notebook in chapter["notebooks"]:
            names = [*chapter["notebooks"][notebook], chapter["exercises"]]
            return [f"code/distcourse/{name}" for name in names]
    raise KeyError(f"{notebook} is not in chapters.yml")


def render_readme(text: str, chapters: list[dict]) -> str:
    if START not in text or END not in text:
        raise ValueError(f"README.md has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{table(chapters)}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that README.md is current")
    args = parser.parse_args(argv)
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = render_readme(text, load())
    if args.check:
        if new != text:
            print("README.md's chapter map differs from chapters.yml: run python tools/chapter_map.py")
            return 1
        return 0
    readme.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
