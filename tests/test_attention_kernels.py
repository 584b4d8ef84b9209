"""The C++ CPU decode-attention kernel against the PyTorch reference path."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM
from nanovllm.kernels.attention import DecodeBatch, decode_attention
from tests.helpers import greedy


@pytest.mark.parametrize(
    "batch, heads, kv_heads, head_dim, block_size",
    [(1, 4, 2, 16, 16), (7, 9, 3, 64, 16), (5, 8, 8, 32, 4), (3, 16, 8, 128, 8)],
)
def test_decode_kernel_matches_reference(kernels, batch, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(batch * heads)
    num_blocks = 40
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    context_lens = torch.randint(1, 6 * block_size, (batch,), generator=gen)
    width = int(-(-context_lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    mask = (torch.arange(width * block_size) < context_lens[:, None])[:, None, None, :]
    query = torch.randn(batch, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    ref = decode_attention(query, k_cache, v_cache, DecodeBatch(tables, context_lens, mask), scale)
    out = kernels.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_engine_outputs_equal_across_backends(kernels, qwen3_dir):
    prompts = [[5, 6, 7], list(range(20, 90)), [300] * 17]
    outs = {}
    for backend in ("torch", "cpu_kernel"):
        llm = LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="8MiB", attention_backend=backend)
        attn = llm.engine.runner.model.attention_layers()[0]
        assert (attn.decode_kernel is None) == (backend == "torch")
        outs[backend] = [o["token_ids"] for o in llm.generate(prompts, greedy(20), use_tqdm=False)]
    assert outs["torch"] == outs["cpu_kernel"]
