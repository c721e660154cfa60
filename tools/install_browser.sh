#!/usr/bin/env bash
# Headless Chromium and fonts (Latin, Cyrillic, CJK, Hangul) for the slide test
# (tests/test_slides.py). Needs root for apt-get; otherwise that test is skipped.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && fc-list 2>/dev/null | grep -qi "Noto Sans CJK"; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_browser.sh: not root, so Chromium is not installed; the slide browser test will be skipped"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-noto-core fonts-noto-cjk fontconfig >/dev/null
