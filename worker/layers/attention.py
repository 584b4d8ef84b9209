"""The attention layer: writes this step's K/V into the paged cache, then attends over the cache."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels.attention import AttentionBackend, AttentionMetadata


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
        # The reference until the model runner binds the configured one (after sizing the KV cache).
        self.backend = AttentionBackend()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, D]; k, v: [T, kv_heads, D]. Returns [T, heads * D]."""
        if self.k_cache.numel():  # no cache yet while the runner measures the activation peak
            self.backend.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.flatten(1)

    def attend_cached(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention for a step whose K/V a fused kernel already stored (kernels/triton_layers.py); only for
        a backend that reads every segment's K/V from the cache. Returns [T, heads * D]."""
        return self.backend.forward(q, None, None, self.k_cache, self.v_cache, meta, self.scale).flatten(1)
