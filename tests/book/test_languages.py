"""One registry of languages (runtime/languages.py): the book, the folders and the tools agree with it."""

import pathlib
import re

import pytest
import yaml

import headers
import translations
from distcourse.runtime import i18n, languages

ROOT = pathlib.Path(__file__).resolve().parents[2]


def language_parts() -> list[dict]:
    """The parts of _toc.yml that hold chapters of one language folder."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    return [part for part in toc["parts"] if all(c["file"].startswith("chapters/") for c in part["chapters"])]


def test_toc_has_one_part_per_language_in_registry_order_captioned_by_its_name():
    parts = language_parts()
    assert [part["caption"] for part in parts] == [lang.name for lang in languages.LANGUAGES]
    for part, lang in zip(parts, languages.LANGUAGES):
        folders = {c["file"].split("/")[1] for c in part["chapters"]}
        assert folders == {lang.code}, f"part {part['caption']!r} lists chapters of {folders}"


def test_chapter_folders_and_catalogs_are_the_registry_languages():
    assert sorted(p.name for p in (ROOT / "chapters").iterdir() if p.is_dir()) == sorted(languages.CODES)
    catalogs = sorted(p.stem for p in (ROOT / "code/distcourse/locale").glob("*.yml"))
    assert catalogs == sorted(lang.code for lang in languages.TRANSLATED)


def test_book_config_language_is_the_first_registry_entry():
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    assert config["sphinx"]["config"]["language"] == languages.LANGUAGES[0].sphinx == languages.ENGLISH.sphinx


@pytest.mark.parametrize("lang", languages.LANGUAGES, ids=languages.CODES)
def test_entry_is_well_formed(lang):
    assert re.fullmatch(r"[a-z]{2}(-[A-Z]{2})?", lang.html), "a BCP 47 tag: language, optional region"
    assert lang.sphinx == lang.html.replace("-", "_")  # Sphinx spells the same locale with an underscore
    assert bool(lang.fonts) == (lang.code in ("zh-CN", "zh-TW", "ko"))  # CJK text needs a CJK font
    if lang is not languages.ENGLISH:
        assert "{english}" in lang.translation_note and "{status}" in lang.translation_note
        assert all("{title}" in text for text in lang.notice[1:]) and "{was}" in lang.notice[2]


def test_tools_and_runtime_read_the_registry():
    assert list(headers.LANGUAGES) == list(i18n.LANGUAGES) == list(languages.CODES)
    assert list(headers.LANGUAGES.values()) == [lang.name for lang in languages.LANGUAGES]
    assert translations.TRANSLATED == [lang.code for lang in languages.TRANSLATED]
    assert i18n.CJK_FONTS == {lang.code: list(lang.fonts) for lang in languages.LANGUAGES if lang.fonts}


def test_unknown_language_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown language 'xx'.*zh-TW"):
        languages.get("xx")
    assert languages.get("pt-BR").name == "Português (Brasil)"
