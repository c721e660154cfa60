# Everything runs inside .venv, created and filled from requirements.txt on first use.
# `make help` lists the targets; the two a reader needs are `make book` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

NODE_STAMP := node_modules/.package-lock.json
# What ruff lints and format-checks (configured in pyproject.toml).
LINTED := code tools tests benchmarks conftest.py
NOTEBOOKS := chapters/*/*.ipynb

.PHONY: help book test check lint numerics bench times stress slides compat gpu-check \
	format clear-outputs headers sync status chapter-map clean

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 22

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# reveal.js & co. for offline slides (package.json); without npm the slide tests are skipped.
$(NODE_STAMP): package.json package-lock.json
	if command -v npm >/dev/null; then npm ci --no-audit --no-fund; else echo "npm not found: no slides"; fi

# ---------------------------------------------------------------- reading and testing

book: $(STAMP) $(NODE_STAMP) ## build the book (executes what changed) into _build/html
	$(PY) tools/build_book.py

# The failure scenarios run twice each here and 20 times in `make stress`: one round of the
# launcher's scenarios takes about 30 s on 2 cores and a two-node attempt 6-17 s, so 20 rounds
# in every CI run would spend about 12 minutes; the notebooks of chapters 07 and 12 also restart,
# kill and resume torchrun jobs once in each of six languages on every run.
test: lint $(NODE_STAMP) ## everything CI runs: lint, numerics, every test and notebook, the book
	$(MAKE) --no-print-directory numerics
	bash tools/install_browser.sh
	STRESS_ATTEMPTS=$${STRESS_ATTEMPTS:-2} TWO_NODE_ATTEMPTS=$${TWO_NODE_ATTEMPTS:-2} $(PY) -m pytest --durations=15

# Fast tier: unit tests, parity and static checks; no notebook execution, book build,
# browser, Colab simulation or stress scenarios (those are marked slow or stress).
check: lint ## the fast tier (< 3 min): lint and the tests not marked slow or stress
	$(PY) -m pytest tests -m "not slow and not stress" -q

# The language lint: English that skips tr(), the reviewers' terms, each language's typography.
lint: $(STAMP) ## ruff check, ruff format --check and the language lint
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(PY) tools/lint_language.py

# The fast numerical tests (marked numerics) under other CPU kernels, < 1 min each: ATen's portable
# kernels with MKL's reproducible code path, then ATen's and oneDNN's AVX2 kernels. They add in
# another order than this CPU's own, so a bound tuned to one machine fails here as on another.
# Each kernel set gets an Inductor cache of its own: the cache's key does not include
# ATEN_CPU_CAPABILITY, and C++ generated for this CPU's kernels does not build under another's.
numerics: $(STAMP) ## the numerical tests under ATen's default and AVX2 kernels
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/_build/inductor-default ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE \
		$(PY) -m pytest tests -m "numerics and not slow" -q
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/_build/inductor-avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(PY) -m pytest tests -m "numerics and not slow" -q

bench: $(STAMP) ## launch-time and result-transfer benchmarks
	$(PY) benchmarks/launch_bench.py
	$(PY) benchmarks/results_bench.py

slides: $(STAMP) $(NODE_STAMP) ## reveal.js decks into _build/slides
	$(PY) tools/build_slides.py

stress: $(STAMP) ## the launcher's failure scenarios, 20 times each
	$(PY) -m pytest -m stress tests

times: $(STAMP) ## execute only the notebooks and report each one's time
	$(PY) -m pytest chapters

# Its own venv per torch release (from the package index, not .venv); COMPAT_ARGS e.g. --notebooks 03,07
compat: ## another torch in .venv-compat/, recorded in compat/: make compat TORCH=2.15.0
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.15.0 [COMPAT_ARGS='--notebooks 03 --only-fast ...']"; exit 2; }
	$(PYTHON) tools/compat.py run $(TORCH) $(COMPAT_ARGS)

gpu-check: $(STAMP) ## on a GPU machine: every English chapter, one PASS/FAIL line per cell
	$(PY) tools/run_notebooks.py $(if $(ONLY),--only $(ONLY))

# ---------------------------------------------------------------- maintaining

format: $(STAMP) ## ruff format and ruff check --fix
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

clear-outputs: $(STAMP) ## strip outputs and execution counts from every notebook
	$(VENV)/bin/jupyter nbconvert --clear-output --inplace --log-level=WARN $(NOTEBOOKS)

headers: $(STAMP) ## badges, language links and setup cells of every notebook
	$(PY) tools/headers.py

sync: $(STAMP) ## copy the English code cells into every translation, keeping translated comments
	$(PY) tools/translations.py sync

status: $(STAMP) ## chapter x language: current, behind or missing
	$(PY) tools/translations.py status

chapter-map: $(STAMP) ## the README's chapter map from chapters.yml
	$(PY) tools/chapter_map.py

clean: ## remove _build
	rm -rf _build
