"""Slides: every notebook is sliced sensibly, and a built deck works offline in a real browser.

The browser test builds chapter 01's deck (executed, so outputs and plots are on
it), opens it in headless Chromium with a network log, and checks that reveal.js
initialised, that the page requested nothing beyond file:// URLs, and takes
screenshots of the title slide and of the first code slide into _build/slides/screenshots.
"""

import json
import pathlib
import re
import shutil
import subprocess

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
import build_slides  # noqa: E402
import headers  # noqa: E402
from distcourse.runtime import languages  # noqa: E402

NOTEBOOKS = headers.notebooks(ROOT)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = ROOT / "_build" / "slides" / "screenshots"
CHROMIUM_FLAGS = [  # headless, and none of the browser's own background traffic
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def slide_positions(nb):
    """(h, v) reveal.js coordinates of every cell that starts a slide or sub-slide."""
    h, v, positions = -1, 0, []
    for i, cell in enumerate(nb.cells):
        kind = cell.metadata["slideshow"]["slide_type"]
        if kind == "slide":
            h, v = h + 1, 0
        elif kind == "subslide":
            v += 1
        if kind in ("slide", "subslide"):
            positions.append((i, h, v))
    return positions


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.relative_to(ROOT).as_posix() for p in NOTEBOOKS])
def test_sensible_slide_count(path):
    nb = nbformat.read(path, as_version=4)
    positions = slide_positions(nb)
    slides = len({h for _, h, _ in positions})
    assert 6 <= slides <= 30, f"{slides} slides"
    assert 8 <= len(positions) <= 50, f"{len(positions)} slides and sub-slides"
    assert nb.cells[0].metadata["slideshow"]["slide_type"] == "slide"


def chromium(url: str, tmp: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
    )


def page_requests(netlog: pathlib.Path) -> list[str]:
    """URLs the page itself asked for (the browser's own services are not the page's)."""
    log = json.loads(netlog.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    urls = []
    for event in log["events"]:
        params = event.get("params", {})
        if event["type"] == start_job and "file://" in params.get("network_isolation_key", ""):
            urls.append(params["url"])
    return urls


@pytest.mark.slow  # builds a deck and renders it in a browser
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (tools/install_browser.sh installs it as root)")
@pytest.mark.skipif(not (ROOT / "node_modules" / "reveal.js").exists(), reason="run `npm ci` for reveal.js")
def test_deck_renders_offline_in_chromium(tmp_path):
    notebook = ROOT / "chapters" / "en" / "01-dataloader-workers.ipynb"
    out = tmp_path / "slides"
    build_slides.copy_vendor(out)
    deck, (slides, with_sub) = build_slides.build(notebook, out, execute=True)
    html = deck.read_text()
    assert not re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="https?:', html), "a remote script/style/image"

    url = deck.as_uri()
    dom = chromium(
        url, tmp_path, "--virtual-time-budget=10000", f"--log-net-log={tmp_path / 'net.json'}", "--dump-dom"
    ).stdout
    reveal = re.search(r'<div class="(reveal [^"]*)"', dom)
    assert reveal and "ready" in reveal.group(1).split(), "reveal.js did not initialise"
    assert dom.count("<section") == slides + with_sub
    assert [u for u in page_requests(tmp_path / "net.json") if not u.startswith(("file:", "data:"))] == []
    # The detector itself works: a page with one remote image is caught.
    control = tmp_path / "control.html"
    control.write_text('<html><body><img src="https://example.invalid/remote.png"></body></html>')
    chromium(
        control.as_uri(),
        tmp_path,
        "--virtual-time-budget=3000",
        f"--log-net-log={tmp_path / 'control.json'}",
        "--dump-dom",
    )
    assert page_requests(tmp_path / "control.json") == ["https://example.invalid/remote.png"]

    nb = nbformat.read(notebook, as_version=4)
    code_slide = next((h, v) for i, h, v in slide_positions(nb) if i > 1 and nb.cells[i].cell_type == "code")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    for name, anchor in (("01-title", "#/0"), ("01-code", f"#/{code_slide[0]}/{code_slide[1]}")):
        png = SCREENSHOTS / f"{name}.png"
        chromium(url + anchor, tmp_path, "--virtual-time-budget=10000", "--window-size=1280,720", f"--screenshot={png}")
        colours = Image.open(png).convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 20, f"{png} looks blank"


@pytest.mark.skipif(shutil.which("fc-list") is None, reason="fontconfig is not installed")
@pytest.mark.parametrize("lang", [lang.html.lower() for lang in languages.TRANSLATED])  # fontconfig's spelling
def test_fonts_for_every_script_are_installed(lang):
    if CHROMIUM is None:
        pytest.skip("no browser installed, so no fonts either")
    fonts = subprocess.run(["fc-list", f":lang={lang}"], capture_output=True, text=True).stdout
    assert fonts.strip(), f"no font covers {lang}: Cyrillic/CJK/Hangul would render as boxes"
