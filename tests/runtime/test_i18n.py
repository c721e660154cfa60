"""The package speaks the notebook's language: numbers, verdicts, rank output, axis labels."""

import builtins
import sys

import matplotlib
import pytest

from distcourse.runtime import i18n

matplotlib.use("Agg")


@pytest.fixture
def language():
    """Switch the package's language (no fonts needed) and back to English afterwards."""
    yield i18n.use
    i18n.use("en")


@pytest.mark.parametrize(
    "lang, expected",
    [("en", "1,234.5"), ("pt-BR", "1.234,5"), ("zh-CN", "1,234.5"), ("zh-TW", "1,234.5"), ("ko", "1,234.5")],
)
def test_number_follows_the_language(language, lang, expected):
    language(lang)
    assert i18n.number(1234.5) == expected


def test_russian_groups_thousands_with_a_no_break_space_and_writes_a_decimal_comma(language):
    language("ru")
    text = i18n.number(1234.5)
    assert text in ("1\u202f234,5", "1\u00a0234,5")  # whichever CLDR's data for ru gives
    space = text[1]
    assert i18n.number(1234567) == f"1{space}234{space}567"
    assert i18n.number(0.5, 2) == "0,50"


def test_number_digits_grouping_and_scientific(language):
    language("en")
    assert i18n.number(1234) == "1,234"
    assert i18n.number(2.0) == "2"  # at most 3 decimals, no trailing zeros
    assert i18n.number(3.14159) == "3.142"
    assert i18n.number(3.14159, 2) == "3.14"
    assert i18n.number(1234.5, 0) == "1,234"  # half to even, as Python rounds
    assert i18n.number(2024, grouping=False) == "2024"
    assert i18n.number(1.5e-7, 1, scientific=True) == "1.5E-07"
    language("pt-BR")
    assert i18n.number(1234.5, 2) == "1.234,50"
    assert i18n.number(1.5e-7, 1, scientific=True) == "1,5E-07"


