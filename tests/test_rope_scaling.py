"""RoPE scaling (worker/layers/rotary.py): YaRN and linear, as transformers computes them. float32 greedy
tokens equal transformers' at positions past twice the original context, teacher-forced logits within
1e-4; the cos/sin table equals transformers' bit for bit; an unsupported scaling fails at start naming it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM
from nanovllm.common.errors import UnsupportedModelError
from nanovllm.worker.layers.rotary import RotaryEmbedding
from nanovllm.worker.model_config import ModelConfig
from tests.helpers import greedy, hf_greedy, hf_logits, teacher_forced_logits
from tests.model_factory import build_model

ORIGINAL = 64  # the checkpoint's "training" context: the prompt below runs past twice that
SCALINGS = {
    "yarn": (
        "qwen3",
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "yarn-mscale": (
        "llama",
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": ORIGINAL,
            "beta_fast": 16,
            "mscale": 0.9,
            "mscale_all_dim": 1.1,
            "truncate": False,
        },
    ),
    "linear": ("qwen2", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}),
}
PROMPT = [random.Random(4).randrange(2, 512) for _ in range(150)]
MAX_NEW = 24


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled_model(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, rope = SCALINGS[request.param]
    return build_model(
        arch, tmp_path_factory.mktemp(request.param) / arch, seed=5, max_position=512, rope=rope
    )


def test_the_table_is_transformers_cos_and_sin(scaled_model: Path):
    model = AutoModelForCausalLM.from_pretrained(scaled_model, dtype=torch.float32)
    positions = torch.arange(400)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    cfg = ModelConfig.from_pretrained_dir(scaled_model)
    table = RotaryEmbedding(cfg.head_dim, 400, cfg.rope_theta, torch.float32, cfg.rope_scaling).table
    half = cfg.head_dim // 2
    assert torch.equal(table[:, : cfg.head_dim], cos[0])
    assert torch.equal(table[:, cfg.head_dim + half :], sin[0, :, half:])  # the signed half: [-sin, sin]


def test_greedy_tokens_equal_transformers_past_twice_the_original_context(scaled_model: Path):
    llm = LLM(str(scaled_model), max_model_len=512, kv_cache_memory="16MiB", dtype="float32")
    out = llm.generate([PROMPT], greedy(MAX_NEW), use_tqdm=False)[0]
    assert len(PROMPT) > 2 * ORIGINAL
    assert out["token_ids"] == hf_greedy(scaled_model, PROMPT, MAX_NEW)
    for chunk in (1000, 7):  # prefill and chunked prefill
        ours = teacher_forced_logits(llm, [PROMPT], chunk)[0]
        torch.testing.assert_close(ours.cpu(), hf_logits(scaled_model, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("rope", "words"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, ["longrope", "yarn", "linear"]),
        ({"rope_type": "dynamic", "factor": 2.0}, ["dynamic"]),
        ({"rope_type": "yarn", "factor": 4.0}, ["yarn", "original_max_position_embeddings"]),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "low_freq": 1},
            ["low_freq"],
        ),
        ({"rope_type": "linear", "factor": 0}, ["linear", "factor"]),
    ],
)
def test_an_unsupported_scaling_fails_at_start_naming_it(tmp_path: Path, rope: dict, words: list[str]):
    model = build_model("qwen3", tmp_path / "qwen3", tokenizer=False)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as failure:
        LLM(str(model), dtype="float32")
    assert all(word in str(failure.value) for word in words), str(failure.value)
