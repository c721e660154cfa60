"""Static checks of every chapter notebook: clean, headed, linked, sliced into slides.

(nbval executes the notebooks themselves; see the README's test command.)
"""

import ast
import importlib
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
import headers  # noqa: E402
from distcourse.runtime import languages  # noqa: E402

NOTEBOOKS = headers.notebooks(ROOT)
SLIDE_TYPES = {"slide", "subslide", "fragment", "-", "skip", "notes"}
ids = [nb.relative_to(ROOT).as_posix() for nb in NOTEBOOKS]


def test_english_chapter_01_exists():
    assert (ROOT / "chapters/en/01-dataloader-workers.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has outputs"
            assert cell.execution_count is None, f"cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_header_badge_points_at_this_file(path):
    header = nbformat.read(path, as_version=4).cells[0]
    assert header.cell_type == "markdown" and header.source.startswith("# ")
    badges = re.findall(r"\]\((https://colab\.research\.google\.com/github/[^)]+)\)", header.source)
    assert badges == [headers.colab_url(path, ROOT)]
    assert badges[0].endswith("/" + path.relative_to(ROOT).as_posix())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_language_links_exist_and_are_complete(path):
    header = nbformat.read(path, as_version=4).cells[0].source
    links = re.findall(r"\]\((\.\./[^)]+\.ipynb)\)", header)
    for link in links:
        assert (path.parent / link).resolve().exists(), f"broken language link {link}"
    translations = {
        f"../{lang}/{path.name}"
        for lang in languages.CODES
        if lang != path.parent.name and (ROOT / "chapters" / lang / path.name).exists()
    }
    assert set(links) == translations


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_setup_cell_and_slide_metadata(path):
    nb = nbformat.read(path, as_version=4)
    setup = nb.cells[1]
    assert setup.cell_type == "code" and "remove-input" in setup.metadata.get("tags", [])
    assert setup.metadata["slideshow"]["slide_type"] == "skip"
    for i, cell in enumerate(nb.cells):
        kind = cell.metadata.get("slideshow", {}).get("slide_type")
        assert kind in SLIDE_TYPES, f"cell {i} has no valid slideshow.slide_type"
    assert any(c.metadata["slideshow"]["slide_type"] == "notes" for c in nb.cells), "no speaker notes"


def notebook_asserts(path) -> list[ast.Assert]:
    """The assert statements of a notebook's code cells (IPython magics and shell lines left out)."""
    found = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            lines = cell.source.splitlines()
            source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
            found += [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assert)]
    return found


def checks_something(node: ast.Assert) -> bool:
    """False for an assert on constants only (`assert True`, `assert 1 < 2`): it cannot fail."""
    return any(isinstance(n, (ast.Name, ast.Attribute, ast.Call)) for n in ast.walk(node.test))


def test_constant_asserts_are_recognised():
    tree = ast.parse("assert True\nassert 1 < 2, 'x'\nassert x > 0\nassert f()\nassert [3] == [y.z]")
    assert [checks_something(node) for node in tree.body] == [False, False, True, True, True]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_asserts_its_claims(path):
    asserts = notebook_asserts(path)
    constant = [ast.unparse(node) for node in asserts if not checks_something(node)]
    assert not constant, f"asserts that cannot fail: {constant}"
    assert len(asserts) >= 5, f"{len(asserts)} asserts"


def test_headers_match_config():
    result = subprocess.run([sys.executable, str(ROOT / "tools/headers.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_header_check_compares_without_writing(tmp_path):
    (tmp_path / "chapters" / "en").mkdir(parents=True)
    shutil.copy(ROOT / "_config.yml", tmp_path)
    notebook = tmp_path / "chapters" / "en" / "01-dataloader-workers.ipynb"
    nb = nbformat.read(ROOT / "chapters" / "en" / notebook.name, as_version=4)
    nb.cells[0].source += "\n\nA stale line under the header."
    nbformat.write(nb, notebook)
    stale = notebook.read_bytes()
    assert headers.update(notebook, tmp_path, write=False) is True
    assert notebook.read_bytes() == stale
    assert headers.update(notebook, tmp_path) is True
    assert "A stale line" not in notebook.read_text(encoding="utf-8")
    assert headers.update(notebook, tmp_path, write=False) is False


def _package_aliases(nb) -> dict[str, str]:
    """Names a notebook's code binds to modules of the companion package: alias -> module path."""
    aliases = {"distcourse": "distcourse"}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distcourse"):
                for name in node.names:
                    aliases[name.asname or name.name] = f"{node.module}.{name.name}"
            elif isinstance(node, ast.Import):
                for name in node.names:
                    if name.name.startswith("distcourse") and name.asname:
                        aliases[name.asname] = name.name
    return aliases


FILE_SUFFIXES = {"py", "ipynb", "json", "jsonl", "txt", "pt", "md", "yml", "yaml", "csv"}  # `metrics.jsonl`: a file
# Quoted code whose name is a variable, not the module: chapter 04 quotes `ddp.no_sync()`, the
# DDP-wrapped model that distcourse/ddp.py itself calls `ddp`.
NOT_THE_MODULE = {("ddp", "no_sync")}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_package_names_in_the_text_exist(path):
    """`module.name` in a chapter's prose (and its markdown code blocks) names something the package has.

    A function that moved to another module would otherwise leave the text (and its translations)
    pointing readers, and the exercises, at a name that raises AttributeError."""
    nb = nbformat.read(path, as_version=4)
    aliases = _package_aliases(nb)
    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        # Code as the text shows it: fenced blocks and inline code spans (not links to files).
        code = re.findall(r"```.*?```|`[^`\n]+`", cell.source, flags=re.S)
        for alias, attribute in re.findall(r"(?<![\w./])([A-Za-z_]\w*)\.([A-Za-z_]\w*)", "\n".join(code)):
            if alias not in aliases or attribute in FILE_SUFFIXES or (alias, attribute) in NOT_THE_MODULE:
                continue
            try:
                module = importlib.import_module(aliases[alias])
            except ImportError:  # a name imported from a module, not a module: not this test's business
                continue
            if hasattr(module, attribute):
                continue
            try:  # a submodule the package does not import itself: distcourse.scripts
                importlib.import_module(f"{aliases[alias]}.{attribute}")
            except ImportError:
                missing.append(f"cell {i}: {alias}.{attribute}")
    assert missing == [], missing
