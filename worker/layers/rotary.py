"""Rotary position embedding (RoPE), rotate-half convention as in Llama/Qwen checkpoints.

The cos/sin rows for a step's positions are looked up once per forward and shared by all layers; q and k
heads are rotated together in one pass.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, dtype: torch.dtype) -> None:
        """The table is computed in fp32 and stored in the model's `dtype`, as transformers rounds cos and
        sin to the activations' dtype before rotating: q and k then stay in that dtype."""
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: fold the sign into the table.
        table = torch.cat([cos, cos, -sin, sin], dim=-1).to(dtype)
        self.register_buffer("table", table, persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each a contiguous [T, 1, head_dim], for the step's positions."""
        cos, sin = self.table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos.contiguous(), sin.contiguous()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (q and k heads may be stacked) into a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    swapped = torch.cat((x2, x1), dim=-1)
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, swapped, sin)
    # 16-bit: transformers rounds both products to the dtype before adding them (addcmul rounds once).
    return (x * cos).add_(swapped.mul_(sin))
