"""chapters.yml names every chapter's notebooks, modules, exercises and tests, and says the truth."""

from pathlib import Path

import chapter_map
import nbformat
import notebook_inputs

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE = REPO_ROOT / "code" / "distcourse"
CHAPTERS = chapter_map.load(REPO_ROOT)


def module_name(path: str) -> str:
    return "distcourse." + path.removesuffix(".py").replace("/", ".")


def test_every_english_notebook_is_declared_once():
    declared = [nb for chapter in CHAPTERS for nb in chapter["notebooks"]]
    assert len(declared) == len(set(declared))
    assert sorted(declared) == sorted(p.stem for p in (REPO_ROOT / "chapters" / "en").glob("*.ipynb"))


def test_every_named_file_exists():
    for chapter in CHAPTERS:
        for name in chapter_map.modules_of(chapter):
            assert (CODE / name).is_file(), name
        for test in chapter["tests"]:
            assert (REPO_ROOT / "tests" / "chapters" / test).is_file(), test
            assert test.startswith(f"test_ch{chapter['chapter']}_"), test


def test_each_notebook_imports_its_modules_and_exercises():
    for chapter in CHAPTERS:
        for notebook, modules in chapter["notebooks"].items():
            nb = nbformat.read(REPO_ROOT / "chapters" / "en" / f"{notebook}.ipynb", as_version=4)
            names = set().union(*(notebook_inputs.imported_names(c.source) for c in nb.cells if c.cell_type == "code"))
            for module in modules:
                assert module_name(module) in names, (notebook, module)
            if "exercises" in str(names):  # a notebook with exercises uses its own chapter's file
                assert module_name(chapter["exercises"]) in names, notebook


def test_readme_map_is_generated_from_chapters_yml():
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert chapter_map.render_readme(text, CHAPTERS) == text, "run python tools/chapter_map.py"
