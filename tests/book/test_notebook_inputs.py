"""A notebook executes again only when what it reads changed (tools/notebook_inputs.py)."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import notebook_inputs
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO_ROOT / "chapters").glob("*/*.ipynb"))
CODE = REPO_ROOT / "code" / "distcourse"


@pytest.fixture(scope="module")
def inputs() -> dict[Path, set[Path]]:
    return {nb: set(notebook_inputs.notebook_inputs(nb, REPO_ROOT)) for nb in NOTEBOOKS}


def readers(inputs, path: Path) -> set[str]:
    return {nb.relative_to(REPO_ROOT / "chapters").as_posix() for nb, files in inputs.items() if path in files}


def test_a_chapter_module_reaches_its_chapter_in_every_language_only(inputs):
    languages = {nb.parent.name for nb in NOTEBOOKS}
    chapter_12 = {
        f"{lang}/{name}"
        for lang in languages
        for name in ("12-capstone.ipynb", "12-capstone-at-scale.ipynb", "12-rpc.ipynb")
    }
    assert readers(inputs, CODE / "capstone" / "train.py") <= chapter_12
    assert {nb.split("/")[1] for nb in readers(inputs, CODE / "capstone" / "train.py")} >= {"12-capstone.ipynb"}
    assert len(readers(inputs, CODE / "capstone" / "train.py")) % len(languages) == 0  # the same in every language


def test_a_catalog_reaches_its_language_only(inputs):
    for catalog in sorted((CODE / "locale").glob("*.yml")):
        language = catalog.stem
        found = readers(inputs, catalog)
        assert found and {nb.split("/")[0] for nb in found} == {language}, (catalog.name, found)


def test_the_runtime_reaches_every_notebook(inputs):
    assert all(CODE / "runtime" / "launcher.py" in files for files in inputs.values())


def test_relative_imports_and_module_names_in_strings():
    names = notebook_inputs.imported_names(
        "from ..runtime import hardware\nfrom . import timing\ncmd = ['-m', 'distcourse.scripts.crashing_train']",
        package="distcourse.common",
    )
    assert {"distcourse.runtime.hardware", "distcourse.common.timing", "distcourse.scripts.crashing_train"} <= names


def _modules_loaded_by_imports(nb: Path) -> list[str]:
    """The distcourse modules that a fresh interpreter has loaded after ``nb``'s distcourse imports."""
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    lines = [
        line
        for cell in cells
        if cell["cell_type"] == "code"
        for line in "".join(cell["source"]).splitlines()
        if line.startswith(("import ", "from ")) and "distcourse" in line
    ]
    probe = "\n".join(
        [*lines, "import sys, json", "print(json.dumps(sorted(m for m in sys.modules if m.startswith('distcourse'))))"]
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=nb.parent, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_every_module_a_notebooks_imports_load_is_an_input(inputs):
    """Run each English notebook's import statements for real: what they load must be among its inputs."""
    notebooks = sorted((REPO_ROOT / "chapters" / "en").glob("*.ipynb"))
    # One interpreter per notebook (each starts with nothing imported), as many at once as there are cores.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        found = dict(zip(notebooks, pool.map(_modules_loaded_by_imports, notebooks)))
    index = notebook_inputs.module_index(REPO_ROOT / "code")
    for nb, modules in found.items():
        loaded = {index[m] for m in modules if m in index}
        assert loaded <= inputs[nb], (nb.name, sorted(str(p) for p in loaded - inputs[nb]))
