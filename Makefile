# Everything a fresh machine needs, idempotent: `make test` builds .venv once, then just runs the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint bench protos

venv: $(STAMP)

# torch is pinned to the CPU build that lies on this machine's disk; an unpinned `torch` would pull a
# multi-GB CUDA build. On a CUDA machine install the CUDA build of torch first (see README).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

# Regenerate the Python gRPC stubs from protos/ (tests fail while they are stale).
protos: $(STAMP)
	$(BIN)/python protos/generate.py
