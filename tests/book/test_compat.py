"""tools/compat.py without a network: pairing, the environment of a compat venv, results, the page."""

import os
import pathlib
import re

import pytest
import yaml

import compat

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- versions
def test_window_is_the_one_the_setup_cells_check():
    from distcourse.runtime import support

    assert compat.SUPPORTED == support.SUPPORTED_TORCH


def test_every_supported_minor_release_has_a_torchvision():
    lo, hi = (compat.version_key(v) for v in compat.SUPPORTED)
    paired = {compat.version_key(compat.minor(torch)) for torch in compat.TORCHVISION}
    assert {(2, minor) for minor in range(lo[1], hi[1] + 1)} <= paired


def test_pairs_follow_each_other_and_match_the_measured_ones():
    torches = sorted(compat.TORCHVISION, key=compat.version_key)
    visions = [compat.version_key(compat.TORCHVISION[t]) for t in torches]
    assert visions == sorted(visions)
    measured = {"2.11.0": "0.26.0", "2.13.0": "0.28.0", "2.14.1": "0.29.1", "2.15.0": "0.29.2"}
    assert {t: compat.torchvision_for(t) for t in measured} == measured


def test_the_pinned_torch_is_paired_with_the_pinned_torchvision():
    requirements = (ROOT / "requirements.txt").read_text()
    torch = compat.pinned_torch(requirements)
    assert f"torchvision=={compat.torchvision_for(torch)}" in requirements
    assert compat.in_window(torch)


def test_the_pinned_torchao_loads_on_every_torch_of_the_window():
    torchao = compat.pinned_torchao((ROOT / "requirements.txt").read_text())
    assert torchao is not None and all(compat.torchao_loads_on(torchao, f"{minor}.0") for minor in compat.SUPPORTED)
    assert not compat.torchao_loads_on("0.18.0", "2.10.0")


def test_an_unpaired_release_is_a_clear_error():
    with pytest.raises(SystemExit, match=r"(?s)no torchvision is paired with torch 2\.99\.0.*compat\.py pair"):
        compat.torchvision_for("2.99.0")
    assert compat.in_window("2.11.0") and compat.in_window("2.15.3")
    assert not compat.in_window("2.10.1") and not compat.in_window("2.16.0")


def test_requirements_lose_only_torch_and_torchvision():
    requirements = (ROOT / "requirements.txt").read_text()
    rest = compat.other_requirements(requirements)
    assert not re.search(r"^(torch|torchvision)\s*==", rest, flags=re.M)
    dropped = set(requirements.splitlines()) - set(rest.splitlines())
    assert {line.split("==")[0] for line in dropped} == {"torch", "torchvision"}
    assert compat.constraints("2.15.0", "0.29.2") == "torch==2.15.0\ntorchvision==0.29.2\n"


