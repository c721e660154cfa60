"""Keep every notebook's header cell and Colab setup in line with `_config.yml`.

The repository URL and branch live only in `_config.yml`. This tool rewrites,
in every `chapters/<lang>/*.ipynb`:

* the first cell: the title line is kept; below it, the "Open in Colab" badge
  for this very file and links to the same chapter in the other languages
  that exist;
* the second cell, the setup cell, from SETUP_CELL below (the same in every
  notebook), with the repository URL and branch filled in;
* the ``remove-cell`` tag on every speaker-notes cell (slide type ``notes``), so that the
  book leaves out what the slides keep.

A translated chapter's header also says that it is a translation and links to
the English chapter and to the translation status page.

    python tools/headers.py          # rewrite
    python tools/headers.py --check  # exit 1 if any notebook is out of date
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))  # this checkout's package, whether installed or not
from distcourse.runtime import languages  # noqa: E402  (the registry of languages)

LANGUAGES = {lang.code: lang.name for lang in languages.LANGUAGES}  # folder: the language's name for itself
# The badge image ships with the course: a remote image would show broken offline.
BADGE = "../../assets/colab-badge.svg"

# In Colab: clone the course next to the notebook and install the companion package
# (Colab already has torch, torchvision and matplotlib; --no-deps leaves them alone).
# Elsewhere: use the installed package, or this checkout's code/ folder.
# DISTCOURSE_REPO_URL exists only so that tests can point "Colab" at a local clone.
SETUP_CELL = """\
# Setup: in Colab, fetch the course and install its companion package; elsewhere, nothing to do.
import os, subprocess, sys

COURSE_REPO = os.environ.get("DISTCOURSE_REPO_URL", "{url}.git")
COURSE_BRANCH = "{branch}"
try:
    import google.colab  # noqa: F401  (only importable inside Colab)
    IN_COLAB = True
except ImportError:
    IN_COLAB = False
if IN_COLAB:
    if not os.path.isdir("distributed-training-course"):
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", COURSE_BRANCH,
                        COURSE_REPO, "distributed-training-course"], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-e",
                        "distributed-training-course"], check=True)
    # the running kernel does not see packages installed after it started: add the path too
    sys.path.insert(0, os.path.abspath(os.path.join("distributed-training-course", "code")))
try:
    import distcourse
except ImportError:  # a checkout whose package is not installed: use its code/ folder
    sys.path.insert(0, os.path.abspath(os.path.join("..", "..", "code")))
    import distcourse
distcourse.warm_up()  # start the rank launcher's fork server in the background
distcourse.set_language(install_fonts=IN_COLAB)  # text inside figures in the chapter's language
distcourse.check_torch()  # a torch outside the course's range stops here: one sentence on what to install
from distcourse import tr
distcourse.show_run(tr("The outputs on this page come from PyTorch {{torch}} on {{device}}."),
                    cpu=tr("a CPU with {{cores}} cores and no GPU"))
print(distcourse.doctor.summary())  # what this machine gives the course; details: python -m distcourse doctor"""


def repository(root: pathlib.Path = ROOT) -> tuple[str, str]:
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    repo = config["repository"]
    return repo["url"].rstrip("/"), repo.get("branch", "main")


def colab_url(notebook: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    url, branch = repository(root)
    github_path = url.split("github.com/", 1)[1]
    return (
        f"https://colab.research.google.com/github/{github_path}/blob/{branch}/{notebook.relative_to(root).as_posix()}"
    )


def header_markdown(notebook: pathlib.Path, title: str, root: pathlib.Path = ROOT) -> str:
    lang = languages.get(notebook.parent.name)
    lines = [title, "", f"[![Open In Colab]({BADGE})]({colab_url(notebook, root)})"]
    links = [
        f"[{name}](../{other}/{notebook.name})"
        for other, name in LANGUAGES.items()
        if other != lang.code and (root / "chapters" / other / notebook.name).exists()
    ]
    if links:
        colon = "：" if lang.code.startswith("zh") else ":"  # Chinese prose takes the full-width colon
        lines += ["", f"**{lang.other_languages}{colon}** " + " · ".join(links)]
    code = companion_links(notebook, root)
    if code:
        colon = "：" if lang.code.startswith("zh") else ":"
        lines += ["", f"**{lang.companion_code}{colon}** " + " · ".join(code)]
    if lang.translation_note:
        note = lang.translation_note.format(english=f"../en/{notebook.name}", status="../../translation-status.md")
        lines += ["", note]
    return "\n".join(lines)


def companion_links(notebook: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Links to the modules the chapter teaches from, as ``chapters.yml`` names them (none if absent)."""
    declaration = root / "chapters.yml"
    if not declaration.exists():
        return []
    for chapter in yaml.safe_load(declaration.read_text(encoding="utf-8")):
        names = chapter["notebooks"].get(notebook.stem)
        if names is not None:
            url, branch = repository(root)
            paths = [f"code/distcourse/{name}" for name in [*names, chapter["exercises"]]]
            return [f"[`{path.removeprefix('code/distcourse/')}`]({url}/blob/{branch}/{path})" for path in paths]
    return []


def setup_source(url: str, branch: str) -> str:
    return SETUP_CELL.format(url=url, branch=branch)


def notebooks(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return sorted((root / "chapters").glob("*/[0-9][0-9]-*.ipynb"))


def update(notebook: pathlib.Path, root: pathlib.Path = ROOT, write: bool = True) -> bool:
    """Rewrite the header and setup cells; True if the file changed (or, with write=False,
    would change: the comparison is made in memory and the file is left alone)."""
    nb = nbformat.read(notebook, as_version=4)
    header = nb.cells[0]
    title = header.source.splitlines()[0]
    header.source = header_markdown(notebook, title, root)
    url, branch = repository(root)
    setup = nb.cells[1]
    setup.source = setup_source(url, branch)
    setup.metadata["slideshow"] = {"slide_type": "skip"}
    setup.metadata["tags"] = ["remove-input"]
    # Speaker notes belong to the slides: the book leaves them out (Jupyter Book's remove-cell).
    for cell in nb.cells[2:]:
        tags = cell.metadata.get("tags", [])
        notes = cell.metadata.get("slideshow", {}).get("slide_type") == "notes"
        if notes and "remove-cell" not in tags:
            cell.metadata["tags"] = [*tags, "remove-cell"]
        elif not notes and "remove-cell" in tags:
            cell.metadata["tags"] = [t for t in tags if t != "remove-cell"]
    text = nbformat.writes(nb) + "\n"
    if text == notebook.read_text(encoding="utf-8"):
        return False
    if write:
        notebook.write_text(text, encoding="utf-8")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report, do not write")
    args = parser.parse_args()
    stale = [nb for nb in notebooks() if update(nb, write=not args.check) and args.check]
    for nb in stale:
        print(f"out of date: {nb.relative_to(ROOT)} (run python tools/headers.py)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
