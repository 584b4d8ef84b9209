"""What tests/test_fp8_checkpoints.py and tests/test_int4_checkpoints.py share: the engine's options, the
prompts, an engine with its start log's checkpoint_quantization line, and greedy tokens held to
transformers on a reference copy of the weights."""

from __future__ import annotations

import random
from pathlib import Path

from nanovllm import LLM
from tests.helpers import greedy, hf_greedy, info_logs

# Packed weights on the exact kernel: these checkpoints' tokens are compared with transformers' on the
# dequantized weights, token for token (the integer dots, int4's default, round x to int8 too).
ENGINE = {
    "max_model_len": 256,
    "kv_cache_memory": "16MiB",
    "dtype": "float32",
    "exact_quantized_matmuls": True,
}
MAX_NEW = 16


def checkpoint_prompts() -> list[list[int]]:
    rng = random.Random(84)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 9, 40)]


def loaded_with_start_log(**options) -> tuple[LLM, dict]:
    """The engine and its start log's checkpoint_quantization line."""
    with info_logs() as logs:
        llm = LLM(**{**ENGINE, **options})
    (line,) = [e for e in logs if e["event"] == "checkpoint_quantization"]
    return llm, line


def assert_transformers_tokens(llm: LLM, reference: Path) -> None:
    prompts = checkpoint_prompts()
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(reference, prompt, MAX_NEW), prompt
