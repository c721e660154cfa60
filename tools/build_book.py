#!/usr/bin/env python3
"""Build the course book; the single entry point for `make book` and the tests.

    python tools/build_book.py                  # execute (cached) into _build/html
    python tools/build_book.py --no-execute     # render without running, into _build/noexec
    python tools/build_book.py --root DIR       # the same logic for another book

Why this wrapper exists: with `execute_notebooks: cache`, Jupyter Book 1.0.4 keys each
notebook's cached outputs on its code cells only, and Sphinx re-reads only notebooks whose
file changed. An edit to `code/distcourse/*.py` changes neither, so the pages would keep the
outputs of the old code. We therefore fingerprint everything outside the notebooks that can
change their outputs; when the fingerprint moves, the execution cache is dropped and every
page is re-read (and so every notebook re-executed). Otherwise the build stays incremental.
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
# The venv's own jupyter-book: its kernel then runs on this same interpreter
# (jupyter_client replaces the kernelspec's "python" with sys.executable).
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
# Files besides code/**/*.py whose changes can change what the notebooks print.
INPUT_FILES = ("requirements.txt", "pyproject.toml", "_config.yml")
FINGERPRINT_FILE = ".code-fingerprint"
TAIL_LINES = 60


def fingerprint(root: Path) -> str:
    """sha256 over the notebooks' inputs that are not in the notebooks."""
    files = sorted((root / "code").rglob("*.py")) + [root / name for name in INPUT_FILES]
    lines = []
    for path in files:
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        lines.append(f"{path.relative_to(root).as_posix()} {digest}")
    # Same code, other interpreter or core count: outputs can differ (e.g. worker counts
    # derived from the cores, version-dependent behaviour), so these count as inputs too.
    lines.append(f"python {sys.version}")
    lines.append(f"cpus {len(os.sched_getaffinity(0))}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def jupyter_book(root: Path, out: Path, config: Path, extra: list) -> int:
    """Run `jupyter-book build`; HTML lands in out/_build/html. Returns its exit code.

    The full log goes to out/_build/build.log; only its tail is shown, on failure.
    """
    log_path = out / "_build" / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(JUPYTER_BOOK), "build", str(root), "--path-output", str(out),
           "--config", str(config), "-W", "-n", "--keep-going", *extra]
    print(f"$ {' '.join(cmd)}\n  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        # With --keep-going the warnings that failed the build can sit far above the tail.
        problems = [line for line in lines[:-TAIL_LINES]
                    if any(k in line for k in ("WARNING", "ERROR", "CRITICAL"))]
        print(f"\nBuild FAILED (exit code {rc}). Full log: {log_path}", file=sys.stderr)
        if problems:
            print("--- warnings/errors before the tail ---", *problems, sep="\n", file=sys.stderr)
        print(f"--- last {TAIL_LINES} lines ---", *lines[-TAIL_LINES:], sep="\n", file=sys.stderr)
    return rc


def build_executed(root: Path) -> int:
    """Cached execution into root/_build/html, re-executing everything when code changed."""
    build = root / "_build"
    stamp = build / FINGERPRINT_FILE
    new = fingerprint(root)
    old = stamp.read_text().strip() if stamp.is_file() else None
    extra = []
    if new != old:
        print("Code/config changed since the last successful build (or first build):"
              " clearing the execution cache and re-executing every notebook.")
        # The stamp claims "the HTML matches these inputs". Remove it first: if this build
        # fails half-way and the code is then reverted, the next build must still be full.
        stamp.unlink(missing_ok=True)
        shutil.rmtree(build / ".jupyter_cache", ignore_errors=True)
        extra.append("--all")  # Sphinx would otherwise skip the unchanged notebooks
    rc = jupyter_book(root, root, root / "_config.yml", extra)
    if rc == 0 and new != old:
        stamp.write_text(new + "\n")
    return rc


def build_unexecuted(root: Path, out: Path) -> int:
    """Render with execution off into out/_build/html; never touches root/_build."""
    out.mkdir(parents=True, exist_ok=True)
    # Jupyter Book's CLI cannot override single settings, so build from a modified copy of
    # the config. Its only setting resolved relative to the config file's folder is
    # sphinx.local_extensions; make those paths absolute so the copy may live anywhere.
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf8")) or {}
    config.setdefault("execute", {})["execute_notebooks"] = "off"
    local_ext = (config.get("sphinx") or {}).get("local_extensions") or {}
    for name, path in local_ext.items():
        local_ext[name] = str((root / path).resolve())
    config_copy = out / "_config.noexec.yml"
    config_copy.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False),
                           encoding="utf8")
    return jupyter_book(root, out, config_copy, [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="book folder with _config.yml and _toc.yml (default: this repository)")
    parser.add_argument("--no-execute", action="store_true",
                        help="do not run notebooks; build into --output instead of _build/html")
    parser.add_argument("--output", type=Path, default=None,
                        help="with --no-execute: output folder (default: ROOT/_build/noexec); "
                             "HTML goes to OUTPUT/_build/html")
    args = parser.parse_args()
    root = args.root.resolve()
    if args.output and not args.no_execute:
        parser.error("--output only applies to --no-execute")

    start = time.perf_counter()
    if args.no_execute:
        out = (args.output or root / "_build" / "noexec").resolve()
        rc = build_unexecuted(root, out)
    else:
        out = root
        rc = build_executed(root)
    if rc == 0:
        print(f"Built in {time.perf_counter() - start:.1f} s")
        print(out / "_build" / "html" / "index.html")
    return rc


if __name__ == "__main__":
    sys.exit(main())
