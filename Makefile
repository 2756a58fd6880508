# make example: set up .venv (CPU torch) and run the quickstart; make test: the whole suite.
VENV ?= .venv
# test worker processes (pytest-xdist); each runs torch on one thread (tests/conftest.py)
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python

.PHONY: setup example test test-fast table anchors anchors-quick quality gpu-check

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

# make gpu-check: the prepared run on a CUDA machine (benchmarks/gpu_check.py; --dry-run lists its
# steps and time boxes). It runs python3, not $(PY): a GPU machine has its CUDA torch installed
# system-wide, and the .venv that `setup` builds holds CPU torch, which sees no GPU. Without CUDA it
# prints one line and exits 0. Another interpreter: make gpu-check GPU_PY=.venv/bin/python
GPU_PY ?= python3

gpu-check:
	@$(GPU_PY) benchmarks/gpu_check.py
