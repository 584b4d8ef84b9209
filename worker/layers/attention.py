"""The attention layer: writes this step's K/V into the paged cache, then attends over the cache."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels.attention import AttentionMetadata, DecodeKernel, paged_attention, store_kvcache


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Bound by the model runner once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.decode_kernel: DecodeKernel | None = None  # set by the model runner (e.g. the C++ CPU kernel)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, D]; k, v: [T, kv_heads, D]. Returns [T, heads * D]."""
        if self.k_cache.numel():  # no cache yet while the runner measures the activation peak
            store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.decode_kernel)
        return out.flatten(1)
