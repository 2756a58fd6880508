# make example: set up .venv (CPU torch) and run the quickstart; make test: the whole suite.
VENV ?= .venv
# test worker processes (pytest-xdist); each runs torch on one thread (tests/conftest.py)
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python

.PHONY: setup example test test-fast table anchors anchors-quick quality

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[test]"
	touch $@

setup: $(VENV)/.installed

example: setup
	$(PY) examples/quickstart.py

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

table: setup
	$(PY) benchmarks/budget_table.py --csv benchmarks/budget_table.csv

anchors: setup
	$(PY) benchmarks/anchors.py --docs

anchors-quick: setup
	$(PY) benchmarks/anchors.py --quick

quality: setup
	$(PY) benchmarks/quality.py --docs