def test_number_falls_back_to_python_formatting_without_babel(language, monkeypatch):
    """Colab installs the package with --no-deps: no Babel, English-style numbers, no failure."""
    real_import = builtins.__import__

    def no_babel(name, *args, **kwargs):
        if name == "babel" or name.startswith("babel."):
            raise ImportError("No module named 'babel'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "babel", raising=False)
    monkeypatch.delitem(sys.modules, "babel.numbers", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_babel)
    language("ru")
    assert i18n.number(1234.5) == "1,234.5"
    assert i18n.number(1234567) == "1,234,567"
    assert i18n.number(2.0) == "2"
    assert i18n.number(3.14159, 2) == "3.14"
    assert i18n.number(2024, grouping=False) == "2024"
    assert i18n.number(1.5e-7, 1, scientific=True) == "1.5e-07"


def test_tr_can_ask_for_another_language_without_switching(language):
    language("en")
    russian = i18n.catalog("ru")["Not yet:"]
    assert i18n.tr("Not yet:", language="ru") == russian
    assert i18n.tr("Not yet:") == "Not yet:" and i18n.language() == "en"


def test_verdicts_follow_the_language(language, capsys):
    from distcourse.exercises import ch07

    language("pt-BR")
    assert not ch07.check_torchrun_command("")
    out = capsys.readouterr().out
    catalog = i18n.catalog("pt-BR")
    assert catalog["Not yet:"] in out
    assert catalog["my_command is empty: write the torchrun command line there"] in out
    assert "Not yet" not in out


def test_verdict_numbers_follow_the_language(language, capsys):
    from distcourse.exercises import ch08

    language("ru")
    assert not ch08.check_max_params(lambda gpu_bytes, world_size, stage: int(gpu_bytes // 16) + 1000)
    out = capsys.readouterr().out
    assert "5\u00a0000\u00a0001\u00a0000" in out or "5\u202f000\u202f001\u202f000" in out  # 80e9 / 16 + 1000
    assert "5,000,001,000" not in out


@pytest.mark.parametrize("lang", ["en", "ru", "pt-BR"])
def test_plot_schedule_labels_follow_the_language(language, lang):
    import matplotlib.pyplot as plt

    from distcourse import model_parallel

    language(lang)
    events = model_parallel.simulate([model_parallel.gpipe_order(s, 2, 2) for s in range(2)])
    fig, ax = plt.subplots()
    try:
        model_parallel.plot_schedule(ax, events, "title")
        catalog = i18n.catalog(lang)
        assert ax.get_xlabel() == catalog.get("time since the step started (ms)", "time since the step started (ms)")
        stage = catalog.get("stage {s}", "stage {s}")
        assert [t.get_text() for t in ax.get_yticklabels()] == [stage.format(s=0), stage.format(s=1)]
        if lang != "en":
            assert ax.get_xlabel() != "time since the step started (ms)"
        model_parallel.plot_schedule(ax, events, "title", xlabel="given")  # an explicit label wins
        assert ax.get_xlabel() == "given"
    finally:
        plt.close(fig)


def test_ranks_speak_the_notebook_language(language):
    """The launcher hands the language to its ranks: what they print through tr() is translated too."""
    import distcourse

    language("ko")
    assert distcourse.launch(i18n.language, world_size=2, init_process_group=False, quiet=True) == ["ko", "ko"]
    language("en")
    assert distcourse.launch(i18n.language, world_size=1, init_process_group=False, quiet=True) == ["en"]


def test_a_ranks_printed_line_comes_out_in_russian(language):
    """What a rank prints through tr() and number() is in the notebook's language: the launcher
    passes the language to the ranks, and each rank loads that catalog."""
    import distcourse
    import rank_workers

    language("ru")
    results = distcourse.launch(
        rank_workers.says_in_the_notebooks_language, world_size=2, init_process_group=False, quiet=True
    )
    russian = i18n.catalog("ru")["Not yet:"]
    assert list(results) == ["ru", "ru"]
    for rank in range(2):
        assert results.outputs[rank].strip() == f"{russian} {i18n.number(1234.5)}"  # "Пока нет: 1 234,5"
        assert "Not yet" not in results.outputs[rank] and "1,234.5" not in results.outputs[rank]


def test_the_launchers_plan_line_follows_the_language(monkeypatch, language, capsys):
    """The "launch:" line keeps its tag and says the plan in the reader's language."""
    import distcourse
    import rank_workers
    from distcourse.runtime.hardware import Hardware, plan

    fake = {
        "{n} ranks": "{n} ранга",
        "{n} intra-op threads per rank": "{n} потока на ранг",
        "1 intra-op thread per rank": "1 поток на ранг",
        "{ranks}, backend {backend} on CPU, {threads} ({cores} cores, {gpus} GPUs)": (
            "{ranks}, бэкенд {backend} на CPU, {threads} (ядер: {cores}, GPU: {gpus})"
        ),
    }
    monkeypatch.setattr(i18n, "catalog", lambda code: fake if code == "ru" else {})
    language("ru")
    assert (
        plan(2, hardware=Hardware(cores=4)).describe()
        == "2 ранга, бэкенд gloo на CPU, 2 потока на ранг (ядер: 4, GPU: 0)"
    )
    distcourse.launch(rank_workers.says_in_the_notebooks_language, world_size=2, init_process_group=False, threads=1)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("launch: 2 ранга, бэкенд gloo на CPU, 1 поток на ранг (ядер: ")


def test_launched_programs_get_the_language(language):
    """Scripts started by the chapters (torchrun, the libraries' launchers) read DISTCOURSE_LANG."""
    from distcourse import libraries
    from distcourse.common import subprocesses

    language("pt-BR")
    assert subprocesses.child_env()["DISTCOURSE_LANG"] == "pt-BR"
    assert subprocesses.child_env(DISTCOURSE_LANG="ko")["DISTCOURSE_LANG"] == "ko"  # an explicit choice wins
    assert libraries.launch_environment("lightning")["DISTCOURSE_LANG"] == "pt-BR"
    language("en")
    assert subprocesses.child_env()["DISTCOURSE_LANG"] == "en"


def test_without_a_cjk_font_only_figures_go_back_to_english(monkeypatch, capsys):
    """No CJK font: the notebook still prints Chinese; figures draw the English text, formatted."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(i18n, "cjk_font", lambda code, install: None)
    chinese = i18n.catalog("zh-CN")
    template = "All-reduce time, {world} ranks, {backend}"
    try:
        assert i18n.set_language("zh-CN") == "zh-CN"
        assert "fonts-noto-cjk" in capsys.readouterr().out
        assert i18n.tr("Pipeline bubble, p = 2 stages") == chinese["Pipeline bubble, p = 2 stages"]
        fig, ax = plt.subplots()
        ax.set_title(i18n.tr("Pipeline bubble, p = 2 stages"))
        ax.set_xlabel(i18n.tr(template).format(world=4, backend="gloo"))
        ax.set_ylabel("1.5 ms")
        assert ax.get_title() == "Pipeline bubble, p = 2 stages"
        assert ax.get_xlabel() == "All-reduce time, 4 ranks, gloo"
        assert ax.get_ylabel() == "1.5 ms"
        plt.close(fig)
    finally:
        i18n.set_language("en")
    fig, ax = plt.subplots()
    ax.set_title(chinese["Pipeline bubble, p = 2 stages"])  # with the English book, text is drawn as given
    assert ax.get_title() == chinese["Pipeline bubble, p = 2 stages"]
    plt.close(fig)


def test_pad_counts_display_columns_so_cjk_rows_line_up():
    rows = [("loss", "1.0"), ("损失", "2.0"), ("손실 값", "3.0"), ("потеря", "4.0")]
    lines = [i18n.pad(label, 10) + value for label, value in rows]
    assert {i18n.width(line) for line in lines} == {13}
    assert [i18n.width(line[: -len("1.0")]) for line in lines] == [10] * 4
    assert i18n.pad("12", 5, ">") == "   12"
    assert i18n.pad("이름이 아주 긴 라벨", 4) == "이름이 아주 긴 라벨"  # never cut
    assert f"{'损失':10s}" != i18n.pad("损失", 10)  # what format's width does instead
