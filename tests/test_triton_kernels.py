"""The Triton kernels (kernels/triton_attention.py) against the PyTorch reference backend, and the engine
on the Triton backend against the engine on PyTorch. On a CPU the kernels run in Triton's interpreter
(tests/conftest.py turns it on); on a GPU, compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import ConfigError
from nanovllm.kernels import triton_attention as triton_ops
from nanovllm.kernels.attention import AttentionBackend, ChunkBatch, DecodeBatch
from nanovllm.kernels.backends import select_attention_backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REFERENCE = AttentionBackend()


def _cache(gen, num_blocks, block_size, kv_heads, head_dim, dtype):
    return [
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        for _ in range(2)
    ]


def _tables(gen, num_blocks, rows, width):
    """Each row's blocks drawn at random from the cache (no two rows share one)."""
    ids = torch.randperm(num_blocks, generator=gen)[: rows * width]
    return ids.view(rows, width).to(DEVICE)


def _assert_close(out, ref, dtype):
    """fp32 accumulation in both; in 16-bit the kernel rounds its output once (an ulp or two apart)."""
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2 * torch.finfo(dtype).eps)


CASES = [  # heads, kv_heads (GQA ratio 1, 2, 4, 8), head_dim, block_size
    (4, 4, 64, 16),
    (8, 4, 128, 16),
    (8, 2, 64, 256),
    (16, 2, 128, 16),
    (6, 2, 80, 5),  # head_dim and block size that are not powers of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", CASES)
def test_triton_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    # lengths one short of, at and one past a block, a single token, and a long context; odd batch size
    context_lens = torch.tensor([1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 700])
    width = -(-int(context_lens.max()) // block_size)
    k_cache, v_cache = _cache(gen, width * len(context_lens), block_size, kv_heads, head_dim, dtype)
    tables = _tables(gen, k_cache.shape[0], len(context_lens), width)
    query = torch.randn(len(context_lens), heads, head_dim, generator=gen).to(DEVICE, dtype)
    batch = DecodeBatch(tables, context_lens.to(DEVICE), block_size)
    ref = REFERENCE.decode(query.float(), k_cache.float(), v_cache.float(), batch, head_dim**-0.5)
    for splits in (1, 4):  # one pass, and the context split four ways then combined
        out = triton_ops.paged_decode_attention(
            query, k_cache, v_cache, tables, batch.context_lens, head_dim**-0.5, splits
        )
        _assert_close(out, ref, dtype)


def test_triton_decode_2k_context_split():
    gen = torch.Generator().manual_seed(5)
    context_lens = torch.tensor([2048, 1, 1500])
    k_cache, v_cache = _cache(gen, 3 * 128, 16, 2, 64, torch.float32)
    tables = _tables(gen, k_cache.shape[0], 3, 128)
    query = torch.randn(3, 8, 64, generator=gen).to(DEVICE)
    batch = DecodeBatch(tables, context_lens.to(DEVICE), 16)
    ref = REFERENCE.decode(query, k_cache, v_cache, batch, 0.125)
    splits = triton_ops.decode_num_splits(3, 2, 2048, num_sms=132)
    assert splits > 1
    out = triton_ops.paged_decode_attention(
        query, k_cache, v_cache, tables, batch.context_lens, 0.125, splits
    )
    _assert_close(out, ref, torch.float32)


def _chunk_batch(chunks, block_size, width, tables):
    """chunks: (start position, number of new tokens) per sequence."""
    starts = [s for s, _ in chunks]
    loc = [0]
    for _, n in chunks:
        loc.append(loc[-1] + n)
    return ChunkBatch(
        query_start_loc=torch.tensor(loc, device=DEVICE),
        start_positions=torch.tensor(starts, device=DEVICE),
        block_tables=tables,
        max_query_len=max(n for _, n in chunks),
        num_tokens=loc[-1],
        block_size=block_size,
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", CASES)
def test_triton_prefill_over_paged_cache_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    """Continuing chunks (prefix-cache hits, chunked prefill) of varied lengths, starting at and across
    block boundaries, including one-token chunks and a chunk longer than the kernel's 64-row tile."""
    gen = torch.Generator().manual_seed(heads + head_dim + block_size)
    chunks = [
        (0, 1),
        (block_size, 3),
        (block_size - 1, 2),
        (5, 70),
        (130, 1),
        (0, 2 * block_size + 1),
        (17, 40),
    ]
    width = max(-(-(s + n) // block_size) for s, n in chunks)
    k_cache, v_cache = _cache(gen, width * len(chunks), block_size, kv_heads, head_dim, dtype)
    tables = _tables(gen, k_cache.shape[0], len(chunks), width)
    batch = _chunk_batch(chunks, block_size, width, tables)
    query = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    ref = REFERENCE.cached(query.float(), k_cache.float(), v_cache.float(), batch, head_dim**-0.5)
    out = triton_ops.paged_prefill_attention(
        query, k_cache, v_cache, tables, batch.query_start_loc, batch.start_positions, batch.max_query_len,
        head_dim**-0.5,
    )  # fmt: skip
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_writes_exactly_the_mapped_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.zeros(6, 16, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2))
    # a view with strides of a fused QKV projection's output, as the model passes it
    qkv = torch.randn(5, 8, 64, generator=gen).to(DEVICE, dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 17, -1, 95, 16], device=DEVICE)  # -1: a padding row, not stored
    triton_ops.store_kvcache(key, value, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    REFERENCE.store(key[keep].contiguous(), value[keep].contiguous(), ref_k, ref_v, slots[keep])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def _generate(model_dir, backend: str, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(
        str(model_dir), max_model_len=256, kv_cache_memory="4MiB", dtype="float32", device=DEVICE.type,
        attention_backend=backend, **kwargs,
    )  # fmt: skip
    assert llm.engine.runner.kernel_backend == backend
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.runner.num_blocks
    return [o["token_ids"] for o in outs]


@pytest.mark.slow
def test_triton_engine_greedy_equals_torch_backend(qwen3_dir):
    """Prompts of several lengths in one batch, a shared prefix (cache hits continue from the cache) and
    prompts longer than a step's token budget (chunked prefill), decoded together."""
    shared = list(range(40, 80))
    prompts = [[5, 6, 7], shared + [1, 2], shared + [9], list(range(100, 190))]
    kwargs = {"max_num_batched_tokens": 64}
    assert _generate(qwen3_dir, "triton", prompts, **kwargs) == _generate(
        qwen3_dir, "torch", prompts, **kwargs
    )


def test_auto_never_picks_triton_on_a_cpu():
    """The interpreter is for tests: "auto" on a CPU takes the C++ kernels or PyTorch."""
    assert select_attention_backend("auto", torch.device("cpu"), torch.float32, 16).backend.name != "triton"


def test_triton_asked_for_on_a_cpu_without_the_interpreter_fails_at_startup():
    """Compiled Triton kernels need a GPU: asked for by name on a CPU, the error says so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from nanovllm.kernels.backends import select_attention_backend\n"
        "select_attention_backend('triton', torch.device('cpu'), torch.float32, 16)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert (
        "ConfigError: attention_backend='triton' cannot run on cpu: Triton kernels run on a CPU only"
        in proc.stderr
    )


def test_flash_attn_asked_for_but_unavailable_fails_at_startup(qwen3_dir):
    """flash-attn is not installed on the CPU machines (and needs CUDA): asked for, it fails naming why."""
    with pytest.raises(
        ConfigError, match="attention_backend='flash_attn' cannot run on cpu: flash-attn runs only"
    ):
        LLM(str(qwen3_dir), kv_cache_memory="4MiB", device="cpu", attention_backend="flash_attn")
