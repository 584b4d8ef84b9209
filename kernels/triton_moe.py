"""Mixture-of-experts on the Triton path: each expert's two projections as one grouped matmul over its
tokens, with no host synchronisation (so a decode step stays capturable in a CUDA graph).

A step's (token, slot) pairs are sorted by expert on the device and each expert's group padded to whole
BLOCK_M tiles (`align_pairs`, vLLM's fused-MoE layout). One program computes a [BLOCK_M, BLOCK_N] tile of
one expert's rows; the grid is sized for the worst case (every expert's last tile partial), so the host
never reads the counts, and the tiles past the last expert's return at once. An expert no token chose is
never read.

Rounding follows worker/layers/moe.py's PyTorch path (transformers' Qwen3MoeSparseMoeBlock): each
projection's output rounds to the dtype, the down projection's output is multiplied by the routing
weight and rounded, and a token's expert outputs are added in ascending expert order, rounding after
each add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import triton_attention
from nanovllm.kernels.triton_layers import _cast, silu_and_mul

_BLOCK_N, _BLOCK_K = 64, 64


def _block_m(pairs: int, num_experts: int) -> int:
    """Rows per tile: small tiles when experts get few tokens each (decode), so padding costs little."""
    return 16 if pairs <= 16 * num_experts else 64


def align_pairs(chosen: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From chosen [T, k] expert ids: (sorted_pairs, tile_expert).

    sorted_pairs [max_tiles * block_m]: pair ids (token * k + slot) grouped by expert in ascending order,
    pairs in order within a group, each group padded with T * k (no pair) to a multiple of block_m.
    tile_expert [max_tiles]: the expert of each tile, num_experts past the last. max_tiles = ceil(T k /
    block_m) + num_experts bounds the tiles any routing needs, so nothing here waits on the device."""
    flat = chosen.flatten()
    pairs = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read the maximum on the host
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    group_start = counts.cumsum(0) - counts
    expert_of = flat[order]
    rank = torch.arange(pairs, device=flat.device) - group_start[expert_of]
    dest = (tile_end - tiles)[expert_of] * block_m + rank
    max_tiles = triton.cdiv(pairs, block_m) + num_experts
    sorted_pairs = torch.full((max_tiles * block_m,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[dest] = order
    tile_expert = torch.bucketize(torch.arange(max_tiles, device=flat.device), tile_end, right=True)
    return sorted_pairs, tile_expert


@triton.jit
def _expert_matmul_kernel(
    a, weight, out, sorted_pairs, tile_expert, route_weights, num_pairs, num_experts, n, k,
    stride_a, stride_we, stride_wn, stride_o,
    ROW_DIV: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One tile: out[pair] = a[pair // ROW_DIV] @ weight[expert].T (times route_weights[pair] if WEIGHTED)
    for the tile's pairs, columns [pid1 BLOCK_N, +BLOCK_N)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // ROW_DIV
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w = weight + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        x = tl.load(
            a + rows[:, None] * stride_a + kk[None, :], mask=valid[:, None] & (kk[None, :] < k), other=0.0
        )
        b = tl.load(w + cols[None, :] * stride_wn + kk[:, None], mask=(cols[None, :] < n) & (kk[:, None] < k),
                    other=0.0)  # fmt: skip
        acc += triton_attention.dot(x.to(DOT), b.to(DOT), PRECISION)
    dtype = out.dtype.element_ty
    y = _cast(acc, dtype)
    if WEIGHTED:
        scale = tl.load(route_weights + pairs, mask=valid, other=0.0).to(tl.float32)
        y = _cast(y.to(tl.float32) * scale[:, None], dtype)
    tl.store(out + pairs[:, None] * stride_o + cols[None, :], y, mask=valid[:, None] & (cols[None, :] < n))


def _expert_matmul(
    a: torch.Tensor,
    weight: torch.Tensor,
    sorted_pairs: torch.Tensor,
    tile_expert: torch.Tensor,
    num_pairs: int,
    row_div: int,
    block_m: int,
    route_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    experts, n, k = weight.shape
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (tile_expert.numel(), triton.cdiv(n, _BLOCK_N))
    _expert_matmul_kernel[grid](
        a, weight, out, sorted_pairs, tile_expert, route_weights if route_weights is not None else a,
        num_pairs, experts, n, k, a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        ROW_DIV=row_div, WEIGHTED=route_weights is not None, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        DOT=triton_attention._dot_dtype(a.dtype), PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


@triton.jit
def _sum_slots_kernel(y, out, n, TOP_K: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    """out[t] = y[t k] + y[t k + 1] + ... in slot order, rounded to the dtype after each add."""
    t, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out.dtype.element_ty
    acc = tl.load(y + t * TOP_K * n + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(y + (t * TOP_K + j) * n + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND:
            acc = _cast(acc, dtype).to(tl.float32)
    tl.store(out + t * n + cols, acc.to(dtype), mask=mask)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, chosen: torch.Tensor, route_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output for x [T, H]: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], chosen
    [T, k] expert ids and route_weights [T, k] in x's dtype (worker/layers/moe.py's routing)."""
    tokens, top_k = chosen.shape
    hidden = x.shape[1]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    # A token's slots in ascending expert order: the order its outputs are added in.
    chosen, perm = chosen.sort(dim=-1)
    route_weights = route_weights.gather(1, perm).flatten()
    num_pairs, num_experts = tokens * top_k, w13.shape[0]
    block_m = _block_m(num_pairs, num_experts)
    sorted_pairs, tile_expert = align_pairs(chosen, num_experts, block_m)
    gate_up = _expert_matmul(x, w13, sorted_pairs, tile_expert, num_pairs, top_k, block_m)
    y = _expert_matmul(
        silu_and_mul(gate_up), w2, sorted_pairs, tile_expert, num_pairs, 1, block_m, route_weights
    )
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, block))](
        y, out, hidden, TOP_K=top_k, BLOCK=block, ROUND=x.dtype != torch.float32
    )
    return out
