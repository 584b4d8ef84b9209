"""The attention layer: writes this step's K/V into the paged cache, then attends over the cache."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels.attention import AttentionBackend, AttentionMetadata
from nanovllm.kernels.fp8_kv import KVScales


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
        # An FP8 cache's scales (kernels/fp8_kv.py), bound with it; None for a cache in the model's dtype.
        self.kv_scales: KVScales | None = None
        # An FP8 checkpoint's per-tensor scales ("key", "value"), when it has them (worker/models/loader.py).
        self.checkpoint_scales: dict[str, float] = {}
        # [2, kv_heads]: the largest |K| and |V| per head, recorded while the runner calibrates the scales.
        self.kv_amax: torch.Tensor | None = None
        # The reference until the model runner binds the configured one (after sizing the KV cache).
        self.backend = AttentionBackend()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, D]; k, v: [T, kv_heads, D]. Returns [T, heads * D]."""
        if self.kv_amax is not None:
            seen = torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]).float()
            torch.maximum(self.kv_amax, seen, out=self.kv_amax)
        if self.k_cache.numel():  # no cache yet while the runner measures the activation peak
            self.backend.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.kv_scales)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
        return out.flatten(1)

    def attend_cached(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention for a step whose K/V a fused kernel already stored (kernels/triton_layers.py); only for
        a backend that reads every segment's K/V from the cache. Returns [T, heads * D]."""
        out = self.backend.forward(
            q, None, None, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales
        )
        return out.flatten(1)
