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


def test_workflow_runs_readme_commands_and_deploys_the_book():
    workflow = yaml.safe_load((ROOT / ".github/workflows/book.yml").read_text())
    steps = workflow["jobs"]["build"]["steps"]
    runs = [step["run"].strip() for step in steps if "run" in step]
    assert runs == ["make test", "make book"]
    assert set(runs) == set(readme_commands())
    upload = next(step for step in steps if step.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"] == "_build/html"
    deploy = workflow["jobs"]["deploy"]
    assert deploy["needs"] == "build"
    assert any(step.get("uses", "").startswith("actions/deploy-pages") for step in deploy["steps"])
