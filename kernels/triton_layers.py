"""Triton kernels that fuse a decoder layer's small ops, bound with the Triton attention backend.

A decode step at batch 1 on an H200 spent more time launching ~21 kernels per layer than computing them:
RMSNorm was a residual add, a norm and a weight multiply; q/k norm, RoPE and the KV store seven kernels;
SiLU-and-mul two. Here each is one kernel, so a layer issues its four projections, attention and four of
these.

`linear` is the projections' matmul for --deterministic (worker/layers/linear.py): cuBLAS picks its kernel,
and with it the order of each output's sum (split-K included), by the shape, so a row's result depends on
how many rows came with it. Here the tile is fixed whatever the number of rows and K is walked in one
sequence of tiles, so every output is summed in one order.

Each kernel rounds where the PyTorch modules it replaces round (worker/layers/norm.py, rotary.py): in
16-bit the normalised value rounds to the dtype before the weight multiplies it, each RoPE product rounds
before the sum, as transformers computes them; arithmetic in between is fp32. On a CPU they run only in
Triton's interpreter (the tests); the attention kernels' module decides that (kernels/triton_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Importing the attention kernels first defines every kernel under the same interpreter setting.
from nanovllm.kernels import fp8_kv, triton_attention

_INTERPRETED = tl.constexpr(triton_attention.interpreted())


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype`, to nearest, ties to even.

    On a GPU the rounding mode is explicit. (RoPE's sums once differed from PyTorch's in a quarter of
    their elements on an H200: not these casts but a fused multiply-add, which qk_norm_rope_store's
    launch turns off.) Triton's interpreter truncates to bf16 (fp16 it rounds right), so there bf16 is
    rounded by hand, bit for bit as a GPU rounds, and the cast that follows is exact."""
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True).to(dtype)
    elif _INTERPRETED:
        y = x.to(dtype)
    else:
        y = x.to(dtype, fp_downcast_rounding="rtne")
    return y


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype` and back to fp32, for arithmetic that goes on in fp32 (a GPU matched
    PyTorch bit for bit on these; only a final cast after one went wrong, see _cast)."""
    return _cast(x, dtype).to(tl.float32)


# Rows a program of the row-wise kernels below: one on a GPU, whose programs run side by side; 16 in Triton's
# interpreter, which pays for each program's every op (the same arithmetic on a block of rows costs it about
# what one row does).
_ROWS = 16 if triton_attention.interpreted() else 1


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, rows, stride_x, stride_r, stride_o, n, eps,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD: tl.constexpr, ROUND: tl.constexpr, WEIGHT_FP32: tl.constexpr,
):  # fmt: skip
    """ROWS rows, each on its own: out = norm(x [+ residual]) * weight; with ADD the sum is written back to
    `residual`. In 16 bits the normalised row is rounded, then multiplied by the weight and rounded; a
    zero-centred norm's float32 weight (WEIGHT_FP32: 1 + w, Qwen3.5's) multiplies the float32 row and the
    product is rounded once."""
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (offs < n)
    dtype = out.dtype.element_ty
    v = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        v = v + tl.load(residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        if ROUND:
            rounded = _cast(v, dtype)
            tl.store(residual + row * stride_r + offs, rounded, mask=mask)
            v = rounded.to(tl.float32)
        else:
            tl.store(residual + row * stride_r + offs, v, mask=mask)
    y = v / tl.sqrt(tl.sum(v * v, axis=1)[:, None] / n + eps)
    w = tl.load(weight + offs, mask=offs < n, other=0.0).to(tl.float32)
    if WEIGHT_FP32:
        tl.store(out + row * stride_o + offs, _cast(y * w, dtype), mask=mask)
    elif ROUND:
        tl.store(out + row * stride_o + offs, _cast(_round(y, dtype) * w, dtype), mask=mask)
    else:
        tl.store(out + row * stride_o + offs, y * w, mask=mask)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    _rms_norm_kernel[(triton.cdiv(rows, _ROWS),)](
        x, residual if residual is not None else x, weight, out, rows,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), n, eps,
        BLOCK=triton.next_power_of_2(n), ROWS=_ROWS, ADD=residual is not None, ROUND=x.dtype != torch.float32,
        WEIGHT_FP32=x.dtype != torch.float32 and weight.dtype == torch.float32,
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [T, n] (last dim contiguous) into a new tensor."""
    out = torch.empty_like(x)
    _rms_norm(x, None, weight, eps, out)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = x + residual, then x = RMSNorm(residual)."""
    _rms_norm(x, residual, weight, eps, x)


@triton.jit
def _silu_and_mul_kernel(
    gate_up, out, rows, stride_in, stride_out, n, BLOCK: tl.constexpr, ROWS: tl.constexpr, ROUND: tl.constexpr
):  # fmt: skip
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < rows) & (cols < n)
    dtype = out.dtype.element_ty
    gate = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride_in + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    if ROUND:
        tl.store(out + row * stride_out + cols, _cast(_round(silu, dtype) * up, dtype), mask=mask)
    else:
        tl.store(out + row * stride_out + cols, silu * up, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2n] = [gate | up], as [T, n]."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(triton.cdiv(rows, _ROWS), triton.cdiv(n, block))](
            gate_up,
            out,
            rows,
            gate_up.stride(0),
            out.stride(0),
            n,
            BLOCK=block,
            ROWS=_ROWS,
            ROUND=gate_up.dtype != torch.float32,
        )
    return out


@triton.jit
def _qk_rope_store_kernel(
    qkv, norm_weight, cos, sin, q_out, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_qkv, stride_cos, stride_q, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, Q_HEAD_STRIDE: tl.constexpr,
    ROTARY: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    NORM: tl.constexpr, WEIGHT_FP32: tl.constexpr, ROUND: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, FP8_NATIVE: tl.constexpr,
):  # fmt: skip
    """One token: its q and k heads normalised per head (NORM) and rotated on their first ROTARY
    dimensions, q written to q_out, k and v to the token's cache slot (a negative slot stores nothing);
    into an fp8 cache, k as rounded to the dtype and v quantized as store_kvcache quantizes them. q head h
    starts Q_HEAD_STRIDE * h into the row (2 HEAD_DIM where each q head is followed by its gate), the k
    heads after the last q head's stride, the v heads after them."""
    t = tl.program_id(0)
    dtype = q_out.dtype.element_ty
    head = tl.arange(0, HEADS_PAD)[:, None]
    dim = tl.arange(0, DIM_PAD)[None, :]
    turned = dim < ROTARY
    partner = tl.where(turned, (dim + ROTARY // 2) % ROTARY, dim)  # rotate-half pairs d with d +- ROTARY / 2
    mask = (head < NUM_HEADS + NUM_KV_HEADS) & (dim < HEAD_DIM)
    kv_start = NUM_HEADS * Q_HEAD_STRIDE
    row = (
        qkv
        + t * stride_qkv
        + tl.where(head < NUM_HEADS, head * Q_HEAD_STRIDE, kv_start + (head - NUM_HEADS) * HEAD_DIM)
    )
    x = tl.load(row + dim, mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        x, swapped = x * scale[:, None], swapped * scale[:, None]
        w = tl.load(norm_weight + head * HEAD_DIM + dim, mask=mask, other=0.0).to(tl.float32)
        w_partner = tl.load(norm_weight + head * HEAD_DIM + partner, mask=mask, other=0.0).to(tl.float32)
        if ROUND and not WEIGHT_FP32:  # the normalised value rounds before the weight multiplies it
            x, swapped = _round(x, dtype), _round(swapped, dtype)
        x, swapped = x * w, swapped * w_partner
        if ROUND:
            x, swapped = _round(x, dtype), _round(swapped, dtype)
    c = tl.load(cos + t * stride_cos + dim, mask=turned, other=0.0).to(tl.float32)
    s = tl.load(sin + t * stride_cos + dim, mask=turned, other=0.0).to(tl.float32)
    if ROUND:
        rotated = tl.where(
            turned, _cast(_round(x * c, dtype) + _round(swapped * s, dtype), dtype), x.to(dtype)
        )
    else:
        rotated = tl.where(turned, x * c + swapped * s, x)
    tl.store(q_out + t * stride_q + head * HEAD_DIM + dim, rotated, mask=mask & (head < NUM_HEADS))
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        width = NUM_KV_HEADS * HEAD_DIM
        k_mask = mask & (head >= NUM_HEADS)
        k = rotated
        if FP8_MANTISSA:
            k_rows = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
            k_s = tl.load(k_scale + (head - NUM_HEADS), mask=k_rows, other=1.0)
            k = triton_attention.quantize_fp8(k.to(tl.float32), k_s, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
        tl.store(k_cache + slot * width + (head - NUM_HEADS) * HEAD_DIM + dim, k, mask=k_mask)
        kv_head = tl.arange(0, KV_PAD)[:, None]
        v_mask = (kv_head < NUM_KV_HEADS) & (dim < HEAD_DIM)
        v = tl.load(qkv + t * stride_qkv + kv_start + (NUM_KV_HEADS + kv_head) * HEAD_DIM + dim, mask=v_mask)
        if FP8_MANTISSA:
            v_s = tl.load(v_scale + kv_head, mask=kv_head < NUM_KV_HEADS, other=1.0)
            v = triton_attention.quantize_fp8(v.to(tl.float32), v_s, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
        tl.store(v_cache + slot * width + kv_head * HEAD_DIM + dim, v, mask=v_mask)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: fp8_kv.KVScales | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """From the QKV projection's output [T, (heads + 2 kv_heads) * head_dim]: q [T, heads, head_dim]
    normalised per head (Qwen3's q/k norm, with `norm_weight` [heads + kv_heads, head_dim]; None: no norm)
    and rotated (cos and signed sin [T, 1, rotary_dim], RotaryEmbedding.lookup: the first rotary_dim of
    each head turn, the rest pass); k, likewise, and v stored in the KV cache at `slot_mapping` (an fp8
    cache: the bytes store_kvcache writes with `scales`). A float32 weight in a 16-bit model (a zero-centred
    norm's 1 + w) multiplies the float32 normalised row, rounded once. `gated`: Qwen3.5's gated attention,
    whose rows hold each q head followed by its output gate ([T, (2 heads + 2 kv_heads) * head_dim])."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        k_cache, v_cache, k_scale, v_scale, fp8 = triton_attention.fp8_launch_args(k_cache, v_cache, scales)
        _qk_rope_store_kernel[(tokens,)](
            qkv, norm_weight if norm_weight is not None else qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
            k_scale, v_scale, qkv.stride(0), cos.stride(0), q.stride(0), eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            Q_HEAD_STRIDE=(2 if gated else 1) * head_dim, ROTARY=cos.shape[-1],
            HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads), KV_PAD=triton.next_power_of_2(num_kv_heads),
            DIM_PAD=triton.next_power_of_2(head_dim), NORM=norm_weight is not None,
            WEIGHT_FP32=norm_weight is not None and norm_weight.dtype != qkv.dtype, ROUND=qkv.dtype != torch.float32,
            **fp8,
            # In 16-bit no fused multiply-add: the compiler narrows RoPE's products and sum, whose operands
            # are exact in the dtype, to 16-bit operations and may fuse one product into the sum, one
            # rounding where transformers rounds twice (an H200 differed in a quarter of the elements).
            enable_fp_fusion=qkv.dtype == torch.float32,
        )  # fmt: skip
    return q


# The batch-invariant matmul's tile: never chosen by the number of rows (no autotuning, no split-K).
_LINEAR_BLOCK_M, _LINEAR_BLOCK_N, _LINEAR_BLOCK_K = 64, 64, 64


@triton.jit(do_not_specialize=["rows"])
def _linear_kernel(
    x, weight, bias, out, rows, n, k, stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of out = x @ weight.T (+ bias), K in BLOCK_K steps from 0, fp32 sums."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        a = tl.load(
            x + m[:, None] * stride_x + kk[None, :], mask=(m[:, None] < rows) & (kk[None, :] < k), other=0.0
        )
        b = tl.load(weight + cols[None, :] * stride_w + kk[:, None], mask=(cols[None, :] < n) & (kk[:, None] < k),
                    other=0.0)  # fmt: skip
        acc += triton_attention.dot(a.to(DOT), b.to(DOT), PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(out + m[:, None] * stride_o + cols[None, :], _cast(acc, out.dtype.element_ty),
             mask=(m[:, None] < rows) & (cols[None, :] < n))  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias [N]) in x's dtype (both with a contiguous last dim), each output
    summed over K in one order whatever T."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, _LINEAR_BLOCK_M), triton.cdiv(n, _LINEAR_BLOCK_N))
        _linear_kernel[grid](
            x, weight, bias if bias is not None else x, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=_LINEAR_BLOCK_M, BLOCK_N=_LINEAR_BLOCK_N, BLOCK_K=_LINEAR_BLOCK_K,
            DOT=triton_attention._dot_dtype(x.dtype), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )  # fmt: skip
    return out


@triton.jit
def _adapted_rows(rows, row_slots, count, ROWS: tl.constexpr):
    """Program (i, .)'s ROWS adapted rows: their indexes, their rows of x and y, their adapter slots, and
    whether each is there with an adapter (a slot of -1 has none)."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = i < count
    slot = tl.load(row_slots + i, mask=live, other=-1)
    return i, tl.load(rows + i, mask=live, other=0), slot, live & (slot >= 0)


@triton.jit
def _lora_shrink_kernel(
    x, a, s, rows, row_slots, count, k, rank, stride_x, stride_a_slot, stride_s,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """s[i, part p's ranks] = A[slot of i, part p's ranks] @ x[rows[i]] in fp32, for the ROWS adapted rows i of
    program (., p), each on its own; nothing for a row whose slot is negative (no adapter)."""
    i, row, slot, on = _adapted_rows(rows, row_slots, count, ROWS)
    p = tl.program_id(1)
    ranks = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    weights = a + slot[:, None, None] * stride_a_slot + (p * rank + ranks[None, :, None]) * k
    acc = tl.zeros([ROWS, BLOCK_R], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        xv = tl.load(
            x + row[:, None] * stride_x + kk[None, :], mask=on[:, None] & (kk[None, :] < k), other=0.0
        )
        w = tl.load(
            weights + kk[None, None, :],
            mask=on[:, None, None] & (ranks[None, :, None] < rank) & (kk[None, None, :] < k),
            other=0.0,
        )
        acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32)[:, None, :], axis=2)
    tl.store(
        s + i[:, None] * stride_s + p * rank + ranks[None, :], acc, mask=on[:, None] & (ranks[None, :] < rank)
    )


@triton.jit
def _lora_expand_kernel(
    y, s, b, rows, row_slots, count, n, rank, bound1, bound2, stride_y, stride_s, stride_b_slot,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """y[rows[i], cols] += s[i, ranks of each column's part] . B[slot of i, cols], rounded once, for the ROWS
    adapted rows i and the columns of program (., j); a column's part is 0 below bound1, 1 below bound2,
    else 2. Nothing for a row whose slot is negative."""
    i, row, slot, on = _adapted_rows(rows, row_slots, count, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    part = (cols >= bound1).to(tl.int32) + (cols >= bound2).to(tl.int32)
    inside = on[:, None, None] & (cols[None, :, None] < n) & (ranks[None, None, :] < rank)
    sv = tl.load(s + i[:, None, None] * stride_s + part[None, :, None] * rank + ranks[None, None, :], mask=inside,
                 other=0.0)  # fmt: skip
    w = tl.load(b + slot[:, None, None] * stride_b_slot + cols[None, :, None] * rank + ranks[None, None, :],
                mask=inside, other=0.0)  # fmt: skip
    delta = tl.sum(sv * w.to(tl.float32), axis=2)
    out = y + row[:, None] * stride_y + cols[None, :]
    written = on[:, None] & (cols[None, :] < n)
    current = tl.load(out, mask=written, other=0.0).to(tl.float32)
    tl.store(out, _cast(current + delta, y.dtype.element_ty), mask=written)


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    part_bounds: list[int],
) -> None:
    """y[rows[i]] += each part's (x[rows[i]] A_p^T) B_p^T with the slot row_slots[i] (worker/layers/lora.py's
    layout: a [slots, parts * rank, K], b [slots, N, rank], part_bounds [0, ..., N]), each row on its own
    (batch-invariant), no host synchronisation; rows whose slot is negative are left as they are (a
    captured decode graph's base and padding rows). One program per adapted row (_ROWS of them in the
    interpreter) and part for the shrink, per row and BLOCK_N columns for the expand: punica's BGMV, for
    decode-sized batches."""
    count, parts, rank = rows.numel(), len(part_bounds) - 1, b.shape[2]
    if count == 0:
        return
    if parts > 3:
        raise ValueError(f"lora_add_ takes projections of at most 3 parts, got {parts}")
    k, n = x.shape[1], y.shape[1]
    s = torch.empty((count, parts * rank), dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(rank)
    programs = triton.cdiv(count, _ROWS)
    _lora_shrink_kernel[(programs, parts)](
        x, a, s, rows, row_slots, count, k, rank, x.stride(0), a.stride(0), s.stride(0),
        BLOCK_R=block_r, BLOCK_K=256, ROWS=_ROWS,
    )  # fmt: skip
    bounds = [*part_bounds[1:-1], n, n][:2]
    block_n = 64
    _lora_expand_kernel[(programs, triton.cdiv(n, block_n))](
        y, s, b, rows, row_slots, count, n, rank, *bounds, y.stride(0), s.stride(0), b.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r, ROWS=_ROWS,
    )  # fmt: skip
