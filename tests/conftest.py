from __future__ import annotations

from pathlib import Path

import pytest

from nanovllm.kernels.cpu_kernels import load_cpu_kernels
from tests.model_factory import build_model


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
def kernels():
    """The C++ CPU kernels; building them must work wherever the suite runs (gcc and Python headers)."""
    module = load_cpu_kernels()
    assert module is not None, "the C++ CPU kernels failed to build; see the cpu_kernels_unavailable log line"
    return module
