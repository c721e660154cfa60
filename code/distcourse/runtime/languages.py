"""The languages of the course, in one place.

Everything that differs by language and is not a translation of a chapter lives here:
the folder name, how the language names itself, the locale codes that Sphinx and HTML
want, the fonts its figures need, and the few sentences the tools write around a
chapter. The figure-text catalogs (``locale/<code>.yml``) and the chapters themselves
are the translations proper. Adding a language: an entry here, a catalog, a
``chapters/<code>/`` folder, and a part in ``_toc.yml`` (a test checks that they agree).

This module imports nothing heavy: the book's tools read it without starting torch.
"""

from __future__ import annotations

from typing import NamedTuple


class Language(NamedTuple):
    code: str  # folder under chapters/, name of the catalog locale/<code>.yml
    name: str  # the language's name for itself: language links, the _toc.yml part caption
    sphinx: str  # Sphinx and theme locale (underscore form)
    html: str  # BCP 47 tag for <html lang="...">
    fonts: tuple[str, ...]  # families that draw its figure text besides DejaVu Sans, preferred first
    other_languages: str  # label before the links to the other languages in a chapter's header
    translation_note: str  # header line of a translated chapter; {english}: link, {status}: status page
    notice: tuple[str, str, str]  # translation notice on the book page: title, current, behind
    companion_code: str = "Companion code"  # label before the modules a chapter uses, in its header


ENGLISH = Language("en", "English", "en", "en", (), "Other languages", "", ("", "", ""), "Companion code")

LANGUAGES: tuple[Language, ...] = (
    ENGLISH,
    Language(
        "ru",
        "Русский",
        "ru",
        "ru",
        (),
        "Другие языки",
        "*Это перевод [английской версии главы]({english}). Актуален ли перевод, показывает "
        "[страница статуса переводов]({status}).*",
        (
            "Перевод",
            "Это перевод английской главы «{title}». Перевод актуален: английский текст с тех пор не менялся.",
            "Это перевод английской главы «{title}». Английский текст изменился после перевода "
            "(версия {was}, сейчас {now}); отличия смотрите в оригинале.",
        ),
        "Код главы",
    ),
    Language(
        "zh-CN",
        "简体中文",
        "zh_CN",
        "zh-CN",
        ("Noto Sans CJK SC", "Source Han Sans SC", "Microsoft YaHei", "PingFang SC", "WenQuanYi Zen Hei", "SimHei"),
        "其他语言",
        "*本章译自[英文原版]({english})。译文是否与英文同步，请见[翻译状态页]({status})。*",
        (
            "译文",
            "本页译自英文章节《{title}》。译文与英文同步：英文自翻译以来没有改动。",
            "本页译自英文章节《{title}》。英文在翻译之后有改动（译自版本 {was}，当前版本 {now}），请对照英文原文。",
        ),
        "配套代码",
    ),
    Language(
        "zh-TW",
        "繁體中文",
        "zh_TW",
        "zh-TW",
        ("Noto Sans CJK TC", "Source Han Sans TC", "Microsoft JhengHei", "PingFang TC", "WenQuanYi Zen Hei"),
        "其他語言",
        "*本章譯自[英文原版]({english})。譯文是否與英文同步，請見[翻譯狀態頁]({status})。*",
        (
            "譯文",
            "本頁譯自英文章節《{title}》。譯文與英文同步：英文自翻譯以來沒有變動。",
            "本頁譯自英文章節《{title}》。英文在翻譯之後有變動（譯自版本 {was}，目前版本 {now}），請對照英文原文。",
        ),
        "隨附程式碼",
    ),
    Language(
        "pt-BR",
        "Português (Brasil)",
        "pt_BR",
        "pt-BR",
        (),
        "Outros idiomas",
        "*Este capítulo é uma tradução do [original em inglês]({english}). Veja na "
        "[página de status das traduções]({status}) se ela está em dia.*",
        (
            "Tradução",
            "Esta página é uma tradução do capítulo em inglês “{title}”. A tradução está em dia: "
            "o texto em inglês não mudou desde então.",
            "Esta página é uma tradução do capítulo em inglês “{title}”. O texto em inglês mudou depois "
            "da tradução (versão {was}, agora {now}); confira o original.",
        ),
        "Código do capítulo",
    ),
    Language(
        "ko",
        "한국어",
        "ko",
        "ko",
        ("Noto Sans CJK KR", "Source Han Sans KR", "Malgun Gothic", "Apple SD Gothic Neo", "NanumGothic"),
        "다른 언어",
        "*이 장은 [영어 원문]({english})을 번역한 것입니다. 번역이 최신인지는 [번역 현황 페이지]({status})에서 "
        "확인할 수 있습니다.*",
        (
            "번역",
            "이 페이지는 영어 장 “{title}”을 번역한 것입니다. 번역은 최신 상태입니다. "
            "번역 이후 영어 원문이 바뀌지 않았습니다.",
            "이 페이지는 영어 장 “{title}”을 번역한 것입니다. 번역 이후 영어 원문이 바뀌었습니다"
            "(번역 기준 {was}, 현재 {now}). 원문을 함께 확인하세요.",
        ),
        "이 장의 코드",
    ),
)

CODES: tuple[str, ...] = tuple(lang.code for lang in LANGUAGES)
TRANSLATED: tuple[Language, ...] = tuple(lang for lang in LANGUAGES if lang.code != ENGLISH.code)
BY_CODE: dict[str, Language] = {lang.code: lang for lang in LANGUAGES}


def get(code: str) -> Language:
    """The language whose folder is ``code``; a ValueError names the ones there are."""
    try:
        return BY_CODE[code]
    except KeyError:
        raise ValueError(f"unknown language {code!r}; the course has {', '.join(CODES)}") from None
