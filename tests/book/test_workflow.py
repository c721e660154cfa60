"""The publishing workflow runs the README's own commands and deploys the built book."""

import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_has_exactly_two_commands():
    assert readme_commands() == ["make book", "make test"]


def test_ci_script_runs_the_readme_test_command():
    script = (ROOT / ".ci/run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")]
    assert readme_commands()[1] in commands


def workflow_runs(job: dict) -> list[str]:
    """The commands of a job's run steps, each without the `time ` that measures it."""
    return [step["run"].strip().removeprefix("time ") for step in job["steps"] if "run" in step]


def test_workflow_runs_readme_commands_and_deploys_the_book():
    workflow = yaml.safe_load((ROOT / ".github/workflows/book.yml").read_text())
    steps = workflow["jobs"]["build"]["steps"]
    runs = workflow_runs(workflow["jobs"]["build"])
    # The install on its own (so that its time shows apart), then the README's commands: tests first,
    # whose notebook runs fill the book's execution cache, then the book, which executes nothing again.
    assert runs == ["make .venv/.installed", "make test", "make book"]
    assert set(runs[1:]) == set(readme_commands())
    upload = next(step for step in steps if step.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"] == "_build/html"
    deploy = workflow["jobs"]["deploy"]
    assert deploy["needs"] == "build"
    assert any(step.get("uses", "").startswith("actions/deploy-pages") for step in deploy["steps"])


def test_the_python_claimed_is_the_python_tested():
    """pyproject's lowest Python is the one CI's workflow sets up, and README says the same."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    claimed = re.search(r'requires-python = ">=(\d+\.\d+)"', pyproject).group(1)
    workflow = yaml.safe_load((ROOT / ".github/workflows/book.yml").read_text())
    setup = next(s for s in workflow["jobs"]["build"]["steps"] if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["python-version"] == claimed
    assert f"Python {claimed}+" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_runtime_dependencies_are_declared():
    """Third-party modules the package imports are in pyproject's dependencies (torch is the reader's own)."""
    import ast

    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = {
        d.lower().replace("-", "_")
        for d in re.findall(r'"([A-Za-z][\w.-]*)"', pyproject.split("dependencies = ", 1)[1].split("]", 1)[0])
    }
    import_names = {"yaml": "pyyaml", "sklearn": "scikit_learn"}
    optional = {
        "torch",
        "torchvision",
        "IPython",
        "lightning",
        "accelerate",
        "deepspeed",
        "babel",
        "google",
        "nbformat",
        "torchao",  # chapter 09's float8 GPU cell only; without it the cell says what to install
    }
    found = set()
    for path in (ROOT / "code" / "distcourse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    import sys

    third_party = {name for name in found if name not in sys.stdlib_module_names and name != "distcourse"} - optional
    missing = {name for name in third_party if import_names.get(name, name).lower() not in declared}
    assert not missing, f"imported by code/distcourse but not in pyproject's dependencies: {sorted(missing)}"


def test_workflow_times_each_step_and_caches_downloads():
    """Every step prints its wall time; pip's and npm's downloads are cached between runs."""
    workflow = yaml.safe_load((ROOT / ".github/workflows/book.yml").read_text())
    job = workflow["jobs"]["build"]
    runs = [step["run"].strip() for step in job["steps"] if "run" in step]
    assert all(run.startswith("time ") for run in runs), runs
    assert job["defaults"]["run"]["shell"] == "bash"  # `time` is bash's keyword; TIMEFORMAT is bash's
    assert "%R" in job["env"]["TIMEFORMAT"]
    setup = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["cache"] == "pip" and setup["with"]["cache-dependency-path"] == "requirements.txt"
    node = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-node"))
    assert node["with"]["cache"] == "npm" and (ROOT / "package-lock.json").is_file()
    # The Makefile's install target is the one the workflow times.
    assert re.search(r"^STAMP := \$\(VENV\)/\.installed$", (ROOT / "Makefile").read_text(), flags=re.M)
    # 2-core runner: make test about an hour; the book after it executes nothing (tools/book_cache.py).
    assert job["timeout-minutes"] <= 90
