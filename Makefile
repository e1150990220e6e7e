# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check fwdtrace tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy fwdtrace

test: $(STAMP) lint typecheck
	$(PY) -m pytest -n 2 -q tests

bench: $(STAMP)
	$(PY) benchmarks/trace_overhead.py

clean:
	rm -rf $(VENV) graph.png graph.svg
