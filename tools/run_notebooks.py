"""Execute the English chapters cell by cell and report each cell: for a machine with GPUs.

    python tools/run_notebooks.py                    # every English chapter, one at a time
    python tools/run_notebooks.py --only 06 09       # chapters whose file name starts so
    python tools/run_notebooks.py --json results.json

``make test`` runs the notebooks through nbval on the CPU machines that test the course.
On a machine with GPUs the same notebooks take their GPU branches (nccl, SyncBatchNorm,
DataParallel over GPUs, GPU-only measurements), and what matters there is which cell
fails, so this prints one line per cell, ``PASS``/``FAIL``/``SKIP``, with its seconds
and, for a failure, the error's last line; then a summary per notebook and in total.
It starts with ``python -m distcourse doctor`` so the log says what the machine was.
Exit status 1 if any cell failed. nbclient runs the kernels (the library behind
``jupyter nbconvert --execute``); several notebooks run at once to fit a GPU machine's
time slot (``--parallel``; the default, 1, keeps the timing asserts valid), each in its own
kernel and working directory.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = pathlib.Path(__file__).resolve().parents[1]
CELL_TIMEOUT_S = 300


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _error_line(cell) -> str:
    """The error, the cell's line that raised it (an empty ``AssertionError`` says nothing
    without it) and what the cell printed last before it."""
    printed = [o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream"]
    last_printed = "".join(printed).strip().splitlines()[-3:]
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            frames = [ANSI.sub("", frame) for frame in output.get("traceback", [])]
            where = [
                line.strip() for frame in frames for line in frame.splitlines() if line.lstrip().startswith("---->")
            ]
            text = f"{output.get('ename')}: {output.get('evalue', '')}".strip()[:300]
            if where:
                text += f"  at: {where[-1][:300]}"
            if last_printed:
                text += "  | printed: " + " / ".join(line[:200] for line in last_printed)
            return text
    return ""


def run_notebook(path: pathlib.Path) -> dict:
    """Execute ``path`` cell by cell; after the first failure the rest are reported as SKIP."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    cells, failed = [], False
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if failed:
                cells.append({"cell": index, "status": "SKIP", "seconds": 0.0, "error": ""})
                continue
            started = time.monotonic()
            try:
                client.execute_cell(cell, index)
                status, error = "PASS", ""
            except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
                status, error, failed = "FAIL", _error_line(cell) or str(exc).splitlines()[-1][:300], True
            cells.append(
                {"cell": index, "status": status, "seconds": round(time.monotonic() - started, 2), "error": error}
            )
    return {"notebook": path.name, "cells": cells}


def report(result: dict) -> None:
    for cell in result["cells"]:
        line = f"{cell['status']} {result['notebook']} cell {cell['cell']:>2} {cell['seconds']:6.1f} s"
        print(f"{line}  {cell['error']}" if cell["error"] else line, flush=True)


def summary(results: list[dict]) -> tuple[str, bool]:
    lines, ok = [], True
    for result in results:
        counts = {s: sum(c["status"] == s for c in result["cells"]) for s in ("PASS", "FAIL", "SKIP")}
        seconds = sum(c["seconds"] for c in result["cells"])
        ok &= counts["FAIL"] == 0
        verdict = "ok" if counts["FAIL"] == 0 else "FAILED"
        lines.append(
            f"{result['notebook']:<45} {verdict:<6} {counts['PASS']:>3} pass {counts['FAIL']} fail "
            f"{counts['SKIP']:>2} skipped {seconds:6.1f} s"
        )
    return "\n".join(lines), ok


def chapters(only: list[str]) -> list[pathlib.Path]:
    paths = sorted((ROOT / "chapters" / "en").glob("*.ipynb"))
    if only:
        paths = [p for p in paths if any(p.name.startswith(prefix) for prefix in only)]
    if not paths:
        raise SystemExit(f"no English chapter matches {only}")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="chapter file-name prefixes, e.g. 06 09-memory")
    # One at a time by default: every kernel and rank sizes its threads to the whole machine, so
    # notebooks run side by side oversubscribe it, and a chapter's timing asserts (which expect an
    # otherwise idle machine) fail: seen on a 16-core H200 machine with 3 and 5 at once.
    parser.add_argument("--parallel", type=int, default=1, help="notebooks executed at once (default 1)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the per-cell results here")
    args = parser.parse_args(argv)
    subprocess.run([sys.executable, "-m", "distcourse", "doctor"], check=False)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = []
        for result in pool.map(run_notebook, chapters(args.only)):
            report(result)
            results.append(result)
    text, ok = summary(results)
    print(f"\n{text}\n{'all cells passed' if ok else 'SOME CELLS FAILED'} in {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
