"""A prompt's greedy output does not depend on what else the engine is doing, in float32.

In 16-bit dtypes it can: how a prompt is chunked or batched changes the order in which bf16 partial
results are rounded, as in every engine, unless --deterministic puts every kernel in one order
(tests/test_deterministic.py); tests/test_dtypes.py holds 16-bit to transformers."""

from __future__ import annotations

import random

import pytest

from nanovllm import LLM
from tests.helpers import greedy

MAX_NEW = 32
# The default kernels' float32 guarantee; the batch-invariant ones (a CPU's default) are test_deterministic's.
F32 = {"dtype": "float32", "deterministic": False}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def target() -> list[int]:
    return _prompt(random.Random(7), 45)


@pytest.fixture(scope="module")
def alone(qwen3_dir, target) -> list[int]:
    llm = LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="16MiB", enable_prefix_caching=False, **F32)
    return llm.generate([target], greedy(MAX_NEW), use_tqdm=False)[0]["token_ids"]


def _others(n: int) -> list[list[int]]:
    rng = random.Random(11)
    return [_prompt(rng, rng.randrange(1, 120)) for _ in range(n)]


def test_in_batch_of_32(qwen3_dir, target, alone):
    llm = LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="16MiB", **F32)
    prompts = _others(31)
    prompts.insert(13, target)
    params = [greedy(random.Random(i).randrange(1, 48)) for i in range(32)]
    params[13] = greedy(MAX_NEW)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[13]["token_ids"] == alone


def test_with_forced_chunked_prefill(qwen3_dir, target, alone):
    llm = LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="16MiB", max_num_batched_tokens=8, **F32)
    prompts = [_others(3)[0], target, _others(3)[2]]
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert outs[1]["token_ids"] == alone


def test_under_preemption(qwen3_dir, target, alone):
    # 2 layers x 2 kv heads x 16 dims x 4 B x 2 (K,V) = 512 B per token; 4-token blocks: 2 KiB per block.
    # 40 blocks = 160 tokens: far less than 8 sequences of ~80 tokens need, so preemption must happen.
    llm = LLM(
        str(qwen3_dir),
        max_model_len=128,
        kvcache_block_size=4,
        kv_cache_memory=40 * 2048,
        max_num_batched_tokens=64,
        **F32,
    )
    assert llm.engine.block_manager.num_blocks == 40
    prompts = [p[:60] for p in _others(7)]
    prompts.insert(3, target)
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs[3]["token_ids"] == alone
    assert llm.engine.block_manager.num_free_blocks == 40


def test_on_prefix_cache_hit(qwen3_dir, target, alone):
    llm = LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="16MiB", **F32)
    first = llm.generate([target], greedy(MAX_NEW), use_tqdm=False)[0]
    second = llm.generate([target], greedy(MAX_NEW), use_tqdm=False)[0]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 32  # two full 16-token blocks of the 45-token prompt
    assert first["token_ids"] == second["token_ids"] == alone
    assert llm.engine.load().prefix_cache_hit_rate > 0
