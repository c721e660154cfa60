"""Each language's first chapter runs the way Colab runs it, without Colab.

Colab opens a notebook with nothing around it: no repository, no companion
package. The test recreates that: the notebook file alone in an empty folder,
a stand-in ``google.colab`` module, and a kernel that cannot see this
checkout's installed ``distcourse`` (it starts with ``python -S``, so the
virtualenv's ``.pth`` files, which hold the editable install, are not read).
The setup cell must then clone the course (``DISTCOURSE_REPO_URL`` points it at
this repository instead of GitHub), install the package (into a throwaway
prefix, so the test's own environment is untouched) and run every cell.
"""

import json
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
import headers  # noqa: E402
from distcourse.runtime import languages  # noqa: E402

FIRST_CHAPTERS = [path for lang in languages.CODES for path in sorted((ROOT / "chapters" / lang).glob("01-*.ipynb"))]


def _kernel_without_site(tmp: pathlib.Path, standin: pathlib.Path) -> pathlib.Path:
    """A kernelspec whose Python sees site-packages only through PYTHONPATH (no .pth files)."""
    spec_dir = tmp / "jupyter" / "kernels" / "colab-sim"
    spec_dir.mkdir(parents=True)
    site_packages = sysconfig.get_paths()["purelib"]
    spec = {
        "argv": [sys.executable, "-S", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab stand-in",
        "language": "python",
        "env": {"PYTHONPATH": f"{standin}:{site_packages}"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return tmp / "jupyter"


@pytest.mark.slow  # executes a notebook as Colab would (20-30 s in English, the setup cell alone elsewhere)
@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed to clone the course")
@pytest.mark.parametrize("notebook", FIRST_CHAPTERS, ids=[p.parent.name for p in FIRST_CHAPTERS])
def test_first_chapter_runs_as_in_colab(notebook, tmp_path, monkeypatch):
    content = tmp_path / "content"  # Colab's working folder, empty but for the notebook
    content.mkdir()
    shutil.copy(notebook, content / notebook.name)
    standin = tmp_path / "standin"
    (standin / "google" / "colab").mkdir(parents=True)
    (standin / "google" / "__init__.py").write_text("")
    (standin / "google" / "colab" / "__init__.py").write_text('"""Stand-in for Colab\'s module."""\n')
    # Colab answers "get_ipynb" with the notebook it shows; the setup cell reads the language from it.
    (standin / "google" / "colab" / "_message.py").write_text(
        "import glob, json\n"
        "def blocking_request(kind, timeout_sec=None):\n"
        "    assert kind == 'get_ipynb'\n"
        "    return {'ipynb': json.load(open(glob.glob('*.ipynb')[0], encoding='utf-8'))}\n"
    )

    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_without_site(tmp_path, standin)))
    monkeypatch.setenv("DISTCOURSE_REPO_URL", ROOT.as_uri())
    # Where "Colab" installs the package; ignoring what is installed keeps pip from
    # uninstalling this environment's own distcourse first.
    monkeypatch.setenv("PIP_PREFIX", str(tmp_path / "prefix"))
    monkeypatch.setenv("PIP_IGNORE_INSTALLED", "1")

    nb = nbformat.read(content / notebook.name, as_version=4)
    if notebook.parent.name != "en":
        # The chapter's other cells are the same code in every language, and nbval runs each
        # translation: the whole chapter runs here once, in English. A translation's Colab run
        # checks what differs: its setup cell (cell 1) picks the notebook's language.
        nb.cells = nb.cells[:2]
    probe = nbformat.v4.new_code_cell("import distcourse; print(distcourse.__file__); print(distcourse.language())")
    nb.cells.append(probe)  # which distcourse did the notebook use?
    client = NotebookClient(nb, kernel_name="colab-sim", timeout=300, resources={"metadata": {"path": str(content)}})
    client.execute()

    clone = content / "distributed-training-course"
    assert (clone / "code" / "distcourse" / "__init__.py").exists(), "the setup cell did not clone the course"
    installed = list((tmp_path / "prefix").rglob("*distcourse*"))
    assert installed, "the setup cell did not install the companion package"
    # The kernel may send the two printed lines as one stream message or as two.
    used, language = "".join(o.get("text", "") for o in probe.outputs if o["output_type"] == "stream").split()
    assert language == notebook.parent.name, f"figure text in {language!r}, the chapter is {notebook.parent.name!r}"
    assert used.startswith(str(clone)), f"the notebook used {used}, not the course it fetched"
    # and this environment's own installation is untouched
    check = subprocess.run(
        [sys.executable, "-c", "import distcourse; print(distcourse.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert check.stdout.strip() == str(ROOT / "code" / "distcourse" / "__init__.py"), check.stderr


def test_every_language_with_chapters_is_covered():
    langs = {p.parent.name for p in headers.notebooks(ROOT)}
    assert langs == {p.parent.name for p in FIRST_CHAPTERS}


def test_git_is_available_for_the_setup_cell():
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0
