"""The tests' execution feeds the book: a notebook nbval executed is not executed again by `make book`.

`make test` executes every notebook under nbval (one kernel per notebook, one test item per
code cell), and `make book` builds the pages from myst-nb's execution cache. This pytest
plugin joins the two. It reads the kernel's messages as nbval receives them and keeps each
cell's outputs the way nbclient, the book's executor, would have written them (nbval's own
record merges streams and ignores display updates: the launcher's live view of the ranks'
output becomes their grouped output through an update). When every code cell of a notebook
has passed (its asserts, and conftest.py's check of its outputs), the notebook with these
outputs goes into the book's cache (tools/build_book.py, record_execution), with the
fingerprint of the inputs it ran with. The book then publishes the very outputs whose
asserts passed, and executes only what the tests did not.

Not stored: a notebook with a failed, skipped or deselected cell (its outputs are not a
whole passing run), one outside any book's table of contents, and one whose inputs (the
modules it imports, the config) changed while it ran. conftest.py registers the plugin;
another book's tests load it with `-p book_cache`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
from nbval.plugin import IPyNbCell

import build_book


@dataclass
class Run:
    """One notebook's execution under nbval, as its cells report."""

    root: Path  # the book that lists the notebook
    inputs: str  # its fingerprint when the first cell started
    cells: int  # code cells in the notebook
    outputs: dict = field(default_factory=dict)  # cell number: its outputs, as nbclient keeps them
    passed: set = field(default_factory=set)  # cell numbers whose call passed
    cell: int = -1  # the cell running now
    request: str | None = None  # its execute request's message id
    displays: dict = field(default_factory=dict)  # display id: the outputs showing it
    clear_before_next: bool = False  # clear_output(wait=True) is pending
    seconds: float = 0.0  # every phase of every cell, kernel start included
    complete: bool = True  # no cell failed, was skipped or xfailed
    language_info: dict | None = None  # from the kernel, as nbclient records it


_RUNS: dict[str, Run] = {}  # by the notebook's node id
STORED: list[str] = []  # notebooks stored in this session, for the summary


def _notebook_of(item) -> pytest.File | None:
    return item.parent if isinstance(item, IPyNbCell) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    notebook = _notebook_of(item)
    if notebook is not None and item.cell_num == 0:
        _start(notebook)
    run = _RUNS.get(notebook.nodeid) if notebook is not None else None
    if run is not None:
        run.cell, run.request, run.clear_before_next = item.cell_num, None, False
        run.outputs[item.cell_num] = []
    result = yield
    if notebook is not None and (nextitem is None or nextitem.parent is not notebook):
        _finish(notebook)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    notebook = _notebook_of(item)
    run = _RUNS.get(notebook.nodeid) if notebook is not None else None
    if run is None:
        return report
    run.seconds += report.duration
    if report.failed or report.skipped or hasattr(report, "wasxfail"):
        run.complete = False
    elif report.when == "setup" and item.cell_num == 0:
        run.language_info = _language_info(notebook)
    elif report.when == "call":
        run.passed.add(item.cell_num)
    return report


def pytest_terminal_summary(terminalreporter):
    if STORED:
        terminalreporter.write_line(f"book cache: {len(STORED)} notebooks stored for the book (tools/book_cache.py)")


def _start(notebook) -> None:
    path = Path(str(notebook.path))
    root = build_book.book_root_of(path)
    if root is None:
        return
    inputs = build_book.fingerprints(root, [path.resolve()])
    cells = sum(cell.cell_type == "code" for cell in notebook.nb.cells)
    run = _RUNS[notebook.nodeid] = Run(root, next(iter(inputs.values())), cells)
    receive = notebook.get_kernel_message  # nbval reads every iopub message of a cell through it

    def get_kernel_message(*args, **kwargs):
        message = receive(*args, **kwargs)
        _record(run, message)
        return message

    notebook.get_kernel_message = get_kernel_message


def _finish(notebook) -> None:
    run = _RUNS.pop(notebook.nodeid, None)
    if run is None or not run.complete or run.passed != set(range(run.cells)):
        return
    path = Path(str(notebook.path)).resolve()
    try:
        if build_book.fingerprints(run.root, [path]) != {path.relative_to(run.root).as_posix(): run.inputs}:
            return  # an input changed during the run: these outputs belong to neither version
        build_book.record_execution(run.root, path, executed_notebook(notebook.nb, run), run.seconds, run.inputs)
    except Exception as exc:  # the tests passed; a cache that cannot be written only costs time
        warnings.warn(f"book cache: {path.name} not stored: {exc!r}", stacklevel=1)
        return
    STORED.append(notebook.nodeid)


def executed_notebook(source: nbformat.NotebookNode, run: Run) -> nbformat.NotebookNode:
    """The notebook nbval read, with the outputs and execution counts of its run."""
    executed = copy.deepcopy(source)
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code):
        cell.outputs = copy.deepcopy(run.outputs[number])
        cell.execution_count = number + 1  # one kernel per notebook, every cell run once, in order
    if run.language_info:
        executed.metadata["language_info"] = run.language_info
    return executed


def _record(run: Run, message: dict) -> None:
    """One iopub message of the running cell into its outputs, as nbclient's process_message does."""
    kind, content = message["msg_type"], message["content"]
    parent = message.get("parent_header", {}).get("msg_id")
    if kind == "execute_input" and run.request is None:
        run.request = parent
    if parent is None or parent != run.request:
        return  # another request's message (nbval skips it too)
    display_id = (content.get("transient") or {}).get("display_id")
    if display_id and kind in ("execute_result", "display_data", "update_display_data"):
        _update_display(run, display_id, message)
    outputs = run.outputs[run.cell]
    if kind == "clear_output":
        if content.get("wait"):
            run.clear_before_next = True
        else:
            outputs.clear()
        return
    if kind in ("status", "execute_input", "update_display_data", "execute_reply") or kind.startswith("comm"):
        return
    try:
        out = nbformat.v4.output_from_msg(copy.deepcopy(message))
    except ValueError:  # not an output
        return
    if run.clear_before_next:
        outputs.clear()
        run.clear_before_next = False
    if display_id:
        run.displays.setdefault(display_id, []).append(out)
    outputs.append(out)


def _update_display(run: Run, display_id: str, message: dict) -> None:
    """Every output showing ``display_id``, in any cell, takes the message's data (nbclient's rule)."""
    if display_id not in run.displays:
        return
    message = copy.deepcopy(message)
    message["header"]["msg_type"] = message["msg_type"] = "display_data"
    out = nbformat.v4.output_from_msg(message)
    for shown in run.displays[display_id]:
        shown["data"], shown["metadata"] = out["data"], out["metadata"]


def _language_info(notebook) -> dict | None:
    """The kernel's language_info, which nbclient writes into an executed notebook's metadata
    (myst-nb picks the code's highlighting from it)."""
    try:
        reply = notebook.kernel.kc.kernel_info(reply=True, timeout=30)
    except Exception:  # no reply: the notebook's own metadata stays
        return None
    return reply["content"].get("language_info")
