"""The package's rooms and doors: what may import what, private names, function length.

- ``runtime/`` (starting ranks, hardware, languages) imports only ``runtime/``;
- ``common/`` (what chapters share) imports only ``runtime/`` and ``common/``;
- a topic module (one per chapter or technique) imports ``runtime/``, ``common/`` and the
  topic modules its docstring names in a line ``Builds on: a, b`` (a chapter that openly
  extends an earlier one's subject), nothing else of the package;
- exercises import their own chapter's modules; scripts (programs run by torchrun and the
  libraries) may import anything;
- no name with a leading underscore crosses a module, in the package or in a notebook;
- every function in the package fits on a screen (under 60 lines).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "code" / "distcourse"
MAX_FUNCTION_LINES = 60
BUILDS_ON = re.compile(r"^Builds on: (.+?)\.?$", re.M)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()
TOPICS = {name for name in MODULES if name and "." not in name and name != "__main__"}


def room(name: str) -> str:
    """runtime, common, exercises, scripts, locale, topic, or package (the top-level files)."""
    if name in ("", "__main__"):
        return "package"
    first = name.split(".")[0]
    return first if first in ("runtime", "common", "exercises", "scripts") else "topic"


def imports_of(path: Path, name: str) -> list[tuple[str, list[str]]]:
    """(imported distcourse module, names imported from it) for every import in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".") if package else []
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            elif (node.module or "").startswith("distcourse"):
                base = node.module.removeprefix("distcourse").lstrip(".")
            else:
                continue
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}".lstrip(".") for n in names if f"{base}.{n}".lstrip(".") in MODULES]
            found.append((base, [n for n in names if f"{base}.{n}".lstrip(".") not in MODULES]))
            found.extend((sub, []) for sub in submodules)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("distcourse."):
                    found.append((alias.name.removeprefix("distcourse."), []))
    return found


def builds_on(path: Path) -> set[str]:
    """The topic modules a docstring's ``Builds on:`` line names (``common/`` ones need no declaring)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    names = set()
    for line in BUILDS_ON.findall(doc):
        for item in re.split(r"[,;]", re.sub(r"\([^)]*\)?", "", line)):
            name = item.strip().strip("`.").removesuffix(".py").strip("`")
            if name and not name.startswith("common/"):
                names.add(name)
    return names


ALLOWED = {
    "runtime": {"runtime"},
    "common": {"runtime", "common"},
    "topic": {"runtime", "common"},
    "exercises": {"runtime", "common", "topic", "exercises"},
    "scripts": {"runtime", "common", "topic", "scripts"},
    "package": {"runtime", "common", "package"},
}


def test_every_module_imports_only_what_its_room_allows():
    wrong = []
    for name, path in MODULES.items():
        declared = builds_on(path)
        for target, _ in imports_of(path, name):
            if target == name or target == "":
                continue
            allowed = room(target) in ALLOWED[room(name)]
            if room(name) == "topic" and room(target) == "topic":
                allowed = target in declared or target.split(".")[0] == name.split(".")[0]  # a package's own files
            if not allowed:
                wrong.append(f"{name} imports {target}")
    assert not wrong, (
        "imports across rooms (declare a build-on with 'Builds on: x' or move it to common/):\n" + "\n".join(wrong)
    )


def test_declared_build_ons_exist():
    for name, path in MODULES.items():
        for target in builds_on(path):
            assert target in TOPICS, f"{name}: 'Builds on: {target}' names no topic module"


def private_uses(tree: ast.AST, module_aliases: set[str]) -> list[str]:
    """``from x import _y`` of package modules, and ``alias._y`` where alias is a package module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("distcourse")):
            found += [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases:
            if _private(node.attr):
                found.append(f"{node.value.id}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to distcourse modules: ``from distcourse import ddp``, ``import distcourse.x as y``."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("distcourse")):
            aliases.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("distcourse"))
    return aliases


def test_no_private_name_crosses_a_module():
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{name}: {use}" for use in private_uses(tree, module_aliases(tree))]
    for notebook in sorted((ROOT / "chapters" / "en").glob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
        tree = ast.parse(source)
        found += [f"{notebook.name}: {use}" for use in private_uses(tree, module_aliases(tree))]
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_every_function_fits_on_a_screen():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions of {MAX_FUNCTION_LINES} lines or more:\n" + "\n".join(long)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from distcourse import ddp\nddp._SumOverRanks", ["ddp._SumOverRanks"]),
        ("from distcourse.sharding import _batch", ["from distcourse.sharding import _batch"]),
        ("from distcourse import ddp\nddp.SumOverRanks\nx = object()\nx._y", []),
    ],
)
def test_the_private_name_check_finds_what_it_should(source, expected):
    tree = ast.parse(source)
    assert private_uses(tree, module_aliases(tree)) == expected
