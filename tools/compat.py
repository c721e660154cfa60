#!/usr/bin/env python3
"""Run the course on another torch release and record the result; render the "Tested with" page.

    python tools/compat.py run 2.15.0                  # venv, fast tier, every English notebook
    python tools/compat.py run 2.15.0 --notebooks 03,07 # only chapters whose name starts so
    python tools/compat.py run 2.11.0 --only-fast      # the fast tier only (no notebooks)
    python tools/compat.py page                        # tested-with.md from compat/*.json
    python tools/compat.py pair                        # torchvision releases and the torch they require

CI runs the whole suite on the torch pinned in requirements.txt. Learners bring their own
(Colab's, or the newest `pip install torch`), so each supported release gets an environment of
its own, .venv-compat/torch-<version>/, with that torch and the torchvision built for it,
straight from the package index: on Linux those are CUDA builds (about 5 GB with the NVIDIA
packages), and they run on a CPU. Every other requirement keeps its pin.

Some machines cap torch with a pip constraint file (pip's `constraint` setting). The
environment lifts it for its own pip calls only, by pointing PIP_CONSTRAINT at a constraint
file of its own that pins the chosen torch and torchvision (so that lightning, deepspeed or
accelerate cannot replace them either); `.venv` and the machine's pip settings are untouched.

A run writes compat/torch-<version>.json (committed) and regenerates tested-with.md. Running
a subset of notebooks updates those notebooks' entries and keeps the others, each with its
own date. The exit status is 1 when a test or a notebook failed.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT_DIR = ROOT / "compat"
VENVS = ROOT / ".venv-compat"
PAGE = ROOT / "tested-with.md"
NOTEBOOKS = ROOT / "chapters" / "en"

SUPPORT = ROOT / "code" / "distcourse" / "runtime" / "support.py"


def supported_window(path: Path = SUPPORT) -> tuple:
    """distcourse's SUPPORTED_TORCH (oldest and newest minor release), read without importing
    the package: this script runs on a bare Python, without torch."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SUPPORTED_TORCH" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise SystemExit(f"{path} does not define SUPPORTED_TORCH")


SUPPORTED = supported_window()

# torch release -> the torchvision release to install with it. Read from torchvision's
# `Requires-Dist: torch` (`python tools/compat.py pair`): up to 0.29.0 each torchvision pins
# one torch exactly; 0.29.1 and 0.29.2 require torch>=2.14.0, and 0.29.2 is the newest
# torchvision the index serves for torch 2.15.0.
TORCHVISION = {
    "2.11.0": "0.26.0",
    "2.12.0": "0.27.0",
    "2.12.1": "0.27.1",
    "2.13.0": "0.28.0",
    "2.14.0": "0.29.0",
    "2.14.1": "0.29.1",
    "2.15.0": "0.29.2",
}

# torchao release -> the oldest torch it loads its kernels on. torchao declares no torch
# requirement, so pip never checks the pair; from 0.17.0 on it is built against torch's stable
# ABI and gates its kernels on torch >= 2.11.0 (`min_torch_version` in torchao/__init__.py),
# so the one pin in requirements.txt serves every release of the window.
TORCHAO_MIN_TORCH = {"0.17.0": "2.11.0", "0.18.0": "2.11.0"}

FAST_TIER = ["tests", "-m", "not slow and not stress", "-q"]
# Seconds. A notebook's own cells have a 300 s limit each (pyproject.toml); this bounds a hang
# of the whole run, e.g. a kernel that never starts.
NOTEBOOK_TIMEOUT, FAST_TIMEOUT = 1200, 3600


# ------------------------------------------------------------------ versions and environments
def version_key(version: str) -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def in_window(version: str) -> bool:
    return version_key(SUPPORTED[0]) <= version_key(minor(version)) <= version_key(SUPPORTED[1])


def torchvision_for(torch: str) -> str:
    if torch not in TORCHVISION:
        known = ", ".join(sorted(TORCHVISION, key=version_key))
        raise SystemExit(
            f"no torchvision is paired with torch {torch} (known: {known}).\n"
            "Run `python tools/compat.py pair` to read which torch each torchvision requires, "
            "then add the pair to TORCHVISION in tools/compat.py."
        )
    return TORCHVISION[torch]


