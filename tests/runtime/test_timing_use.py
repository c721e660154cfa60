"""Every clock reading around work goes through ``distcourse.common.timing``.

On a GPU, kernels and NCCL collectives return before they have run: a bare
``time.perf_counter()`` then measures how fast work was queued, and the wait lands in
whichever later phase happens to synchronise. ``common.timing.clock(device)`` waits for
the device first (on a CPU it only reads the clock), so code that uses it is right on
both. This test reads the package's source and fails on any raw clock call outside the
places listed below, each with the reason it needs no device wait.
"""

from __future__ import annotations

import ast
import pathlib

import distcourse

PACKAGE = pathlib.Path(distcourse.__file__).parent
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns", "process_time"}

# (file relative to the package, enclosing function or "*" for the whole file) -> why a raw
# clock is right there: deadlines, timestamps and the durations of other processes.
ALLOWED = {
    ("common/timing.py", "clock"): "the one place that reads the clock, after waiting for the device",
    ("runtime/launcher.py", "*"): "the launcher's deadlines and blame timestamps; it runs no kernels itself",
    ("runtime/rank.py", "*"): "timestamps for blame, sent with a rank's failure (the earliest is the cause)",
    ("runtime/output.py", "*"): "how often the live view of the ranks' output is redrawn",
    ("runtime/processes.py", "*"): "grace periods before processes are killed",
    ("common/subprocesses.py", "run_together"): "deadline and duration of torchrun agents, measured from outside",
    ("common/subprocesses.py", "_wait_all"): "deadline of torchrun agents",
    ("libraries.py", "run_script"): "wall time of a child process, measured from the parent, which runs no kernels",
    ("libraries.py", "seconds_since_start"): "a process's age from its start timestamp (psutil), not a timed region",
    (
        "distributed_checkpoints.py",
        "dcp_async_save_while_training.<lambda>",
    ): "when DCP's writer thread finished the files",
}


def clock_calls(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of every raw clock call in one source file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    imported = {  # from time import perf_counter [as now]
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "time"
        for alias in node.names
        if alias.name in CLOCKS
    }
    found = []

    def visit(node, scope: list[str]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        elif isinstance(node, ast.Lambda):
            scope = [*scope, "<lambda>"]
        if isinstance(node, ast.Call):
            f = node.func
            raw = (isinstance(f, ast.Attribute) and f.attr in CLOCKS and getattr(f.value, "id", None) == "time") or (
                isinstance(f, ast.Name) and f.id in imported
            )
            if raw:
                found.append((".".join(scope) or "<module>", node.lineno, ast.unparse(f)))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def test_the_scan_finds_raw_clocks(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import time\nfrom time import perf_counter as now\n"
        "def step():\n    t = time.perf_counter()\n    return now() - t\n"
        "class A:\n    def f(self):\n        return lambda: time.monotonic()\n"
    )
    assert [(scope, call) for scope, _, call in clock_calls(sample)] == [
        ("step", "time.perf_counter"),
        ("step", "now"),
        ("A.f.<lambda>", "time.monotonic"),
    ]


def test_timed_regions_go_through_common_timing():
    unexplained, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for scope, line, call in clock_calls(path):
            key = next((k for k in ((relative, scope), (relative, "*")) if k in ALLOWED), None)
            if key is not None:
                used.add(key)
            else:
                unexplained.append(f"{relative}:{line} in {scope}: {call}()")
    assert not unexplained, (
        "raw clock calls; time work with distcourse.common.timing (clock(device), Stopwatch, best_of), "
        "or add the place to ALLOWED with the reason it needs no device wait:\n  " + "\n  ".join(unexplained)
    )
    assert not set(ALLOWED) - used, f"allowed places that no longer read a clock: {sorted(set(ALLOWED) - used)}"
