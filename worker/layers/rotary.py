"""Rotary position embedding (RoPE), rotate-half convention as in Llama/Qwen checkpoints, with the linear
and YaRN scalings of long-context checkpoints.

The cos/sin rows for a step's positions are looked up once per forward and shared by all layers; q and k
heads are rotated together in one pass. A scaling changes only the table (its frequencies, and for YaRN
a factor on cos and sin), so every kernel that rotates from the table takes it unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nanovllm.worker.model_config import RopeScaling


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(head_dim: int, base: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are interpolated
    (their frequency divided by the factor), those that turn more than beta_fast times keep theirs, with a
    linear ramp between; cos and sin are scaled by the attention factor. The arithmetic is transformers'
    (`_compute_yarn_parameters`), op for op in fp32, so the table is the same bit for bit."""
    factor = scaling.factor
    original = scaling.original_max_position_embeddings  # always set for yarn (RopeScaling.from_hf_dict)
    assert original is not None

    def dimension_of(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(scaling.beta_fast or 32), dimension_of(scaling.beta_slow or 1)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each dimension's own frequency
    wavelengths = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    return inv_freq, float(attention)


def rope_frequencies(head_dim: int, base: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] (fp32) and the factor on cos and sin."""
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn_frequencies(head_dim, base, scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:  # linear: positions divided by the factor, folded into the frequencies
        inv_freq /= scaling.factor
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        dtype: torch.dtype,
        scaling: RopeScaling | None = None,
    ) -> None:
        """The table is computed in fp32 and stored in the model's `dtype`, as transformers rounds cos and
        sin to the activations' dtype before rotating: q and k then stay in that dtype."""
        super().__init__()
        inv_freq, attention = rope_frequencies(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        # rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: fold the sign into the table.
        table = torch.cat([cos, cos, -sin, sin], dim=-1).to(dtype)
        self.table: torch.Tensor  # a registered buffer
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


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """Qwen3.5's multimodal RoPE (M-RoPE): each token has a temporal, a height and a width position, and
    each frequency turns by one of them (`axis_of_frequencies`). Text tokens have three equal positions,
    which is plain RoPE: a step of text only passes one position a token and looks up as RotaryEmbedding
    does; a step with image tokens passes [3, T] positions."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        dtype: torch.dtype,
        mrope_section: tuple[int, int, int],
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__(head_dim, max_position, base, dtype, scaling)
        axis = axis_of_frequencies(head_dim // 2, mrope_section)
        # The table's row is [cos | cos | -sin | sin], each part a frequency apiece.
        self.axis: torch.Tensor  # a registered buffer: [1, 2 * head_dim] axis of each table column
        self.register_buffer("axis", axis.repeat(4).unsqueeze(0), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions)
        # [3, T, columns]: each axis's rows, then each column from its axis's
        rows = self.table.index_select(0, positions.reshape(-1)).view(3, positions.shape[1], -1)
        picked = rows.gather(0, self.axis.expand(positions.shape[1], -1).unsqueeze(0)).squeeze(0)
        cos, sin = picked.unsqueeze(1).chunk(2, dim=-1)
        return cos.contiguous(), sin.contiguous()


def axis_of_frequencies(num_frequencies: int, mrope_section: tuple[int, int, int]) -> torch.Tensor:
    """Which position (0 temporal, 1 height, 2 width) turns each frequency: interleaved, height at
    i % 3 == 1 and width at i % 3 == 2 within 3 x their section, temporal elsewhere."""
    axis = torch.zeros(num_frequencies, dtype=torch.long)
    for index in range(num_frequencies):
        for which in (1, 2):
            if index % 3 == which and index < 3 * mrope_section[which]:
                axis[index] = which
    return axis
