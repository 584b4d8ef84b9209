"""In float32: greedy tokens equal transformers', teacher-forced logits within 1e-4 (16-bit dtypes are
tested against transformers in the same dtype in tests/test_dtypes.py)."""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm import LLM
from tests.helpers import greedy, hf_greedy, hf_logits, teacher_forced_logits

ARCHS = ["qwen3", "llama", "qwen2"]
MAX_NEW = 24


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 17, 33, 64, 100]
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def arch_llm(request, model_dirs):
    path = model_dirs[request.param]
    llm = LLM(str(path), max_model_len=512, kv_cache_memory="32MiB", kvcache_block_size=16, dtype="float32")
    return path, llm


def test_greedy_batch_equals_transformers(arch_llm):
    path, llm = arch_llm
    prompts = _prompts(0)
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(path, prompt, MAX_NEW)
        assert out["finish_reason"] == "length"


@pytest.mark.parametrize("chunk", [1000, 7, 1], ids=["prefill", "chunked", "decode"])
def test_teacher_forced_logits_match(arch_llm, chunk):
    path, llm = arch_llm
    prompts = _prompts(1)[1:]
    ours = teacher_forced_logits(llm, prompts, chunk)
    for prompt, logits in zip(prompts, ours):
        ref = hf_logits(path, prompt)
        assert logits.shape == ref.shape
        torch.testing.assert_close(logits.cpu(), ref, atol=1e-4, rtol=0)  # ours may be on a GPU
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_logits_are_not_near_ties(arch_llm):
    """Guards the meaning of the greedy comparison: the random models must have clear winners."""
    path, _ = arch_llm
    logits = hf_logits(path, _prompts(2)[4])
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3