def venv_path(torch: str) -> Path:
    return VENVS / f"torch-{torch}"


def pinned_torch(requirements: str) -> str:
    """The torch version requirements.txt pins (what CI tests)."""
    match = re.search(r"^torch==(\S+)", requirements, flags=re.M)
    return match.group(1) if match else "?"


def pinned_torchao(requirements: str) -> str | None:
    match = re.search(r"^torchao==(\S+)", requirements, flags=re.M)
    return match.group(1) if match else None


def torchao_loads_on(torchao: str, torch: str) -> bool:
    """Whether torchao ``torchao`` loads its kernels on torch ``torch`` (TORCHAO_MIN_TORCH)."""
    if torchao not in TORCHAO_MIN_TORCH:
        raise SystemExit(
            f"no torch range is known for torchao {torchao}: add it to TORCHAO_MIN_TORCH in tools/compat.py"
        )
    return version_key(torch) >= version_key(TORCHAO_MIN_TORCH[torchao])


def other_requirements(requirements: str) -> str:
    """requirements.txt without torch and torchvision: the environment brings its own."""
    keep = [line for line in requirements.splitlines() if not re.match(r"^\s*(torch|torchvision)\s*[=<>~!]", line)]
    return "\n".join(keep) + "\n"


def constraints(torch: str, torchvision: str) -> str:
    """What pip must keep while installing everything else into the environment."""
    return f"torch=={torch}\ntorchvision=={torchvision}\n"


def compat_env(venv: Path, constraint_file: str, base: dict | None = None) -> dict:
    """The environment of the compatibility venv's commands; os.environ itself is not changed.

    PIP_CONSTRAINT overrides pip's `constraint` setting (environment beats configuration
    files): the machine's cap is lifted for this venv's pip calls and replaced by its own pins.
    The pip cache lives in the venv so that the gigabytes of CUDA wheels can be deleted with it.
    """
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONHOME", None)
    env.update(
        PIP_CONSTRAINT=constraint_file,
        PIP_CACHE_DIR=str(venv / ".pip-cache"),
        VIRTUAL_ENV=str(venv),
        # Notebooks start `torchrun` and `python` by name: they must be this venv's.
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def run(cmd: list, env: dict, **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT, **kwargs)


def served_versions(package: str) -> list[str] | None:
    """Versions of `package` the configured indexes serve (cap lifted); None if pip cannot say."""
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    cmd = [sys.executable, "-m", "pip", "index", "versions", package]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    match = re.search(r"^Available versions: (.*)$", result.stdout, flags=re.M)
    return [v.strip() for v in match.group(1).split(",")] if match else None


def check_served(torch: str, torchvision: str) -> None:
    for package, version in (("torch", torch), ("torchvision", torchvision)):
        served = served_versions(package)
        if served is not None and version not in served:
            raise SystemExit(
                f"{package} {version} is not served by the package index for Python "
                f"{platform.python_version()} on {platform.machine()} "
                f"(served: {', '.join(served[:12])}, ...)."
            )


def install_stamp(torch: str, torchvision: str) -> str:
    """Changes when anything that decides the venv's contents changes."""
    digest = hashlib.sha256()
    for name in ("requirements.txt", "pyproject.toml"):
        digest.update((ROOT / name).read_bytes())
    return f"torch=={torch} torchvision=={torchvision} {digest.hexdigest()}\n"


def ensure_venv(torch: str, torchvision: str, python: str, keep_cache: bool) -> Path:
    """Create or update .venv-compat/torch-<version>/; a stamp skips a second identical install."""
    venv = venv_path(torch)
    stamp, wanted = venv / ".compat-installed", install_stamp(torch, torchvision)
    if stamp.is_file() and stamp.read_text() == wanted:
        return venv
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pins, rest = venv / "constraints.txt", venv / "requirements.txt"
    pins.write_text(constraints(torch, torchvision))
    rest.write_text(other_requirements((ROOT / "requirements.txt").read_text()))
    env = compat_env(venv, str(pins))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    for args in ([f"torch=={torch}", f"torchvision=={torchvision}"], ["-r", str(rest)], ["--no-deps", "-e", "."]):
        if run(pip + args, env).returncode != 0:
            raise SystemExit(f"pip install {' '.join(args)} failed in {venv} (its pip cache is kept for a retry)")
    if not keep_cache:
        shutil.rmtree(venv / ".pip-cache", ignore_errors=True)
    stamp.write_text(wanted)
    return venv


PROBE = """
import importlib.metadata as md, json, platform, sys, torch
print(json.dumps({
    "torch": md.version("torch"), "torch_build": torch.__version__, "cuda": torch.version.cuda,
    "torchvision": md.version("torchvision"), "python": platform.python_version(),
    "torchao": next((d.version for d in md.distributions(name="torchao")), None),
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
}))
"""


def probe(venv: Path, env: dict) -> dict:
    """What the venv really holds (torchvision read from its metadata: importing it may abort)."""
    out = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"import torch failed in {venv}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")), "")
    mem = next((int(line.split()[1]) for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return {
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**20, 1),
    }


def _lines(path: str) -> list[str]:
    return Path(path).read_text().splitlines() if Path(path).is_file() else []


# ------------------------------------------------------------------ test results (JUnit XML)
ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*[A-Za-z]")
# "ValueError: ...", "torch.AcceleratorError", "LaunchTimeout: ...": an exception's own line.
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Timeout|Abort\w*)(?::.*)?$")
# The failing source line: IPython's "----> 8 assert ..." or pytest's ">       assert ...".
CODE_LINE = re.compile(r"^(?:-+> *\d+|>) +(.*)$")


