"""Triton kernels for the paged KV cache: store, decode attention and prefill attention.

They read K/V through the block tables in place: the PyTorch reference (kernels/attention.py) first gathers
every sequence's blocks into a padded copy, which on an H100 took 56% of the GPU's time at batch 256.

Cache layout per layer: [num_blocks, block_size, kv_heads, head_dim], contiguous. Any block size works:
a tile of keys gathers each token's block id from the table, so tiles need not line up with blocks.

Inputs may be float32, bfloat16 or float16; products accumulate in fp32. On a CPU the kernels run only in
Triton's interpreter (TRITON_INTERPRET=1 set before this module is imported, as the tests do). The
interpreter mis-computes 16-bit dots, so there the tiles are upcast to fp32 first.

An fp8 cache (kernels/fp8_kv.py) is written and read as bytes through a uint8 view: the store rounds in
integer arithmetic and attention widens each byte with fp8_kv's bit trick, in registers. A tile holds the
fp8 values themselves (exact in every dot dtype); the head's K scale multiplies the scores and its V scale
the output, exactly, as scales are powers of two: the result is bit for bit that of the float kernels on
the dequantized cache.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from nanovllm.kernels import fp8_kv

# Decode: keys per tile, and the least context worth a split of its own (fewer tokens and the extra
# reduction pass costs more than the parallelism gains).
_DECODE_BLOCK_N = 64
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16
# Prefill: query rows and keys per tile.
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_N = 64


def interpreted() -> bool:
    """Whether these kernels were defined under Triton's interpreter (then they run on CPU tensors only)."""
    return isinstance(_store_kernel, InterpretedFunction)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype == torch.float32 or interpreted():
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def fp8_launch_args(
    k_cache: torch.Tensor, v_cache: torch.Tensor, scales: fp8_kv.KVScales | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The caches as the kernels take them (an fp8 cache as its bytes), the K and V scales (the caches in
    their place when unused) and the format's constexprs: FP8_MANTISSA 0 for a float cache."""
    dtype = k_cache.dtype
    if not fp8_kv.is_fp8(dtype):
        constexprs = {"FP8_MANTISSA": 0, "FP8_BIAS": 0, "FP8_MAX": 0.0, "FP8_NATIVE": False}
        return k_cache, v_cache, k_cache, v_cache, constexprs
    if scales is None:
        raise ValueError(f"a {dtype} KV cache needs its per-head scales")
    mantissa = fp8_kv.MANTISSA_BITS[dtype]
    constexprs = {
        "FP8_MANTISSA": mantissa,
        "FP8_BIAS": 2 ** (6 - mantissa) - 1,  # 7 for e4m3, 15 for e5m2
        "FP8_MAX": torch.finfo(dtype).max,
        "FP8_NATIVE": k_cache.is_cuda and not interpreted() and converts_fp8(k_cache.device),
    }
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), scales.key, scales.value, constexprs


