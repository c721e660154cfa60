# Everything runs inside .venv, created and filled from requirements.txt on first use.
# `make book` builds the rendered book, `make test` runs the whole test suite.
# `make bench` compares launch times; `make times` executes only the notebooks and reports their times.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: book test bench times stress clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

book: $(STAMP)
	$(PY) tools/build_book.py

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/launch_bench.py

stress: $(STAMP)
	$(PY) -m pytest -m stress tests/test_stress.py

times: $(STAMP)
	$(PY) -m pytest chapters

clean:
	rm -rf _build
