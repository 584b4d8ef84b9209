from __future__ import annotations

from pathlib import Path

import pytest

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
