"""What a notebook's outputs depend on besides its own cells: the files its execution reads.

The book caches each notebook's outputs (tools/build_book.py). When a file under ``code/``
changes, only the notebooks that run that file must execute again. This finds them by
reading code, not by running it:

* the modules a notebook's code cells import (``import distcourse``, ``from distcourse
  import capstone``, ``from distcourse.common import timing``), and, transitively, the
  modules those import (relative imports resolved); importing ``a.b.c`` also runs the
  packages ``a`` and ``a.b``;
* modules named in strings, which ranks and subprocesses import by name
  (``python -m distcourse.capstone``, ``module="distcourse.scripts.crashing_train"``);
* package data whose file name a dependency mentions (``slurm_train.sbatch``);
* the figure-text catalog of the notebook's own language (``code/<pkg>/locale/<lang>.yml``,
  for a notebook in ``chapters/<lang>/``), not the other languages' catalogs.

What it cannot see: a module imported under a name computed at run time. The course
does not do that; ``tests/book/test_notebook_inputs.py`` checks that every module a real
notebook's execution loads is among the inputs found here.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import nbformat

# A dotted name in a string: a module run with -m, or imported by name inside a rank.
DOTTED = re.compile(r"\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)\b")


def module_index(code: Path) -> dict[str, Path]:
    """Every module under ``code/`` by dotted name (a package by its ``__init__.py``)."""
    index = {}
    for path in sorted(code.rglob("*.py")):
        parts = list(path.relative_to(code).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            index[".".join(parts)] = path
    return index


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def imported_names(source: str, package: str = "") -> set[str]:
    """Dotted names that ``source`` imports or names in strings (may include non-modules)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics and shell escapes: drop those lines and retry
        lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        tree = ast.parse("\n".join(lines))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y inside package p.q -> p.x (level 1)
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # "from pkg import module"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(DOTTED.findall(node.value))
    return names


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def module_closure(names: set[str], index: dict[str, Path]) -> set[str]:
    """The modules of ``index`` that importing ``names`` runs, directly or through other modules."""
    todo = [m for n in names for m in _with_parents(n) if m in index]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        source = index[name].read_text(encoding="utf-8")
        found = imported_names(source, _package_of(name, index[name]))
        todo.extend(m for n in found for m in _with_parents(n) if m in index and m not in seen)
    return seen


def data_files(code: Path, modules: set[str], index: dict[str, Path]) -> set[Path]:
    """Package data (everything under ``code/`` but Python and catalogs) that the modules mention by name."""
    candidates = [p for p in code.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc", ".yml")]
    texts = [index[m].read_text(encoding="utf-8") for m in modules]
    return {p for p in candidates if any(p.name in text for text in texts)}


def notebook_language(notebook: Path, root: Path) -> str | None:
    parts = notebook.resolve().relative_to(root.resolve()).parts
    return parts[1] if len(parts) >= 3 and parts[0] == "chapters" else None


def notebook_inputs(notebook: Path, root: Path) -> list[Path]:
    """The files under ``root/code`` whose change can change ``notebook``'s outputs, sorted."""
    code = root / "code"
    index = module_index(code)
    nb = nbformat.read(notebook, as_version=4)
    names: set[str] = set()
    for cell in nb.cells:
        if cell.cell_type == "code":
            names |= imported_names(cell.source)
    modules = module_closure(names, index)
    files = {index[m] for m in modules} | data_files(code, modules, index)
    language = notebook_language(notebook, root)
    if language:
        files.update(code.glob(f"*/locale/{language}.yml"))
    return sorted(files)


def fingerprint(notebook: Path, root: Path, common: list[str]) -> str:
    """sha256 over the notebook's inputs (path and content) and ``common`` lines (config, interpreter)."""
    lines = [
        f"{p.relative_to(root).as_posix()} {hashlib.sha256(p.read_bytes()).hexdigest()}"
        for p in notebook_inputs(notebook, root)
    ]
    return hashlib.sha256("\n".join([*lines, *common]).encode()).hexdigest()
