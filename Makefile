# Everything runs inside .venv, created and filled from requirements.txt on first use.
# `make book` builds the rendered book, `make test` runs the whole test suite (lint included),
# `make check` the fast tier: lint, format check and the tests not marked slow or stress (< 3 min).
# `make bench` compares launch times; `make times` executes only the notebooks and reports their times.
# `make compat TORCH=2.15.0` tests another torch in .venv-compat/ and records it in compat/ (tools/compat.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

NODE_STAMP := node_modules/.package-lock.json
# What ruff lints and format-checks (configured in pyproject.toml).
LINTED := code tools tests benchmarks conftest.py

.PHONY: book test check lint bench times stress slides clean compat

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
	$(MAKE) --no-print-directory numerics
	bash tools/install_browser.sh
	TWO_NODE_ATTEMPTS=$${TWO_NODE_ATTEMPTS:-5} $(PY) -m pytest

# The fast numerical tests (marked numerics) under other CPU kernels, < 1 min each: ATen's portable
# kernels with MKL's reproducible code path, then ATen's and oneDNN's AVX2 kernels. They add in
# another order than this CPU's own, so a bound tuned to one machine fails here as on another.
.PHONY: numerics
numerics: $(STAMP)
	ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE $(PY) -m pytest tests -m "numerics and not slow" -q
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest tests -m "numerics and not slow" -q

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

# Its own venv per torch release (from the package index, not .venv); COMPAT_ARGS e.g. --notebooks 03,07
compat:
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.15.0 [COMPAT_ARGS='--notebooks 03 --only-fast ...']"; exit 2; }
	$(PYTHON) tools/compat.py run $(TORCH) $(COMPAT_ARGS)

clean:
	rm -rf _build
