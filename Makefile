# Everything runs inside .venv, created and filled from requirements.txt on first use.
# `make book` builds the rendered book, `make test` runs the whole test suite (lint included),
# `make check` the fast tier: lint, format check and the tests not marked slow or stress (< 3 min).
# `make bench` compares launch times; `make times` executes only the notebooks and reports their times.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

NODE_STAMP := node_modules/.package-lock.json
# What ruff lints and format-checks (configured in pyproject.toml).
LINTED := code tools tests benchmarks conftest.py

.PHONY: book test check lint bench times stress slides clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# reveal.js & co. for offline slides (package.json); without npm the slide tests are skipped.
$(NODE_STAMP): package.json package-lock.json
	if command -v npm >/dev/null; then npm ci --no-audit --no-fund; else echo "npm not found: no slides"; fi

book: $(STAMP) $(NODE_STAMP)
	$(PY) tools/build_book.py

# The two-node scenarios take 8-17 s per attempt: 5 attempts each here, 20 in `make stress`.
test: lint $(NODE_STAMP)
	bash tools/install_browser.sh
	TWO_NODE_ATTEMPTS=$${TWO_NODE_ATTEMPTS:-5} $(PY) -m pytest

# Fast tier: unit tests, parity and static checks; no notebook execution, book build,
# browser, Colab simulation or stress scenarios (those are marked slow or stress).
check: lint
	$(PY) -m pytest tests -m "not slow and not stress" -q

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

bench: $(STAMP)
	$(PY) benchmarks/launch_bench.py
	$(PY) benchmarks/results_bench.py

slides: $(STAMP) $(NODE_STAMP)
	$(PY) tools/build_slides.py

stress: $(STAMP)
	$(PY) -m pytest -m stress tests

times: $(STAMP)
	$(PY) -m pytest chapters

clean:
	rm -rf _build