@functools.cache
def converts_fp8(device: torch.device) -> bool:
    """Whether the GPU converts fp8 to 16 bits in hardware (sm_89 and later: two values an instruction),
    where widen_fp8's integer arithmetic made a step's attention bound by the ALUs rather than the
    memory (docs/performance.md, the H200 of 2026-11-30)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def quantize_fp8(x, scale, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """The byte fp8_kv.quantize stores for fp32 `x` and its head's `scale`: x / scale clamped to +-MAX,
    rounded to nearest, ties to even. The rounding is integer arithmetic on the float32's bits, as
    PyTorch's conversion does it: Triton's interpreter converts to fp8 without ties to even, carries into
    the exponent or subnormals, and a GPU converts natively to e4m3 only from sm_89."""
    # For a power of two, x / scale correctly rounded is the reference's x * (1 / scale) (Triton's `/` may
    # be approximate on a GPU); a flushed fp32 subnormal changes nothing, it quantizes to zero either way.
    x = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -MAX), MAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exponent = a >> 23
    SHIFT: tl.constexpr = 23 - MANTISSA
    # A normal fp8 value: rebias the exponent, then round the mantissa's dropped bits (a carry into the
    # exponent is right, and |x| <= MAX never carries past it).
    normal = (a + ((BIAS - 127) << 23) + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    # Below fp8's least normal: the significand counted in units of the least subnormal, rounded the same
    # way; the shift is capped where every significand rounds to 0 (fp32 zeros and subnormals do).
    significand = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(151 - BIAS - MANTISSA - exponent, SHIFT + 1), 31)
    subnormal = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    return (tl.where(exponent > 127 - BIAS, normal, subnormal) | sign).to(tl.uint8)


@triton.jit
def widen_fp8(byte, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """fp8 bytes -> their fp32 values, exactly (fp8_kv's bit trick, subnormals included)."""
    b = byte.to(tl.uint32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << (23 - MANTISSA))
    WIDEN: tl.constexpr = 2.0 ** (127 - BIAS)  # fp8_kv.WIDEN_FACTOR
    return bits.to(tl.float32, bitcast=True) * WIDEN


@triton.jit
def _store_kernel(
    key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, FP8_NATIVE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:  # a padding row: nothing to store
        return
    offs = tl.arange(0, WIDTH)
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    k = tl.load(key + t * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value + t * stride_vt + head * stride_vh + dim, mask=mask)
    if FP8_MANTISSA:
        k_s = tl.load(k_scale + head, mask=mask, other=1.0)
        v_s = tl.load(v_scale + head, mask=mask, other=1.0)
        k = quantize_fp8(k.to(tl.float32), k_s, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
        v = quantize_fp8(v.to(tl.float32), v_s, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
    tl.store(k_cache + slot * (NUM_KV_HEADS * HEAD_DIM) + offs, k, mask=mask)
    tl.store(v_cache + slot * (NUM_KV_HEADS * HEAD_DIM) + offs, v, mask=mask)


_INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a @ b in fp32, each row of the result summed in an order that does not depend on the row's place in
    the tile, as a GPU's MMA sums every row of a tile alike (batch-invariant kernels rely on it). In the
    interpreter tl.dot is numpy's matmul, whose BLAS kernels do not: with OpenBLAS on an AVX2 CPU, rows 6-11
    of every 12 came out an fp32 ulp away from the same row placed first. There the products are summed
    along k in order instead."""
    if _INTERPRETED:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision=PRECISION)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: fp8_kv.KVScales | None = None,
) -> None:
    """Write new tokens' K/V ([T, kv_heads, head_dim], last dim contiguous) into their slots; slot -1 skips.
    An fp8 cache gets the bytes fp8_kv.quantize gives with `scales`."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache, k_scale, v_scale, fp8 = fp8_launch_args(k_cache, v_cache, scales)
    _store_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, WIDTH=triton.next_power_of_2(kv_heads * head_dim), **fp8,
    )  # fmt: skip


@triton.jit
def _load_kv_tile(
    cache, table_row, pos, valid, kv_head, dims, dim_mask,
    stride_b, stride_t, stride_h, BLOCK_SIZE: tl.constexpr, DOT: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_NATIVE: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, D] keys or values of positions `pos`, each looked up through the block table; from an fp8
    cache, the fp8 values unscaled (FP8_NATIVE: converted by the GPU, the same values widen_fp8 gives)."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    ptrs = cache + block[:, None] * stride_b + (pos % BLOCK_SIZE)[:, None] * stride_t + kv_head * stride_h
    mask = valid[:, None] & dim_mask[None, :]
    if FP8_NATIVE:
        byte = tl.load(ptrs + dims[None, :], mask=mask, other=0)
        if FP8_MANTISSA == 3:
            tile = byte.to(tl.float8e4nv, bitcast=True)
        else:
            tile = byte.to(tl.float8e5, bitcast=True)
    elif FP8_MANTISSA:
        tile = widen_fp8(tl.load(ptrs + dims[None, :], mask=mask, other=0), FP8_MANTISSA, FP8_BIAS)
    else:
        tile = tl.load(ptrs + dims[None, :], mask=mask, other=0.0)
    return tile.to(DOT)


@triton.jit
def _head_scales(k_scale, v_scale, kv_head, scale_log2, FP8_MANTISSA: tl.constexpr):
    """The factor of a head's raw scores (K scale folded into the softmax scale) and of its summed values:
    powers of two, so folding them in is exact."""
    if FP8_MANTISSA:
        qk_scale = scale_log2 * tl.load(k_scale + kv_head)
        v_factor = tl.load(v_scale + kv_head)
    else:
        qk_scale = scale_log2
        v_factor = 1.0
    return qk_scale, v_factor


@triton.jit
def _online_softmax_step(s, v, acc, l_i, m_i, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile of log2-scaled scores `s` [rows, keys] and its values `v` [keys, D] into the running
    output `acc`, row sums `l_i` and row maxima `m_i` (flash-attention's rescaling)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + dot(p.to(DOT), v, PRECISION)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


# A step's block-table width changes from step to step; specialised on it (Triton compiles a variant for
# integers divisible by 16), a kernel would meet new variants inside a timed run (seen on an H200: a
# second of compiling in nano-vllm's bench.py workload).
@triton.jit(do_not_specialize=["stride_table", "tokens_per_split"])
def _decode_kernel(
    query, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_b, stride_t, stride_h, stride_table,
    tokens_per_split,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, FP8_NATIVE: tl.constexpr,
):  # fmt: skip
    """One sequence, one KV head (all its GROUP query heads at once), one split of the context."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = tl.load(context_lens + seq)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, context)
    groups = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, BLOCK_D)
    g_mask, d_mask = groups < GROUP, dims < HEAD_DIM
    q = tl.load(query + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT)  # fmt: skip
    table_row = block_tables + seq * stride_table
    qk_scale, v_factor = _head_scales(k_scale, v_scale, kv_head, scale_log2, FP8_MANTISSA)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k = _load_kv_tile(k_cache, table_row, pos, valid, kv_head, dims, d_mask,
                          stride_b, stride_t, stride_h, BLOCK_SIZE, DOT, FP8_MANTISSA, FP8_BIAS, FP8_NATIVE)  # fmt: skip
        s = dot(q, tl.trans(k), PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        v = _load_kv_tile(v_cache, table_row, pos, valid, kv_head, dims, d_mask,
                          stride_b, stride_t, stride_h, BLOCK_SIZE, DOT, FP8_MANTISSA, FP8_BIAS, FP8_NATIVE)  # fmt: skip
        acc, l_i, m_i = _online_softmax_step(s, v, acc, l_i, m_i, DOT, PRECISION)
    if FP8_MANTISSA:  # before the division: the float kernel divides these very sums
        acc = acc * v_factor
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 o.to(out.dtype.element_ty), mask=mask)  # fmt: skip
    else:
        # Partial results: normalised output and log2-sum-exp per head; an empty split has lse -inf.
        num_heads = tl.num_programs(1) * GROUP
        row = (seq * num_heads + heads) * NUM_SPLITS + split
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(part_out + row[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None], mask=mask)
        tl.store(part_lse + row, m_i + tl.log2(l_safe), mask=g_mask)


@triton.jit
def _combine_splits_kernel(
    part_out, part_lse, out, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    s_mask, d_mask = splits < NUM_SPLITS, dims < HEAD_DIM
    lse = tl.load(part_lse + row * NUM_SPLITS + splits, mask=s_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds tokens, so the max is finite
    o = tl.load(part_out + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    o = tl.sum(o * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out + seq * stride_ot + head * stride_oh + dims, o.to(out.dtype.element_ty), mask=d_mask)


def decode_num_splits(batch: int, kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Splits of each context so that batch * kv_heads * splits programs fill the GPU, where the contexts
    are long enough to be worth it."""
    if batch * kv_heads >= num_sms:
        return 1
    by_length = max_context_len // _MIN_TOKENS_PER_SPLIT
    return max(1, min(_MAX_SPLITS, by_length, -(-num_sms // (batch * kv_heads))))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    scales: fp8_kv.KVScales | None = None,
) -> torch.Tensor:
    """One query per sequence [B, heads, D] over its cached context (context_lens tokens, >= 1); an fp8
    cache is read with its `scales`."""
    batch, num_heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(query)
    max_tokens = block_tables.shape[1] * block_size
    tokens_per_split = _DECODE_BLOCK_N * -(-max_tokens // (num_splits * _DECODE_BLOCK_N))
    num_splits = -(-max_tokens // tokens_per_split)  # no split starts past every context
    if num_splits > 1:
        part_out = torch.empty(
            batch * num_heads * num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(batch * num_heads * num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    k_cache, v_cache, k_scale, v_scale, fp8 = fp8_launch_args(k_cache, v_cache, scales)
    _decode_kernel[(batch, kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale * math.log2(math.e),
        k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tokens_per_split,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=_pow2(group), BLOCK_D=_pow2(head_dim),
        BLOCK_N=_DECODE_BLOCK_N, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT=_dot_dtype(query.dtype), PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **fp8,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 1), NUM_SPLITS=num_splits,
            BLOCK_S=_pow2(num_splits, 1),
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["stride_table"])
def _prefill_kernel(
    query, k_cache, v_cache, block_tables, query_start_loc, start_positions, out, scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_b, stride_t, stride_h, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, FP8_NATIVE: tl.constexpr,
):  # fmt: skip
    """BLOCK_M queries of one chunk and one head, causal over the chunk's cached context (earlier chunks
    and cached prefixes included, its own K/V already stored)."""
    seq, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(query_start_loc + seq)
    num_queries = tl.load(query_start_loc + seq + 1) - first
    if m_block * BLOCK_M >= num_queries:
        return
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = tl.load(start_positions + seq) + rows  # each query's position in its sequence
    dims = tl.arange(0, BLOCK_D)
    r_mask, d_mask = rows < num_queries, dims < HEAD_DIM
    q = tl.load(query + (first + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(DOT)  # fmt: skip
    kv_head = head // GROUP
    table_row = block_tables + seq * stride_table
    qk_scale, v_factor = _head_scales(k_scale, v_scale, kv_head, scale_log2, FP8_MANTISSA)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.max(tl.where(r_mask, q_pos, 0), 0) + 1  # keys past the last query are never seen
    for start in range(0, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_kv_tile(k_cache, table_row, pos, valid, kv_head, dims, d_mask,
                          stride_b, stride_t, stride_h, BLOCK_SIZE, DOT, FP8_MANTISSA, FP8_BIAS, FP8_NATIVE)  # fmt: skip
        s = dot(q, tl.trans(k), PRECISION) * qk_scale
        # Causal: the row max stays finite, since key 0 precedes every query.
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        v = _load_kv_tile(v_cache, table_row, pos, valid, kv_head, dims, d_mask,
                          stride_b, stride_t, stride_h, BLOCK_SIZE, DOT, FP8_MANTISSA, FP8_BIAS, FP8_NATIVE)  # fmt: skip
        acc, l_i, m_i = _online_softmax_step(s, v, acc, l_i, m_i, DOT, PRECISION)
    if FP8_MANTISSA:
        acc = acc * v_factor
    o = acc / l_i[:, None]
    tl.store(out + (first + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             o.to(out.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])  # fmt: skip


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    start_positions: torch.Tensor,
    max_query_len: int,
    scale: float,
    scales: fp8_kv.KVScales | None = None,
) -> torch.Tensor:
    """Causal attention of chunks laid back to back in `query` [T, heads, D]: chunk i holds
    query_start_loc[i + 1] - query_start_loc[i] tokens at positions start_positions[i] onwards, and
    attends to every cached token of its sequence up to each query's position (an fp8 cache read with
    its `scales`)."""
    num_heads, head_dim = query.shape[1:]
    num_seqs = block_tables.shape[0]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(query)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, _PREFILL_BLOCK_M))
    k_cache, v_cache, k_scale, v_scale, fp8 = fp8_launch_args(k_cache, v_cache, scales)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, start_positions, out,
        scale * math.log2(math.e), k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
        BLOCK_M=_PREFILL_BLOCK_M, BLOCK_N=_PREFILL_BLOCK_N, BLOCK_SIZE=block_size,
        DOT=_dot_dtype(query.dtype), PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **fp8,
    )  # fmt: skip
    return out