def one_line(text: str, limit: int = 240) -> str:
    """The line that names what went wrong in a pytest or nbval report.

    A C++ abort's `what():` first (the Python side only sees the signal), then timeouts, then
    the last exception line; a bare `AssertionError:` gets the assert it comes from.
    """
    lines = [re.sub(r"^E +", "", line.strip()) for line in ANSI.sub("", text or "").splitlines()]
    lines = [line for line in lines if line]
    if any("Cell outputs differ" in line for line in lines):
        return "Cell outputs differ"
    special = [line for line in lines if line.startswith(("what():", "Timeout", "Failed: Timeout"))]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    line = special[0] if special else errors[-1] if errors else lines[-1] if lines else "no message"
    if line.rstrip(":") == line.split(":", 1)[0] and ERROR_LINE.match(line):
        code = [m.group(1) for m in map(CODE_LINE.match, lines) if m]
        line = f"{line.rstrip(':')}: {code[-1]}" if code else line
    line = " ".join(line.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def junit_cases(path: Path) -> list[dict]:
    """[{name, classname, seconds, outcome, text}] from pytest's --junitxml report."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = next((case.find(tag) for tag in ("failure", "error", "skipped") if case.find(tag) is not None), None)
        outcome = "passed" if problem is None else {"failure": "failed"}.get(problem.tag, problem.tag)
        # The report's text holds the whole traceback; the message attribute is a shortened copy.
        text = "" if problem is None else (problem.text or problem.get("message", ""))
        name = case.get("name", "")
        cases.append({"name": name, "classname": case.get("classname", ""), "outcome": outcome, "text": text})
        cases[-1]["seconds"] = float(case.get("time", 0) or 0)
    return cases


def code_cell_index(notebook: Path) -> list[int]:
    """nbval's "Cell N" counts code cells only: position of each in the notebook's list of cells."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return [i for i, cell in enumerate(cells) if cell["cell_type"] == "code"]


def notebook_result(cases: list[dict], positions: list[int]) -> dict:
    """One notebook's entry: passed, or the first failing cell and why."""
    failed = [c for c in cases if c["outcome"] in ("failed", "error")]
    result = {"status": "failed" if failed or not cases else "passed", "cells": len(cases)}
    result["seconds"] = round(sum(c["seconds"] for c in cases), 1)
    if not cases:
        result["reason"] = "no cell ran"
    if failed:
        first = failed[0]
        number = re.search(r"Cell (\d+)", first["name"])
        if number:
            result["cell"] = int(number.group(1))
            if result["cell"] < len(positions):
                result["notebook_cell"] = positions[result["cell"]]
        result["reason"] = one_line(first["text"])
        result["failed_cells"] = len(failed)
    return result


def fast_result(cases: list[dict], seconds: float) -> dict:
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    failures = [
        {"test": f"{c['classname']}::{c['name']}", "reason": one_line(c["text"])}
        for c in cases
        if c["outcome"] in ("failed", "error")
    ]
    return {**counts, "seconds": round(seconds, 1), "failures": failures}


def pytest_run(venv: Path, env: dict, args: list, report: Path, timeout: int) -> tuple[list | None, str]:
    """Run pytest in the venv; (cases, "") or (None, why there is no report)."""
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", *args, f"--junitxml={report}"]
    try:
        out = run(cmd, env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    if report.is_file():
        return junit_cases(report), ""
    return None, f"pytest exited with {out.returncode} without a report: {one_line(out.stdout + out.stderr)}"


def run_fast(venv: Path, env: dict, scratch: Path) -> dict:
    start = time.perf_counter()
    cases, why = pytest_run(venv, env, FAST_TIER, scratch / "fast.xml", FAST_TIMEOUT)
    if cases is None:
        return {
            "passed": 0,
            "failed": 0,
            "error": 1,
            "skipped": 0,
            "seconds": 0,
            "failures": [{"test": "", "reason": why}],
        }
    result = fast_result(cases, time.perf_counter() - start)
    print(f"fast tier: {result['passed']} passed, {result['failed']} failed, {result['error']} errors", flush=True)
    return result


def run_notebook(venv: Path, env: dict, notebook: Path, scratch: Path) -> dict:
    args = [str(notebook.relative_to(ROOT)), "-q"]
    cases, why = pytest_run(venv, env, args, scratch / f"{notebook.stem}.xml", NOTEBOOK_TIMEOUT)
    result = notebook_result(cases, code_cell_index(notebook)) if cases is not None else {"status": "failed"}
    if cases is None:
        result["reason"] = why
    result["date"] = today()
    where = f" at cell {result['cell']}" if "cell" in result else ""
    print(f"{notebook.stem}: {result['status']}{where} {result.get('reason', '')}", flush=True)
    return result


def select_notebooks(prefixes: str | None) -> list[Path]:
    notebooks = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    if not prefixes:
        return notebooks
    wanted = [p.strip() for p in prefixes.split(",") if p.strip()]
    chosen = [nb for nb in notebooks if any(nb.stem.startswith(p) for p in wanted)]
    if not chosen:
        raise SystemExit(f"no notebook in {NOTEBOOKS.relative_to(ROOT)} starts with {', '.join(wanted)}")
    return chosen


def today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


# ------------------------------------------------------------------ records
def record_path(torch: str) -> Path:
    return COMPAT_DIR / f"torch-{torch}.json"


def merge(old: dict | None, new: dict, partial: bool) -> dict:
    """A partial run replaces what it ran and keeps the rest, if the builds are the same."""
    if not old or (old.get("torch_build"), old.get("torchvision")) != (new["torch_build"], new["torchvision"]):
        return new
    merged = {**old, **{k: v for k, v in new.items() if k not in ("notebooks", "fast")}}
    kept = old.get("notebooks", {}) if partial else {}
    merged["notebooks"] = {**kept, **new.get("notebooks", {})}
    merged["fast"] = new.get("fast") or old.get("fast")
    return merged


def failed(record: dict) -> bool:
    fast = record.get("fast") or {}
    return bool(fast.get("failed") or fast.get("error")) or any(
        nb["status"] != "passed" for nb in record.get("notebooks", {}).values()
    )


def load_records(folder: Path = COMPAT_DIR) -> list[dict]:
    records = [json.loads(p.read_text(encoding="utf-8")) for p in folder.glob("torch-*.json")]
    return sorted(records, key=lambda r: version_key(r["torch"]))


# ------------------------------------------------------------------ the page
TITLE = "# Tested with"  # each language book shows its own (tools/book_interface.yml: page_titles)
# Book tags of tools/course_book.py: each language book shows only its own block of the page.
BOOKS = {"en": "en", "ru": "ru", "zh-CN": "zh_CN", "zh-TW": "zh_TW", "pt-BR": "pt_BR", "ko": "ko"}
# The page's words in every language of the book. A table of our own rather than the figure-text
# catalogs, because this tool runs without the course package's environment (compat venvs).
WORDS = {
    "en": {
        "intro": (
            "The course supports **torch {lo} through {hi}**. Continuous integration runs the whole test\n"
            "suite on every change with the pinned **torch {pinned}** (`requirements.txt`, a CPU build).\n"
            "Every other release below was tested in an environment of its own, with that torch and its\n"
            "torchvision as the package index serves them (on Linux, CUDA builds, here running on a CPU)\n"
            "and every other requirement at its pin: the fast test tier, then every English chapter\n"
            "executed cell by cell. `make compat TORCH=<version>` repeats one; a scheduled workflow reruns\n"
            "the oldest and the newest supported release every week."
        ),
        "header": ["torch", "torchvision", "Python", "machine", "fast tier", "chapters passed", "date"],
        "machine": "{cores} cores, {gpu}",
        "gpu": "GPU",
        "no gpu": "no GPU",
        "tier": "{passed} passed, {failed} failed",
        "not run": "not run",
        "of": "{passed} of {total}",
        "chapter": "chapter",
        "cell": "cell {cell}",
        "code cell": "code cell {cell}",
        "none": "No release has been recorded yet (`make compat TORCH=<version>`).",
        "failures": "Failures (code cells are counted from 0, as `pytest --nbval` names them):",
        "fast tier": "fast tier",
        "cases": "{count} cases",
    },
    "ru": {
        "intro": (
            "Курс поддерживает **torch от {lo} до {hi}**. Непрерывная интеграция при каждом изменении\n"
            "прогоняет все тесты с закреплённой версией **torch {pinned}** (`requirements.txt`, сборка для CPU).\n"
            "Каждый другой выпуск из таблицы проверен в отдельном окружении: с этим torch и его torchvision\n"
            "в том виде, в каком их отдаёт индекс пакетов (на Linux это сборки CUDA, здесь работающие на CPU),\n"
            "и с остальными зависимостями закреплённых версий. Сначала идёт быстрый набор тестов, затем\n"
            "каждая английская глава выполняется ячейка за ячейкой. `make compat TORCH=<версия>` повторяет\n"
            "проверку; плановый workflow раз в неделю перезапускает самый старый и самый новый выпуск."
        ),
        "header": ["torch", "torchvision", "Python", "машина", "быстрые тесты", "главы пройдены", "дата"],
        "machine": "ядер: {cores}, {gpu}",
        "gpu": "есть GPU",
        "no gpu": "без GPU",
        "tier": "пройдено {passed}, не пройдено {failed}",
        "not run": "не запускались",
        "of": "{passed} из {total}",
        "chapter": "глава",
        "cell": "ячейка {cell}",
        "code cell": "ячейка кода {cell}",
        "none": "Ни один выпуск пока не проверен (`make compat TORCH=<версия>`).",
        "failures": "Что не прошло (ячейки кода нумеруются с 0, как их называет `pytest --nbval`):",
        "fast tier": "быстрые тесты",
        "cases": "случаев: {count}",
    },
    "zh-CN": {
        "intro": (
            "本课程支持 **torch {lo} 至 {hi}**。每次改动后，持续集成都会用固定版本 **torch {pinned}**"
            "（`requirements.txt`，CPU 构建）运行全部测试。下表中的其他版本各在独立的环境中测试："
            "torch 及其 torchvision 取自包索引提供的版本（Linux 上是 CUDA 构建，这里在 CPU 上运行），"
            "其余依赖都用固定版本；先跑快速测试，再逐个单元格执行每一章英文版。"
            "`make compat TORCH=<版本>` 可以重跑某个版本；定时 workflow 每周重跑支持范围内最旧和最新的版本。"
        ),
        "header": ["torch", "torchvision", "Python", "机器", "快速测试", "通过的章节", "日期"],
        "machine": "{cores} 核，{gpu}",
        "gpu": "有 GPU",
        "no gpu": "无 GPU",
        "tier": "通过 {passed}，失败 {failed}",
        "not run": "未运行",
        "of": "{passed} / {total}",
        "chapter": "章节",
        "cell": "单元格 {cell}",
        "code cell": "代码单元格 {cell}",
        "none": "尚未记录任何版本（`make compat TORCH=<版本>`）。",
        "failures": "失败项（代码单元格从 0 开始编号，与 `pytest --nbval` 的编号一致）：",
        "fast tier": "快速测试",
        "cases": "{count} 例",
    },
    "zh-TW": {
        "intro": (
            "本課程支援 **torch {lo} 至 {hi}**。每次變更後，持續整合都會以固定版本 **torch {pinned}**"
            "（`requirements.txt`，CPU 建置）執行全部測試。下表中的其他版本各在獨立的環境中測試："
            "torch 與其 torchvision 取自套件索引提供的版本（Linux 上是 CUDA 建置，這裡在 CPU 上執行），"
            "其餘相依套件都用固定版本；先跑快速測試，再逐格執行每一章英文版。"
            "`make compat TORCH=<版本>` 可以重跑某個版本；排程 workflow 每週重跑支援範圍內最舊與最新的版本。"
        ),
        "header": ["torch", "torchvision", "Python", "機器", "快速測試", "通過的章節", "日期"],
        "machine": "{cores} 核心，{gpu}",
        "gpu": "有 GPU",
        "no gpu": "無 GPU",
        "tier": "通過 {passed}，失敗 {failed}",
        "not run": "未執行",
        "of": "{passed} / {total}",
        "chapter": "章節",
        "cell": "儲存格 {cell}",
        "code cell": "程式碼儲存格 {cell}",
        "none": "尚未記錄任何版本（`make compat TORCH=<版本>`）。",
        "failures": "失敗項目（程式碼儲存格從 0 起算，與 `pytest --nbval` 的編號一致）：",
        "fast tier": "快速測試",
        "cases": "{count} 例",
    },
    "pt-BR": {
        "intro": (
            "O curso suporta **torch {lo} a {hi}**. A integração contínua roda a suíte de testes inteira\n"
            "a cada mudança com a versão fixada, **torch {pinned}** (`requirements.txt`, build para CPU).\n"
            "Cada uma das outras versões abaixo foi testada num ambiente próprio, com esse torch e o\n"
            "torchvision correspondente como o índice de pacotes os entrega (no Linux, builds CUDA, aqui\n"
            "rodando em CPU) e as demais dependências nas versões fixadas: primeiro a bateria rápida de\n"
            "testes, depois cada capítulo em inglês executado célula por célula. `make compat TORCH=<versão>`\n"
            "repete um teste; um workflow agendado reexecuta toda semana a versão mais antiga e a mais nova."
        ),
        "header": ["torch", "torchvision", "Python", "máquina", "testes rápidos", "capítulos aprovados", "data"],
        "machine": "{cores} núcleos, {gpu}",
        "gpu": "com GPU",
        "no gpu": "sem GPU",
        "tier": "{passed} aprovados, {failed} com falha",
        "not run": "não executados",
        "of": "{passed} de {total}",
        "chapter": "capítulo",
        "cell": "célula {cell}",
        "code cell": "célula de código {cell}",
        "none": "Nenhuma versão foi registrada ainda (`make compat TORCH=<versão>`).",
        "failures": "Falhas (as células de código são contadas a partir de 0, como o `pytest --nbval` as numera):",
        "fast tier": "testes rápidos",
        "cases": "{count} casos",
    },
    "ko": {
        "intro": (
            "이 과정은 **torch {lo}부터 {hi}까지** 지원합니다. 지속적 통합(CI)은 변경이 있을 때마다 고정 버전인\n"
            "**torch {pinned}**(`requirements.txt`, CPU 빌드)로 전체 테스트를 실행합니다. 표의 다른 릴리스는\n"
            "각각 별도 환경에서 테스트했습니다. torch와 torchvision은 패키지 인덱스가 제공하는 그대로\n"
            "(Linux에서는 CUDA 빌드이며 여기서는 CPU에서 실행), 나머지 의존성은 고정 버전으로 설치하고\n"
            "빠른 테스트를 먼저 돌린 뒤 영어판 각 장을 셀 단위로 실행합니다. `make compat TORCH=<버전>`으로\n"
            "다시 실행할 수 있고, 예약된 워크플로가 매주 지원 범위의 가장 오래된 릴리스와\n"
            "최신 릴리스를 다시 테스트합니다."
        ),
        "header": ["torch", "torchvision", "Python", "머신", "빠른 테스트", "통과한 장", "날짜"],
        "machine": "코어 {cores}개, {gpu}",
        "gpu": "GPU 있음",
        "no gpu": "GPU 없음",
        "tier": "통과 {passed}, 실패 {failed}",
        "not run": "실행 안 함",
        "of": "{total}개 중 {passed}개",
        "chapter": "장",
        "cell": "셀 {cell}",
        "code cell": "코드 셀 {cell}",
        "none": "아직 기록된 릴리스가 없습니다(`make compat TORCH=<버전>`).",
        "failures": "실패 항목(코드 셀 번호는 `pytest --nbval`과 같이 0부터 셉니다):",
        "fast tier": "빠른 테스트",
        "cases": "{count}건",
    },
}


def cell_mark(entry: dict | None, words: dict = WORDS["en"]) -> str:
    if entry is None:
        return "–"
    if entry["status"] == "passed":
        return f"✅ {entry.get('date', '')}".strip()
    where = " " + words["cell"].format(cell=entry["cell"]) if "cell" in entry else ""
    return f"❌{where} ({entry.get('date', '')})"


def code_span(text: str) -> str:
    return "`" + text.replace("`", "'") + "`"


def render_page(records: list[dict], chapters: list[str], pinned: str) -> str:
    """tested-with.md: the window, one column per recorded torch, one row per chapter.

    One block per language, shown only in that language's book (``{only} book_<locale>``)."""
    lo, hi = SUPPORTED
    lines = [
        "% Generated by `python tools/compat.py page` from compat/*.json; edit those, not this page.",
        "",
        TITLE,
        "",
    ]
    for lang, words in WORDS.items():
        block = [words["intro"].format(lo=lo, hi=hi, pinned=pinned), ""]
        block += [*environment_table(records, words), "", *chapter_matrix(records, chapters, lang, words), ""]
        block += failure_list(records, words)
        body = "\n".join(block).rstrip()
        lines += [f"```{{only}} book_{BOOKS[lang]}", body, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def environment_table(records: list[dict], words: dict = WORDS["en"]) -> list[str]:
    if not records:
        return [words["none"]]
    lines = ["| " + " | ".join(words["header"]) + " |", "|---" * 7 + "|"]
    for r in records:
        fast = r.get("fast")
        tier = (
            words["tier"].format(passed=fast["passed"], failed=fast["failed"] + fast["error"])
            if fast
            else words["not run"]
        )
        notebooks = r.get("notebooks", {})
        passed = sum(nb["status"] == "passed" for nb in notebooks.values())
        build = r["torch_build"] + (f" (CUDA {r['cuda']})" if r.get("cuda") else "")
        where = words["machine"].format(cores=r["machine"]["cores"], gpu=words["gpu" if r.get("gpu") else "no gpu"])
        lines.append(
            f"| {build} | {r['torchvision']} | {r['python']} | {where} | {tier} "
            f"| {words['of'].format(passed=passed, total=len(notebooks))} | {r['date'][:10]} |"
        )
    return lines


def chapter_matrix(records: list[dict], chapters: list[str], lang: str = "en", words: dict = WORDS["en"]) -> list[str]:
    if not records:
        return []
    names = sorted(set(chapters) | {name for r in records for name in r.get("notebooks", {})})
    lines = [
        f"| {words['chapter']} | " + " | ".join(f"torch {r['torch']}" for r in records) + " |",
        "|---" * (len(records) + 1) + "|",
    ]
    for name in names:
        marks = [cell_mark(r.get("notebooks", {}).get(name), words) for r in records]
        lines.append(f"| [{name}](chapters/{lang}/{name}.ipynb) | " + " | ".join(marks) + " |")
    return lines


def failure_list(records: list[dict], words: dict = WORDS["en"]) -> list[str]:
    """What failed, with the cell (nbval's count of code cells, from 0) and the error's line."""
    lines = []
    for r in records:
        for name, nb in sorted(r.get("notebooks", {}).items()):
            if nb["status"] != "passed":
                where = ", " + words["code cell"].format(cell=nb["cell"]) if "cell" in nb else ""
                lines.append(f"- torch {r['torch']}, {name}{where}: {code_span(nb.get('reason', ''))}")
        for test, (count, reason) in fast_failure_groups(r).items():
            times = " (" + words["cases"].format(count=count) + ")" if count > 1 else ""
            lines.append(f"- torch {r['torch']}, {words['fast tier']}, {code_span(test)}{times}: {code_span(reason)}")
    if not lines:
        return []
    return [words["failures"], ""] + lines + [""]


def fast_failure_groups(record: dict) -> dict:
    """{test function: (failed cases, first reason)}: one line per test, not per parameter."""
    groups = {}
    for failure in (record.get("fast") or {}).get("failures", []):
        test = failure["test"].split("[", 1)[0]
        count, reason = groups.get(test, (0, failure["reason"]))
        groups[test] = (count + 1, reason)
    return groups


def write_page() -> None:
    chapters = [p.stem for p in sorted(NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))]
    pinned = pinned_torch((ROOT / "requirements.txt").read_text())
    PAGE.write_text(render_page(load_records(), chapters, pinned), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")


# ------------------------------------------------------------------ commands
def cmd_run(args) -> int:
    torch = args.torch
    if not in_window(torch):
        print(f"note: torch {torch} is outside the supported window {SUPPORTED[0]}-{SUPPORTED[1]}", flush=True)
    torchvision = torchvision_for(torch)
    torchao = pinned_torchao((ROOT / "requirements.txt").read_text())
    if torchao and not torchao_loads_on(torchao, torch):
        print(f"note: torchao {torchao} skips its kernels on torch {torch} (needs {TORCHAO_MIN_TORCH[torchao]})")
    notebooks = [] if args.only_fast else select_notebooks(args.notebooks)
    check_served(torch, torchvision)
    start = time.perf_counter()
    venv = ensure_venv(torch, torchvision, args.python, args.keep_cache)
    env = compat_env(venv, str(venv / "constraints.txt"))
    record = {**probe(venv, env), "machine": machine(), "notebooks": {}, "fast": None}
    record["install_seconds"] = round(time.perf_counter() - start)  # about 0 when the venv was ready
    if record["torch"] != torch:
        raise SystemExit(f"{venv} holds torch {record['torch']}, not {torch}: something replaced it")
    with tempfile.TemporaryDirectory(prefix="compat-") as scratch:
        if not args.no_fast:
            record["fast"] = run_fast(venv, env, Path(scratch))
        for notebook in notebooks:
            record["notebooks"][notebook.stem] = run_notebook(venv, env, notebook, Path(scratch))
    record["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record["seconds"] = round(time.perf_counter() - start)
    path = record_path(torch)
    old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    record = merge(old, record, partial=bool(args.notebooks or args.only_fast))
    COMPAT_DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)} in {record['seconds']} s")
    write_page()
    return 1 if failed(record) else 0


def cmd_pair(args) -> int:
    """Print the torch requirement of the newest torchvision releases (from their metadata)."""
    served = served_versions("torchvision") or []
    for version in served[: args.last]:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet"]
            cmd += ["--report", str(report), f"torchvision=={version}"]
            subprocess.run(cmd, env={**os.environ, "PIP_CONSTRAINT": os.devnull}, check=True)
            requires = json.loads(report.read_text())["install"][0]["metadata"].get("requires_dist", [])
        print(f"torchvision {version}: " + ", ".join(r for r in requires if r.startswith("torch ")))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="test one torch release and record it in compat/")
    run_parser.add_argument("torch", help="a torch release, e.g. 2.15.0")
    run_parser.add_argument("--notebooks", help="comma-separated chapter prefixes, e.g. 03,07-torchrun")
    run_parser.add_argument("--only-fast", action="store_true", help="run the fast tier only, no notebooks")
    run_parser.add_argument("--no-fast", action="store_true", help="run notebooks only, not the fast tier")
    run_parser.add_argument("--python", default=sys.executable, help="interpreter the venv is made from")
    run_parser.add_argument("--keep-cache", action="store_true", help="keep the venv's pip cache after installing")
    commands.add_parser("page", help="write tested-with.md from compat/*.json")
    pair_parser = commands.add_parser("pair", help="show which torch the newest torchvision releases require")
    pair_parser.add_argument("--last", type=int, default=6, help="how many torchvision releases (default 6)")
    args = parser.parse_args()
    if args.command == "run":
        if args.only_fast and args.no_fast:
            parser.error("--only-fast and --no-fast exclude each other")
        return cmd_run(args)
    if args.command == "pair":
        return cmd_pair(args)
    write_page()
    return 0


if __name__ == "__main__":
    sys.exit(main())
