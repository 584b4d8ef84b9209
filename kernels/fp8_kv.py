"""An FP8 KV cache: its formats, how a K/V value becomes a byte and back, and how a scale is chosen.

A cache in fp8 holds value / scale rounded to the format (to nearest, ties to even), clamped to the format's
largest finite value first (e4m3fn has no infinity: anything past 448 would become NaN); attention reads
byte * scale. Scales are per (layer, kv head), float32 and powers of two, so multiplying or dividing by one
is exact: quantizing adds only the format's own rounding, dequantizing adds nothing (an fp8 value times a
power of two is exact in bf16, fp16 and fp32), and every implementation (this PyTorch reference, the C++
and the Triton kernels) stores the same bytes and reads the same values. Why per head and how the scale is
computed: docs/architecture.md#fp8-kv-cache.

Kernels widen a byte without a table: its sign moved to bit 31 and its exponent and mantissa bits to the
top of a float32's exponent field read as a float32 that is the fp8 value times 2**-(127 - bias), subnormals
included; `WIDEN_FACTOR` undoes that factor (and is folded into the scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# --kv-cache-dtype's choices other than "auto" (vLLM's names): "fp8" is e4m3, the finer of the two.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = frozenset(KV_CACHE_DTYPES.values())
# Per format: mantissa bits (the shift that puts a byte's exponent at a float32's bit 23 is 23 - this) and
# the factor that turns the widened float32 into the fp8 value.
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
WIDEN_FACTOR = {torch.float8_e4m3fn: 2.0 ** (127 - 7), torch.float8_e5m2: 2.0 ** (127 - 15)}
# Calibrated scales leave this much room above the largest |K| or |V| seen (8: three binades), so a prompt
# unlike the calibration's rarely reaches the clamp; e4m3 still keeps 11 binades of normal numbers below
# the calibrated maximum, where a value's relative error is at most 2**-4.
HEADROOM = 8.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@dataclass(frozen=True)
class KVScales:
    """One attention layer's scales: stored byte * scale = K or V, per kv head (float32 [kv_heads])."""

    key: torch.Tensor
    value: torch.Tensor


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per head, the least power of two that maps amax * HEADROOM into `dtype`'s range (1 where amax is 0)."""
    bound = torch.finfo(dtype).max
    amax = amax.float().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.ceil(torch.log2(amax * HEADROOM / bound))).clamp(
        min=2.0**-64, max=2.0**32
    )  # within float32 and far from its edges, so scale * WIDEN_FACTOR stays finite


def from_checkpoint(scale: float, num_kv_heads: int) -> torch.Tensor:
    """A checkpoint's per-tensor scale for every head, rounded up to a power of two (the values it was
    chosen for stay in range; quantizing stays exact)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"a KV cache scale must be a positive number, got {scale}")
    return torch.full((num_kv_heads,), 2.0 ** math.ceil(math.log2(scale)))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, kv_heads, D] in any float dtype -> `dtype` bytes of x / scale ([kv_heads] powers of two)."""
    bound = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)[:, None]).clamp(-bound, bound).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, heads_axis: int = 1) -> torch.Tensor:
    """fp8 x with its kv heads along `heads_axis` -> x * scale in `dtype` (exact)."""
    shape = [1] * x.dim()
    shape[heads_axis] = scale.shape[0]
    return (x.float() * scale.view(shape)).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What attention reads back for new K/V [T, kv_heads, D] once stored: for paths that attend over a
    prompt's own K/V without reading the cache."""
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype)
