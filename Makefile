# The README's two commands, `make demo` and `make test`, set up .venv on a fresh machine
# with nothing but Python 3.11, then do their job.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint typecheck browser bench bench-real constraints clean

# --no-compile: pip would byte-compile every module of every package (about 40 s, most of the set-up);
# Python compiles the ones a run imports, once, as it imports them. The venv's own pip (Python
# 3.11's, 23.2 or later) installs everything here: upgrading it first cost 10 s.
# That needs Python to write its bytecode caches: with PYTHONDONTWRITEBYTECODE set (as some images
# do), each of the suite's ~200 Python processes would compile torch from source again.
unexport PYTHONDONTWRITEBYTECODE
# Every package at the version in constraints.txt, the set the suite last passed with.
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile -c constraints.txt
EXTRAS := dev,recorder,model-explorer,tensorboard

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	@# The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[$(EXTRAS)]'
	touch $(STAMP)

# Resolve the newest releases again into constraints.txt (its comment lines kept), in a venv of its
# own; then make test says whether the suite passes with them.
constraints:
	rm -rf .venv-resolve && $(PYTHON) -m venv .venv-resolve
	.venv-resolve/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0
	.venv-resolve/bin/python -m pip install -q --disable-pip-version-check --no-compile -e '.[$(EXTRAS)]'
	grep '^#' constraints.txt > constraints.new
	.venv-resolve/bin/python -m pip freeze --exclude-editable | sort -f >> constraints.new
	mv constraints.new constraints.txt && rm -rf .venv-resolve

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check fwdtrace tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy fwdtrace

# The live page's test (tests/test_live_page.py) drives Debian's chromium through chromedriver:
# installed here when missing and apt is usable as root; elsewhere that test skips (with CI=true it fails).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium and chromium-driver for the live page test"; \
	    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; \
	  else echo "chromium or chromedriver missing and no root apt-get: the live page test will skip"; fi; \
	fi

# The docs site into site/ (git-ignored): mkdocs-material, the API reference read from the docstrings
# by mkdocstrings. --strict turns every warning (a broken link, a page missing from the nav, a
# docstring it cannot read) into a failure; not with -q, which hides the warnings and lets the build
# pass. A few seconds; make test builds it first.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The whole suite: unit tests, doctests of the package, notebooks (tests/test_notebooks.py), every
# Python example of README.md and docs/ (tests/test_docs.py); before it, lint and the docs build.
# loadgroup keeps the conformance cases of one model (tests/test_conformance.py) on one worker,
# so that its build, trace and exports are done once.
# mypy (about 35 s of one core from a cold cache) runs beside the tests, its verdict after them:
# the run fails if either does, and mypy's report is printed only when it fails.
test: $(STAMP) lint docs browser
	$(VENV)/bin/mypy fwdtrace > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(PY) -m pytest -n 2 --dist loadgroup -q --doctest-modules fwdtrace tests; tests=$$?; \
	if ! wait $$mypy; then cat $(VENV)/mypy.log; echo "mypy fwdtrace failed (make typecheck)"; exit 1; fi; \
	exit $$tests

bench: $(STAMP)
	$(PIP) -e '.[dev,recorder,bench]'
	$(PY) benchmarks/trace_overhead.py
	$(PY) benchmarks/onnx_check.py
	$(PY) benchmarks/onnx_emit.py
	$(PY) benchmarks/dump_throughput.py
	$(PY) benchmarks/analyze_cost.py
	$(PY) benchmarks/trace_scaling.py
	$(PY) benchmarks/live_cost.py
	$(PY) benchmarks/recorder_cost.py

# Real models: the conformance suite's entry points over torchvision (classification, detection,
# segmentation) and timm, a summary in out/conformance_real.{jsonl,md} (resumable: pairs already
# there are skipped); then a dozen real models drawn with default settings, a contact sheet in
# out/real_models/. Its own venv: torchvision needs torch 2.14.1 (a CUDA build that runs on the
# CPU, several GB), which `make test` must never depend on. timm goes in without its dependencies
# (they would replace torch), then the three it needs.
REAL_VENV := .venv-real
$(REAL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(REAL_VENV)
	$(REAL_VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(REAL_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
	$(REAL_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(REAL_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps timm
	$(REAL_VENV)/bin/python -m pip install -q --disable-pip-version-check huggingface_hub safetensors pyyaml
	touch $(REAL_VENV)/.installed

# JOBS=N runs N models at once, each in its own process with one torch thread (memory: a few GiB each).
JOBS ?= 1
bench-real: $(REAL_VENV)/.installed
	$(REAL_VENV)/bin/python benchmarks/conformance_real.py run --jobs $(JOBS)
	$(REAL_VENV)/bin/python benchmarks/conformance_real.py table
	$(REAL_VENV)/bin/python benchmarks/render_real_models.py

clean:
	rm -rf $(VENV) $(REAL_VENV) site graph.png graph.svg
