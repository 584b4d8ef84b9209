"""The block-FP8 projection on the Triton path: y = x W^T (+ bias) with W held as Qwen's published `-FP8`
checkpoints ship it (worker/layers/block_fp8.py): float8_e4m3fn bytes [N, K] and one float32 scale per
`block` x `block` tile of them, [ceil(N / block), ceil(K / block)].

W is read as its bytes, a quarter of float32's and half of a 16-bit weight's traffic, which is what a
decode step's projections wait on. A program computes a [BLOCK_M, BLOCK_N] tile of y; BLOCK_N and BLOCK_K
divide the scale block, so a tile's columns and each step of its K loop lie in one scale block and the
scale is one number per step: the step's dot of x with the bytes' exact values (converted by the GPU from
sm_89 on, else widened by fp8_kv's bit trick, as in the interpreter; every e4m3 value is exact in bf16, fp16
and fp32, so both give the same values), accumulated in fp32, then times the scale. Activations are x's dtype (float32, bfloat16 or float16), never quantized.

The tile is fixed whatever the number of rows and K is walked in one order, as kernels/triton_layers.py's
`linear`: every output is summed alike however many rows came with it (batch-invariant). On a CPU the
kernel runs only in Triton's interpreter (the tests); they passed on an H200 with the bit trick (2026-11-30),
the GPU's conversion has not yet run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import triton_attention
from nanovllm.kernels.triton_layers import _cast

_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 128, 128
_E4M3_MANTISSA: tl.constexpr = tl.constexpr(3)
_E4M3_WIDEN: tl.constexpr = tl.constexpr(2.0 ** (127 - 7))  # fp8_kv.WIDEN_FACTOR for e4m3 (bias 7)
_INTERPRETED = tl.constexpr(triton_attention.interpreted())


@triton.jit(do_not_specialize=["rows"])
def _block_fp8_linear_kernel(
    x, weight, scale, bias, out, rows, n, k, stride_x, stride_w, stride_s, stride_o,
    SCALE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of out = x @ (bytes * scales).T (+ bias); `weight` is the bytes (uint8)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    scale_row = scale + (tl.program_id(1) * BLOCK_N // SCALE_BLOCK) * stride_s
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        a = tl.load(
            x + m[:, None] * stride_x + kk[None, :], mask=(m[:, None] < rows) & (kk[None, :] < k), other=0.0
        )
        byte = tl.load(weight + cols[None, :] * stride_w + kk[:, None], mask=(cols[None, :] < n) & (kk[:, None] < k),
                       other=0)  # fmt: skip
        # triton_attention.widen_fp8 and .dot written out: in the interpreter each call of a jit function
        # costs as much as the step's arithmetic
        if NATIVE:
            b = byte.to(tl.float8e4nv, bitcast=True)
        else:
            bits = ((byte & 0x80).to(tl.uint32) << 24) | (
                (byte & 0x7F).to(tl.uint32) << (23 - _E4M3_MANTISSA)
            )
            b = bits.to(tl.float32, bitcast=True) * _E4M3_WIDEN
        s = tl.load(scale_row + k0 // SCALE_BLOCK)
        if _INTERPRETED:  # products summed along k in order (see triton_attention.dot)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b[None, :, :], axis=1) * s
        else:
            acc += tl.dot(a.to(DOT), b.to(DOT), input_precision=PRECISION) * s
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(out + m[:, None] * stride_o + cols[None, :], _cast(acc, out.dtype.element_ty),
             mask=(m[:, None] < rows) & (cols[None, :] < n))  # fmt: skip


def linear_block_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias [N]) in x's dtype, W being `weight` (float8_e4m3fn [N, K], last dim contiguous)
    times `scale` (float32 [ceil(N / block), ceil(K / block)]) block by block."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k:
        raise ValueError(
            f"linear_block_fp8: a float8_e4m3fn weight [N, {k}], got {weight.dtype} {list(weight.shape)}"
        )
    blocks = [-(-n // block), -(-k // block)]
    if list(scale.shape) != blocks or scale.dtype != torch.float32:
        raise ValueError(
            f"linear_block_fp8: a [{n}, {k}] weight in blocks of {block} has float32 scales {blocks}, "
            f"got {scale.dtype} {list(scale.shape)}"
        )
    if block % _BLOCK_N or block % _BLOCK_K:
        raise ValueError(f"linear_block_fp8: scale blocks must be multiples of {_BLOCK_N}, got {block}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
        _block_fp8_linear_kernel[grid](
            x, weight.view(torch.uint8), scale, bias if bias is not None else x, out, rows, n, k,
            x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            SCALE_BLOCK=block, HAS_BIAS=bias is not None,
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
            DOT=triton_attention._dot_dtype(x.dtype), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            NATIVE=x.is_cuda and not triton_attention.interpreted() and triton_attention.converts_fp8(x.device),
        )  # fmt: skip
    return out
