"""Safety rules checked on the source of the package, the tools, the tests and every notebook.

- every ``torch.load`` passes ``weights_only=True`` (the course never unpickles code);
- no fixed port and no 0.0.0.0 in the package, tools, benchmarks and notebooks: launches
  bind port 0 on 127.0.0.1 (the SLURM script, a cluster file with its conventional fixed
  port, is not Python and not checked here).
"""

import ast
import pathlib
import re

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY_FILES = sorted(p for folder in ("code", "tools", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py"))
NOTEBOOKS = sorted((ROOT / "chapters").glob("*/*.ipynb"))
THIS_FILE = pathlib.Path(__file__).resolve()


def sources():
    for path in PY_FILES:
        if path != THIS_FILE:
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                # IPython magics and shell escapes are not Python syntax
                code = "\n".join(
                    "" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines()
                )
                yield f"{path.relative_to(ROOT).as_posix()} cell {i}", code


SOURCES = list(sources())


def torch_load_calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "load" and getattr(func.value, "id", "") == "torch":
                yield node


def test_sources_parse():
    for where, code in SOURCES:
        ast.parse(code, filename=where)


def test_every_torch_load_uses_weights_only_true():
    offenders = []
    for where, code in SOURCES:
        for call in torch_load_calls(ast.parse(code)):
            flag = next((k.value for k in call.keywords if k.arg == "weights_only"), None)
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                offenders.append(f"{where}: line {call.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"


# The wrong samples below are assembled from pieces so that this file never contains the
# code it forbids (other tools scan the tree for it as text).
LOAD = "torch." + "load"


def test_the_weights_only_check_can_fail():
    bad = ast.parse(f"import torch\n{LOAD}('x.pt')\n{LOAD}('y.pt', weights_only=False)\n")
    good = ast.parse(f"import torch\n{LOAD}('x.pt', weights_only=True)\n")
    assert len(list(torch_load_calls(bad))) == 2 and len(list(torch_load_calls(good))) == 1


PORT_PATTERNS = [
    re.compile(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0)\s*:\s*\d{2,5}"),  # "host:port" literals
    re.compile(r"MASTER_PORT['\"]?\]?\s*[=:,]\s*['\"]?\d{2,5}"),  # a MASTER_PORT set to digits
    re.compile(r"\bport\s*=\s*\d{2,5}\b"),  # port=<digits> (port=0 asks the OS for a free one)
    re.compile(r"0\.0\.0\.0"),
]


@pytest.mark.parametrize("pattern", PORT_PATTERNS, ids=lambda p: p.pattern)
def test_no_fixed_port_or_wildcard_address(pattern):
    # tests/ is left out: tests hold such strings on purpose, as wrong answers to reject
    hits = [
        f"{where}: {m.group(0)}"
        for where, code in SOURCES
        if not where.startswith("tests/")
        for m in pattern.finditer(code)
    ]
    assert not hits, hits


def test_the_port_check_can_fail():
    port = "29" + "500"
    samples = [
        f'init_method="tcp://127.0.0.1:{port}"',
        'os.environ["MASTER_' + f'PORT"] = "{port}"',
        f"TCPStore(h, port={port})",
    ]
    for sample in samples:
        assert any(p.search(sample) for p in PORT_PATTERNS), sample
    assert not any(p.search('sock.bind(("127.0.0.1", 0))') for p in PORT_PATTERNS)
