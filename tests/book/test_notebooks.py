"""Static checks of every chapter notebook: clean, headed, linked, sliced into slides.

(nbval executes the notebooks themselves; see the README's test command.)
"""

import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
import headers  # noqa: E402

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
        for lang in headers.LANGUAGES
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_asserts_its_claims(path):
    code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    assert len(re.findall(r"^\s*assert ", code, flags=re.M)) >= 5


def test_headers_match_config():
    result = subprocess.run([sys.executable, str(ROOT / "tools/headers.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
