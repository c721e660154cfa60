"""Chapter 12's scripts in the reader's language: sentences translated, tagged lines unchanged.

The capstone (and chapter 07's ``train.py``) run as programs under torchrun: they take the
language from ``DISTCOURSE_LANG`` (``i18n.script_language``), print their sentences through
``tr``, and print what code reads back on lines of their own, ``tag {json}``, which the
notebooks parse with ``Result.json``. These tests translate every sentence into a made-up
language and check that the parsers still read everything.
"""

from __future__ import annotations

import ast
import contextlib
import io
import pathlib

import pytest

from distcourse import capstone, train
from distcourse.common.subprocesses import Result
from distcourse.runtime import i18n

QUICK = ["--steps", "6", "--log-every", "2", "--eval-every", "3", "--eval-batches", "1", "--workers", "0"]
QUICK += ["--progress", "off", "--sample-bytes", "4", "--limit-windows", "40", "--precision", "fp32"]


def tr_texts(module) -> list[str]:
    """The literal strings a module passes to ``tr``."""
    path = pathlib.Path(module.__file__)  # a package: every file of it
    files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
    trees = [ast.parse(f.read_text(encoding="utf-8")) for f in files]
    return [
        node.args[0].value
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "tr"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ]


@pytest.fixture
def made_up_language(monkeypatch):
    """Every sentence of the two scripts "translated" to «...», as a catalog for "ru" would."""
    texts = tr_texts(capstone) + tr_texts(train)
    real = i18n.catalog
    monkeypatch.setattr(i18n, "catalog", lambda code: {t: f"«{t}»" for t in texts} if code == "ru" else real(code))
    i18n.use("ru")
    yield
    i18n.use("en")


def printed(main, argv) -> Result:
    """What ``main(argv)`` printed, read back as the notebooks read a torchrun agent's output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([str(a) for a in argv])
    return Result(["main"], 0, 0, out.getvalue(), "", 0.0)


def test_script_language_comes_from_the_environment_only(monkeypatch):
    monkeypatch.setenv("DISTCOURSE_LANG", "zh-TW")
    assert i18n.script_language() == "zh-TW"
    monkeypatch.setenv("DISTCOURSE_LANG", "xx")  # not a course language: English, not a crash
    assert i18n.script_language() == "en"
    monkeypatch.delenv("DISTCOURSE_LANG")
    monkeypatch.chdir(pathlib.Path(capstone.COURSE_CHAPTERS).parent / "ru")  # a notebook's folder is no hint
    assert i18n.script_language() == "en" and i18n.notebook_language() == "ru"


def test_capstone_tags_read_the_same_in_any_language(made_up_language, tmp_path):
    ckpt = ["--ckpt-dir", tmp_path / "ckpt", "--save-every", "3"]
    printed(capstone.main, [*QUICK, "--steps", "4", *ckpt])  # saves step 3
    resumed = printed(capstone.main, [*QUICK, *ckpt])
    lines = resumed.ranks[0]
    assert resumed.json(0, "resume") == {"step": 3, "checkpoint": "step-000003", "ignored": []}
    result = resumed.json(0, "result")
    assert (
        result["resumed from"] == 3 and result["steps per epoch"] == 5 and [s["step"] for s in result["saves"]] == [6]
    )
    sentences = [line for line in lines if not line.startswith(("resume {", "result {"))]
    assert sentences and all(line.startswith("«") and line.endswith("»") for line in sentences), sentences
    assert "«resumed from step-000003»" in lines


def test_capstone_sentences_do_not_begin_with_a_tag():
    """``Result.json(rank, tag)`` reads every line that starts with the tag and a space."""
    for text in tr_texts(capstone) + tr_texts(train):
        assert not text.startswith(("resume ", "kill ", "crash ", "result ", "worker ", "store ")), text


def test_train_script_tags_read_the_same_in_any_language(made_up_language, tmp_path):
    argv = ["--steps", 4, "--batch-size", 8, "--ckpt-dir", tmp_path, "--save-every", 2, "--progress", "off"]
    printed(train.main, [*argv[:1], 2, *argv[2:]])  # steps 0 and 1, a checkpoint after step 2
    resumed = printed(train.main, argv)
    assert resumed.json(0, "resume") == {"step": 2, "checkpoint": "step-0002.pt"}
    assert resumed.json(0, "result")["threads per process"] >= 1 and resumed.json(0, "result")["steps"] == 4
    assert "«resumed from step 2 (step-0002.pt)»" in resumed.ranks[0]


def test_english_sentences_are_the_ones_chapter_07_reads(tmp_path):
    """Chapter 07's notebooks and tests still match these English lines exactly."""
    argv = ["--steps", 4, "--batch-size", 8, "--ckpt-dir", tmp_path, "--save-every", 2, "--progress", "off"]
    printed(train.main, [*argv[:1], 2, *argv[2:]])
    lines = printed(train.main, argv).ranks[0]
    assert "resumed from step 2 (step-0002.pt)" in lines
    assert lines[0].startswith("attempt 0: world size 1 (one process on cpu), global batch 8, ")
    assert lines[0].endswith(" thread(s) per process")
