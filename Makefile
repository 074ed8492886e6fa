# Tandem: two commands on a fresh machine.
#   make demo   set up .venv, then run the demo
#   make test   set up .venv, then ruff, mypy and the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint typecheck unit demo bench clean

setup: $(STAMP)

# Debian's python3 may lack the venv module; as root we can add it.
$(STAMP): pyproject.toml
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed; installing python3-venv (needs root)"; \
	  apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

test: lint typecheck
	$(VENV)/bin/pytest -q

demo: $(STAMP)
	@echo "Serving (tandem serve + a streamed generation) arrives with the gRPC service issue."
	@echo "Until then the demo replays a scripted workload through the real scheduler:"
	$(PY) benchmarks/scheduler_bench.py --quick

bench: $(STAMP)
	$(PY) benchmarks/scheduler_bench.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