# ---------------------------------------------------------------- the environment
def test_compat_env_lifts_the_cap_for_its_venv_only():
    before = dict(os.environ)
    venv = compat.venv_path("2.15.0")
    env = compat.compat_env(venv, str(venv / "constraints.txt"))
    assert dict(os.environ) == before, "os.environ, and so .venv's own pip calls, must stay as they were"
    assert env["PIP_CONSTRAINT"] == str(venv / "constraints.txt")
    assert env["PIP_CACHE_DIR"].startswith(str(venv))
    assert env["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    assert venv.parent == ROOT / ".venv-compat" and ROOT / ".venv" not in venv.parents


def test_compat_env_does_not_change_the_environment_it_is_given():
    base = {"PATH": "/usr/bin", "PIP_CONSTRAINT": "/etc/xdg/pip/constraints.txt"}
    env = compat.compat_env(pathlib.Path("/tmp/v"), os.devnull, base=base)
    assert base == {"PATH": "/usr/bin", "PIP_CONSTRAINT": "/etc/xdg/pip/constraints.txt"}
    assert env["PIP_CONSTRAINT"] == os.devnull


def test_dot_venv_keeps_the_machine_constraint():
    """`.venv` is installed by the Makefile with the machine's pip settings, never lifted."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "PIP_CONSTRAINT" not in recipe and "compat" not in recipe
    assert ".venv-compat/" in (ROOT / ".gitignore").read_text().splitlines()


# ---------------------------------------------------------------- results
NBVAL_FAILURE = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="chapters.en.03-collectives.ipynb" name="Cell 0" time="1.5"/>
<testcase classname="chapters.en.03-collectives.ipynb" name="Cell 1" time="2.0">
<failure message="Notebook cell execution failed">#x1B[91mNotebook cell execution failed#x1B[0m
Cell 1: Cell execution caused an exception

Input:
assert "accelerator" in str(err)

Traceback:
#x1B[0;31mAssertionError#x1B[0m: Found no NVIDIA driver on your system</failure></testcase>
<testcase classname="chapters.en.03-collectives.ipynb" name="Cell 2" time="0.5">
<failure message="x">Cell 2: Cell execution caused an exception
NameError: name 'err' is not defined</failure></testcase>
</testsuite></testsuites>
"""


def test_first_failing_cell_and_its_error_line(tmp_path):
    report = tmp_path / "nb.xml"
    report.write_text(NBVAL_FAILURE)
    result = compat.notebook_result(compat.junit_cases(report), positions=[2, 5, 7])
    assert result == {
        "status": "failed",
        "cells": 3,
        "seconds": 4.0,
        "cell": 1,
        "notebook_cell": 5,
        "reason": "AssertionError: Found no NVIDIA driver on your system",
        "failed_cells": 2,
    }


def test_one_line_names_the_problem():
    assert compat.one_line("Traceback\n  File x\nValueError: bad\n") == "ValueError: bad"
    assert compat.one_line("Cell outputs differ\n- a\n+ b") == "Cell outputs differ"
    assert compat.one_line("something odd\nlast words") == "last words"
    assert len(compat.one_line("RuntimeError: " + "x" * 500)) == 240
    bare = "----> 8 assert first > 5 * steady  # tracing\n\nAssertionError: \n"
    assert compat.one_line(bare) == "AssertionError: assert first > 5 * steady # tracing"
    pytest_report = (
        ">       assert rc == 0\nE       AssertionError: so.2)\nE         what():  Tried to register twice\n"
    )
    assert compat.one_line(pytest_report) == "what(): Tried to register twice"
    assert (
        compat.one_line("E   pkg.launcher.LaunchTimeout: ranks [0, 1]\n") == "pkg.launcher.LaunchTimeout: ranks [0, 1]"
    )


def test_a_partial_run_keeps_the_other_notebooks_of_the_same_build():
    old = {"torch_build": "2.15.0+cu130", "torchvision": "0.29.2", "fast": {"passed": 1}}
    old["notebooks"] = {"01-a": {"status": "passed"}, "03-c": {"status": "failed"}}
    new = {"torch_build": "2.15.0+cu130", "torchvision": "0.29.2", "fast": None}
    new["notebooks"] = {"03-c": {"status": "passed"}}
    merged = compat.merge(old, new, partial=True)
    assert merged["notebooks"] == {"01-a": {"status": "passed"}, "03-c": {"status": "passed"}}
    assert merged["fast"] == {"passed": 1} and not compat.failed(merged)
    assert compat.merge(old, new, partial=False)["notebooks"] == new["notebooks"]
    assert compat.merge(old, {**new, "torchvision": "0.29.1"}, partial=True) == {**new, "torchvision": "0.29.1"}


# ---------------------------------------------------------------- the page
def record(torch, notebooks, fast=None):
    return {
        "torch": torch,
        "torch_build": torch + "+cu130",
        "cuda": "13.0",
        "torchvision": compat.TORCHVISION[torch],
        "python": "3.11.7",
        "gpu": None,
        "machine": {"cores": 2},
        "date": "2026-01-05T10:00:00Z",
        "fast": fast,
        "notebooks": notebooks,
    }


def test_page_shows_the_window_the_pin_and_every_result():
    passed = {"status": "passed", "date": "2026-01-05"}
    failed = {"status": "failed", "cell": 35, "reason": "AssertionError: `x` differs", "date": "2026-01-06"}
    failures = [{"test": "tests/a.py::t", "reason": "E: no"}, {"test": "tests/b.py::p[x]", "reason": "E: x"}]
    failures.append({"test": "tests/b.py::p[y]", "reason": "E: y"})
    fast = {"passed": 300, "failed": 3, "error": 0, "failures": failures}
    records = [record("2.11.0", {"01-a": passed}), record("2.15.0", {"01-a": passed, "03-c": failed}, fast)]
    page = compat.render_page(records, ["01-a", "03-c"], pinned="2.13.0")
    assert "torch 2.11 through 2.15" in page and "torch 2.13.0" in page
    assert "| chapter | torch 2.11.0 | torch 2.15.0 |" in page
    assert "| [01-a](chapters/en/01-a.ipynb) | ✅ 2026-01-05 | ✅ 2026-01-05 |" in page
    assert "| [03-c](chapters/en/03-c.ipynb) | – | ❌ cell 35 (2026-01-06) |" in page
    assert "- torch 2.15.0, 03-c, code cell 35: `AssertionError: 'x' differs`" in page
    assert "300 passed, 3 failed" in page and "`tests/a.py::t`: `E: no`" in page
    assert "`tests/b.py::p` (2 cases): `E: x`" in page
    assert "| 2.15.0+cu130 (CUDA 13.0) | 0.29.2 | 3.11.7 | 2 cores, no GPU |" in page


def test_every_language_book_reads_the_page_in_its_language():
    failed = {"status": "failed", "cell": 7, "reason": "E", "date": "2026-01-06"}
    records = [record("2.15.0", {"01-a": failed}, {"passed": 9, "failed": 1, "error": 0, "failures": []})]
    page = compat.render_page(records, ["01-a"], pinned="2.13.0")
    blocks = re.findall(r"```\{only\} book_(\w+)\n(.*?)\n```", page, re.S)
    assert [tag for tag, _ in blocks] == ["en", "ru", "zh_CN", "zh_TW", "pt_BR", "ko"]
    text = dict(blocks)
    assert "| глава | torch 2.15.0 |" in text["ru"] and "пройдено 9, не пройдено 1" in text["ru"]
    assert "[01-a](chapters/ko/01-a.ipynb) | ❌ 셀 7 (2026-01-06)" in text["ko"]
    assert "코드 셀 7" in text["ko"] and "2 cores" not in text["ko"]
    assert "通過 9，失敗 1" in text["zh_TW"] and "通过 9，失败 1" in text["zh_CN"]
    assert "9 aprovados, 1 com falha" in text["pt_BR"]


def test_page_without_records_says_so():
    page = compat.render_page([], ["01-a"], pinned="2.13.0")
    assert "No release has been recorded yet" in page and "| chapter |" not in page


def test_committed_page_is_rendered_from_the_committed_records():
    chapters = [p.stem for p in sorted(compat.NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))]
    pinned = compat.pinned_torch((ROOT / "requirements.txt").read_text())
    expected = compat.render_page(compat.load_records(), chapters, pinned)
    assert (ROOT / "tested-with.md").read_text(encoding="utf-8") == expected, "run `python tools/compat.py page`"


def test_page_is_one_shared_page_of_every_language_book():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    shared = [part for part in toc["parts"] if not all(c["file"].startswith("chapters/") for c in part["chapters"])]
    assert len(shared) == 1 and {"file": "tested-with"} in shared[0]["chapters"]


# ---------------------------------------------------------------- the weekly workflow
def test_weekly_workflow_runs_the_ends_of_the_window_and_commits_the_records():
    workflow = yaml.safe_load((ROOT / ".github/workflows/compat.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert triggers["schedule"][0]["cron"]
    in_window = sorted((t for t in compat.TORCHVISION if compat.in_window(t)), key=compat.version_key)
    assert workflow["jobs"]["run"]["strategy"]["matrix"]["torch"] == [in_window[0], in_window[-1]]
    runs = [step.get("run", "") for step in workflow["jobs"]["run"]["steps"]]
    assert "make compat TORCH=${{ matrix.torch }}" in runs
    record_steps = "\n".join(step.get("run", "") for step in workflow["jobs"]["record"]["steps"])
    assert "tools/compat.py page" in record_steps and "git push" in record_steps
    assert "make compat" not in (ROOT / ".ci/run").read_text()
