"""The Triton kernels on an FP8 KV cache (kernels/fp8_kv.py): the store and the fused q/k norm + RoPE + store
write the bytes fp8_kv.quantize gives, and attention reads what fp8_kv.dequantize gives, bit for bit the
float kernels' result on the dequantized cache. Each kv head has its own scale, far from the other's
(2**-6 and 2**3, K's and V's swapped), so a scale applied to the wrong head or tensor shows. On a CPU the
kernels run in Triton's interpreter (tests/conftest.py turns it on); on a GPU, compiled."""

from __future__ import annotations

import pytest
import torch

from nanovllm.kernels import fp8_kv, triton_layers
from nanovllm.kernels import triton_attention as triton_ops
from nanovllm.kernels.attention import AttentionBackend, ChunkBatch, DecodeBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REFERENCE = AttentionBackend()
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 2, 4, 32, 16  # GQA: 4 query heads per kv head


def _assert_close(out, ref, dtype):
    """tests/test_triton_kernels.py's tolerances for float caches: fp32 accumulation in both; in 16-bit the
    kernel rounds its output once (an ulp or two apart)."""
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2 * torch.finfo(dtype).eps)


def _chunk_batch(chunks: list[tuple[int, int]], tables: torch.Tensor) -> ChunkBatch:
    """chunks: (start position, number of new tokens) per sequence."""
    loc = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    return ChunkBatch(
        query_start_loc=loc.to(DEVICE),
        start_positions=torch.tensor([s for s, _ in chunks], device=DEVICE),
        block_tables=tables,
        max_query_len=max(n for _, n in chunks),
        num_tokens=int(loc[-1]),
        block_size=BLOCK_SIZE,
    )


def _scales(kv_heads: int = KV_HEADS) -> fp8_kv.KVScales:
    key = torch.tensor([2.0**-6, 2.0**3] * (kv_heads // 2), device=DEVICE)
    return fp8_kv.KVScales(key=key, value=key.flip(0))


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def _finite_codes(fmt: torch.dtype) -> torch.Tensor:
    """Every byte of `fmt` that is a finite number, as uint8."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes[codes.view(fmt).float().isfinite()]


def _rounding_cases(fmt: torch.dtype) -> torch.Tensor:
    """Values in units of the scale (float32, both signs): every finite fp8 value, the midpoints between
    neighbours (ties, to the even one) and a float32 ulp either side of them, ties and near-ties between
    subnormals and below the least one (to zero), fp32 subnormals, past the largest value (clamped) up to
    infinity, and random magnitudes across the format's range."""
    values = _finite_codes(fmt).view(fmt).float()
    values = values[values > 0].sort().values
    mid = (values[:-1] + values[1:]) / 2
    least = values[0]
    big = torch.finfo(fmt).max
    gen = torch.Generator().manual_seed(0)
    spread = torch.ldexp(torch.rand(512, generator=gen) + 0.5, torch.randint(-20, 17, (512,), generator=gen))
    special = torch.tensor([0.0, least / 2, least / 4, 1.5 * least, 2.5 * least, 1e-40, big * 1.03, 1e30])
    special = torch.cat([special, torch.tensor([float("inf")])])
    inf = torch.tensor(float("inf"))
    positive = torch.cat([
        values, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf), special, spread,
        torch.nextafter(values, inf), torch.nextafter(values, -inf),
    ])  # fmt: skip
    return torch.cat([positive, -positive])


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_store_writes_the_reference_bytes(fmt, dtype):
    """store_kvcache into an fp8 cache: the bytes of fp8_kv.quantize, including clamping, ties to even,
    subnormals and flushes to zero, for each head with its own scale; a padding slot stores nothing."""
    cases = _rounding_cases(fmt)
    cases = torch.cat([cases, cases[: -len(cases) % HEAD_DIM]]).view(-1, 1, HEAD_DIM)
    scales = _scales()
    # Each head's inputs are the cases at its scale (rounded to the dtype: the same inputs for both).
    key = (cases * scales.key.cpu()[:, None]).to(DEVICE, dtype)
    value = (cases.flip(0) * scales.value.cpu()[:, None]).to(DEVICE, dtype)
    tokens = key.shape[0]
    slots = torch.randperm(tokens + 8, generator=torch.Generator().manual_seed(1))[:tokens].to(DEVICE)
    slots[3] = -1
    k_cache, v_cache = (
        torch.zeros(tokens + 8, 1, KV_HEADS, HEAD_DIM, dtype=fmt, device=DEVICE) for _ in "kv"
    )
    triton_ops.store_kvcache(key, value, k_cache, v_cache, slots, scales)

    stored = slots >= 0
    for cache, x, scale in ((k_cache, key, scales.key), (v_cache, value, scales.value)):
        flat = _bytes(cache).view(-1, KV_HEADS, HEAD_DIM)
        assert torch.equal(flat[slots[stored]], _bytes(fp8_kv.quantize(x[stored], scale, fmt)))
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots[stored]] = False
        assert not flat[untouched].any()


