"""Shared fixtures, and a per-notebook execution-time report for nbval runs."""

import csv
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pathlib
import statistics
import sys
import time
from collections import defaultdict

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parent
# tools/book_cache.py: each notebook nbval executes, once all its cells pass, goes into the book's
# execution cache, so that `make book` after `make test` publishes these outputs and executes nothing again.
pytest_plugins = ["book_cache"]


def launcher_helpers() -> set[int]:
    """Long-lived helpers the launcher may keep: the fork server and the resource tracker."""
    pids = {
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid}


def stray_processes() -> list[psutil.Process]:
    helpers = launcher_helpers()
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in helpers]


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves any process behind (checked by listing the process tree)."""
    before = {p.pid for p in stray_processes()}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in stray_processes() if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {[(p.pid, p.name(), p.status()) for p in left]}"


# --- notebook execution times -------------------------------------------------------
# nbval reports one test item per cell; summing them per notebook gives the chapter's
# execution time. Budget (2 CPU cores): median <= 15 s, max <= 30 s per chapter.
BUDGET_MEDIAN_S, BUDGET_MAX_S = 15.0, 30.0
_notebook_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _notebook_seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    stress = sys.modules.get("test_stress")
    if stress is not None and stress.RESULTS:
        terminalreporter.section("stress scenarios (passed/attempts)")
        for line in stress.pytest_terminal_summary_table():
            terminalreporter.write_line(line)
    if not _notebook_seconds:
        return
    rows = sorted(_notebook_seconds.items())
    tr = terminalreporter
    tr.section("notebook execution times")
    for path, seconds in rows:
        flag = "  OVER BUDGET" if seconds > BUDGET_MAX_S else ""
        tr.write_line(f"{seconds:7.1f} s  {path}{flag}")
    values = [s for _, s in rows]
    median, longest = statistics.median(values), max(values)
    met = median <= BUDGET_MEDIAN_S and longest <= BUDGET_MAX_S
    tr.write_line(
        f"{len(values)} notebooks: median {median:.1f} s (budget {BUDGET_MEDIAN_S:g} s), "
        f"max {longest:.1f} s (budget {BUDGET_MAX_S:g} s), total {sum(values):.1f} s, "
        f"{os.cpu_count()} cores: budget {'met' if met else 'NOT MET'}"
    )
    out = ROOT / "_build" / "notebook-times.csv"
    out.parent.mkdir(exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "seconds"])
        writer.writerows((path, f"{seconds:.2f}") for path, seconds in rows)
    tr.write_line(f"written to {out}")


# --- English in the outputs of translated chapters  ---------------------------------------
# nbval executes every chapter in every language (`make test`), so each translated cell's outputs are
# checked here as they arrive: no notebook runs twice. The committed notebooks carry no outputs and CI
# builds the book after the tests, so this is where CI sees what a reader of a translation sees.
# Which lines count as the course's English: tools/lint_language.py (rule outputs, check_nbval_item).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    if item.nodeid.split("::")[0].endswith(".ipynb"):
        import lint_language  # tools/ is on pytest's pythonpath (pyproject.toml)

        problem = lint_language.check_nbval_item(item)
        if problem:
            pytest.fail(problem, pytrace=False)
    return result