def test_fp8_cache_without_scales_is_refused():
    cache = torch.zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn, device=DEVICE)
    key = torch.zeros(1, KV_HEADS, HEAD_DIM, device=DEVICE)
    with pytest.raises(ValueError, match="needs its per-head scales"):
        triton_ops.store_kvcache(key, key, cache, cache, torch.zeros(1, dtype=torch.long, device=DEVICE))


def _fp8_cache(gen, fmt, num_blocks, scale):
    """A cache of K or V of order 1 per head, quantized with that head's scale."""
    x = torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    return fp8_kv.quantize(x, scale, fmt).view(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def _dequantized(k_cache, v_cache, scales, dtype):
    return (
        fp8_kv.dequantize(k_cache, scales.key, dtype, heads_axis=2),
        fp8_kv.dequantize(v_cache, scales.value, dtype, heads_axis=2),
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_decode_reads_the_dequantized_cache(fmt, dtype):
    """Contexts one short of, at and one past a 16-token block, a single token and longer ones, in one
    pass and split; against the PyTorch path on the dequantized cache, and bit for bit the float kernel's
    result on it."""
    gen = torch.Generator().manual_seed(DTYPES.index(dtype) + 3 * FORMATS.index(fmt))
    context_lens = torch.tensor([1, 15, 16, 17, 50, 100])
    width = -(-int(context_lens.max()) // BLOCK_SIZE)
    scales = _scales()
    num_blocks = width * len(context_lens)
    k_cache = _fp8_cache(gen, fmt, num_blocks, scales.key)
    v_cache = _fp8_cache(gen, fmt, num_blocks, scales.value)
    tables = torch.randperm(num_blocks, generator=gen).view(len(context_lens), width).to(DEVICE)
    query = torch.randn(len(context_lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    lens = context_lens.to(DEVICE)
    k_ref, v_ref = _dequantized(k_cache, v_cache, scales, torch.float32)
    ref = REFERENCE.decode(query.float(), k_ref, v_ref, DecodeBatch(tables, lens, BLOCK_SIZE), HEAD_DIM**-0.5)
    k_float, v_float = _dequantized(k_cache, v_cache, scales, dtype)
    for splits in (1, 3):
        out = triton_ops.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, splits, scales=scales
        )
        _assert_close(out, ref, dtype)
        float_out = triton_ops.paged_decode_attention(
            query, k_float, v_float, tables, lens, HEAD_DIM**-0.5, splits
        )
        assert torch.equal(out, float_out)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
def test_attention_reads_every_finite_byte_exactly(fmt):
    """Caches holding every finite byte: a one-token context returns its value exactly (the widening of
    each byte, subnormals included, times its head's scale), and longer contexts give the float kernel's
    bits on the dequantized cache."""
    codes = _finite_codes(fmt)
    per_block = KV_HEADS * HEAD_DIM
    num_blocks = -(-len(codes) // per_block)
    gen = torch.Generator().manual_seed(len(codes))
    raw = torch.zeros(num_blocks, BLOCK_SIZE, per_block, dtype=torch.uint8)
    first = torch.zeros(num_blocks * per_block, dtype=torch.uint8)  # token 0 of each block: every code once
    first[: len(codes)] = codes[torch.randperm(len(codes), generator=gen)]
    raw[:, 0] = first.view(num_blocks, per_block)
    raw[:, 1:] = codes[torch.randint(len(codes), raw[:, 1:].shape, generator=gen)]
    v_cache = raw.view(fmt).view(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(DEVICE)
    k_cache = v_cache.flip(0)
    scales = _scales()
    tables = torch.arange(num_blocks, device=DEVICE)[:, None]
    query = torch.randn(num_blocks, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(DEVICE)
    ones = torch.ones(num_blocks, dtype=torch.long, device=DEVICE)
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ones, 1.0, scales=scales)
    v_float = fp8_kv.dequantize(v_cache, scales.value, torch.float32, heads_axis=2)
    assert torch.equal(out, v_float[:, 0].repeat_interleave(GROUP, dim=1))

    k_float = fp8_kv.dequantize(k_cache, scales.key, torch.float32, heads_axis=2)
    lens = torch.full((num_blocks,), BLOCK_SIZE, device=DEVICE)
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 2**-12, scales=scales)
    assert torch.equal(out, triton_ops.paged_decode_attention(query, k_float, v_float, tables, lens, 2**-12))


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_prefill_reads_the_dequantized_cache(fmt, dtype):
    """Chunks starting at 0, at, before and across block boundaries and mid-sequence, one-token chunks
    among them; against the PyTorch path and the float kernel's bits on the dequantized cache; and each
    query of a chunk run as a one-token chunk gives the bits it gives in the chunk (batch invariance)."""
    gen = torch.Generator().manual_seed(10 + DTYPES.index(dtype) + 3 * FORMATS.index(fmt))
    chunks = [
        (0, 1),
        (BLOCK_SIZE, 3),
        (BLOCK_SIZE - 1, 2),
        (5, 20),
        (40, 1),
        (0, 2 * BLOCK_SIZE + 1),
        (17, 9),
    ]
    width = max(-(-(s + n) // BLOCK_SIZE) for s, n in chunks)
    scales = _scales()
    num_blocks = width * len(chunks)
    k_cache = _fp8_cache(gen, fmt, num_blocks, scales.key)
    v_cache = _fp8_cache(gen, fmt, num_blocks, scales.value)
    tables = torch.randperm(num_blocks, generator=gen).view(len(chunks), width).to(DEVICE)
    batch = _chunk_batch(chunks, tables)
    query = torch.randn(batch.num_tokens, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(DEVICE, dtype)

    def prefill(k, v, q, b, **kwargs):
        return triton_ops.paged_prefill_attention(
            q, k, v, b.block_tables, b.query_start_loc, b.start_positions, b.max_query_len, HEAD_DIM**-0.5,
            **kwargs,
        )  # fmt: skip

    out = prefill(k_cache, v_cache, query, batch, scales=scales)
    k_ref, v_ref = _dequantized(k_cache, v_cache, scales, torch.float32)
    _assert_close(out, REFERENCE.cached(query.float(), k_ref, v_ref, batch, HEAD_DIM**-0.5), dtype)
    assert torch.equal(out, prefill(*_dequantized(k_cache, v_cache, scales, dtype), query, batch))

    seq = 3  # the chunk of 20 tokens from position 5
    first, (start, count) = sum(n for _, n in chunks[:seq]), chunks[seq]
    one_token = _chunk_batch([(start + i, 1) for i in range(count)], tables[seq].repeat(count, 1))
    alone = prefill(k_cache, v_cache, query[first : first + count], one_token, scales=scales)
    assert torch.equal(alone, out[first : first + count])


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_qk_norm_rope_store_writes_the_store_kernels_bytes(fmt, dtype):
    """The fused kernel into an fp8 cache: q as into a float cache, and the bytes store_kvcache writes
    for the k (rotated, in the dtype) and v the fused kernel stores into a float cache."""
    heads, kv_heads, head_dim, tokens, num_blocks = KV_HEADS * GROUP, KV_HEADS, 16, 9, 4
    gen = torch.Generator().manual_seed(20 + DTYPES.index(dtype) + 3 * FORMATS.index(fmt))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv[:, -head_dim:] *= 1e3  # a head of v past the format's range at its scale: clamped
    qkv = qkv.to(DEVICE, dtype)
    weight = (1 + torch.randn(heads + kv_heads, head_dim, generator=gen)).to(DEVICE, dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6.3
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(DEVICE, dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens].to(DEVICE)
    slots[4] = -1
    scales = _scales(kv_heads)

    def caches(cache_dtype):
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        return [torch.zeros(shape, dtype=cache_dtype, device=DEVICE) for _ in "kv"]

    k_float, v_float = caches(dtype)
    q_ref = triton_layers.qk_norm_rope_store(
        qkv, heads, kv_heads, head_dim, weight, 1e-6, cos, sin, k_float, v_float, slots
    )
    k_fp8, v_fp8 = caches(fmt)
    q = triton_layers.qk_norm_rope_store(
        qkv, heads, kv_heads, head_dim, weight, 1e-6, cos, sin, k_fp8, v_fp8, slots, scales=scales
    )
    assert torch.equal(q, q_ref)
    stored = slots[slots >= 0]
    key = k_float.view(-1, kv_heads, head_dim)[stored]
    value = v_float.view(-1, kv_heads, head_dim)[stored]
    k_store, v_store = caches(fmt)
    triton_ops.store_kvcache(key, value, k_store, v_store, stored, scales)
    assert torch.equal(_bytes(k_fp8), _bytes(k_store)) and torch.equal(_bytes(v_fp8), _bytes(v_store))
    assert torch.equal(
        _bytes(k_fp8).view(-1, kv_heads, head_dim)[stored], _bytes(fp8_kv.quantize(key, scales.key, fmt))
    )
    clamped = fp8_kv.quantize(value, scales.value, fmt).float().abs() == torch.finfo(fmt).max
    assert clamped.any()
