"""Qwen3.5's image input (transformers' Qwen3_5ForConditionalGeneration): a ViT tower over an image's
patches and the hybrid language model that reads its output in place of the prompt's image placeholders.

The tower (transformers' Qwen3_5VisionModel) embeds each patch (a 3-D convolution whose stride is its
kernel: one matmul over the flattened patch), adds a learned position table resampled bilinearly (corners
aligned) from its square grid to the image's grid, runs pre-norm blocks whose attention stays within the
image and turns q and k by a 2-D rotary position (the patch's row on the first half of each head's
frequencies, its column on the second), and merges each 2x2 block of patches into one token of the
language model's width (LayerNorm, then a GELU MLP over the four patches side by side). Patches arrive
ordered block by block (common/images.py), so a block's four are consecutive rows.

The tower is not sharded: rank 0 holds it whole and runs it, and sends the other tensor-parallel ranks, which
hold no tower, its output (worker/runner/images.py says why).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.common.errors import UnsupportedModelError
from nanovllm.kernels.attention import AttentionBackend
from nanovllm.worker.layers.kernels import LayerKernels
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import QuantPlan
from nanovllm.worker.layers.rotary import MultimodalRotaryEmbedding
from nanovllm.worker.model_config import ModelConfig, VisionSpec
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM

LAYER_NORM_EPS = 1e-6


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]
    ) -> torch.Tensor:
        """x [patches, hidden] of the images in `lengths` (patches each), each attending within itself."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        cos, sin = rope
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        begin = 0
        for length in lengths:
            rows = slice(begin, begin + length)
            # [1, heads, patches, head_dim] each: with a batch dimension PyTorch's CPU SDPA takes its flash
            # kernel; 3-D inputs take the unfused math path (docs/performance.md#qwen35-vision-tower)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            )[0].transpose(0, 1)
            begin += length
        return self.proj(out.reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 (transformers' vision path), back in x's dtype; cos, sin [patches, head_dim]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        # The C++ CPU kernels (LayerKernels.cpu), bound with the model's, or None for PyTorch.
        self.kernels: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        h = F.gelu(h, approximate="tanh") if self.kernels is None else self.kernels.gelu_tanh(h)
        return self.linear_fc2(h)


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        merged = spec.hidden_size * spec.spatial_merge_size**2
        self.norm = nn.LayerNorm(spec.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, spec.out_hidden_size)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d weight [hidden, channels, temporal, patch, patch] applied as one matmul to
    the flattened patches (its stride is its kernel: every output reads one whole patch)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.proj = nn.Module()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj.weight = nn.Parameter(torch.empty(spec.hidden_size, spec.in_channels, *kernel))
        self.proj.bias = nn.Parameter(torch.empty(spec.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        assert isinstance(weight, torch.Tensor) and isinstance(self.proj.bias, torch.Tensor)  # bare Module's
        return F.linear(pixels, weight.view(weight.shape[0], -1), self.proj.bias)


class VisionTower(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        head_dim = spec.hidden_size // spec.num_heads
        quarter = head_dim // 4  # frequencies per axis: a head's half is rows' then columns'
        inv_freq = 1.0 / (
            spec.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter))
        )
        self.inv_freq: torch.Tensor  # a registered buffer
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)

    def forward(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [patches, channels x temporal x patch x patch] (ordered as common/images.py
        cuts them) -> its tokens [patches / merge^2, the language model's hidden size]."""
        t, h, w = grid_thw
        rows, cols = self._patch_coordinates(h, w)
        x = self.patch_embed(pixels.to(self.pos_embed.weight.dtype))
        x = x + self._positions(rows, cols, h, w).repeat(t, 1).to(x.dtype)
        freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1).repeat(t, 1)
        emb = torch.cat([freqs, freqs], dim=-1)
        rope = (emb.cos(), emb.sin())
        lengths = [h * w] * t
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.merger(x)

    def _patch_coordinates(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) in the image's grid, in merge-block order (fp32)."""
        m = self.spec.spatial_merge_size
        device = self.inv_freq.device
        grid_rows = torch.arange(h, device=device, dtype=torch.float32)[:, None].expand(h, w)
        grid_cols = torch.arange(w, device=device, dtype=torch.float32)[None, :].expand(h, w)

        def blocked(grid: torch.Tensor) -> torch.Tensor:
            return grid.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)

        return blocked(grid_rows), blocked(grid_cols)

    def _positions(self, rows: torch.Tensor, cols: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The learned square position table resampled bilinearly (corners aligned) to h x w, at each
        patch's (row, column)."""
        side = math.isqrt(self.spec.num_position_embeddings)
        table = self.pos_embed.weight
        ys = rows * (side - 1) / max(h - 1, 1)
        xs = cols * (side - 1) / max(w - 1, 1)
        y0, x0 = ys.floor(), xs.floor()
        dy, dx = ys - y0, xs - x0
        y0i, x0i = y0.long(), x0.long()
        y1i, x1i = (y0i + 1).clamp(max=side - 1), (x0i + 1).clamp(max=side - 1)
        taps = [
            (y0i * side + x0i, (1 - dy) * (1 - dx)),
            (y0i * side + x1i, (1 - dy) * dx),
            (y1i * side + x0i, dy * (1 - dx)),
            (y1i * side + x1i, dy * dx),
        ]
        out = torch.zeros(rows.shape[0], table.shape[1], dtype=torch.float32, device=table.device)
        for index, weight in taps:
            out += table.index_select(0, index).float() * weight[:, None]
        return out


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The hybrid language model with the vision tower (`visual`) and multimodal RoPE. The runner encodes
    images (`encode_image`) and passes the step's image rows with their tokens' embeddings and their 3-D
    positions (worker/runner/images.py); a step of text alone runs as Qwen3_5ForCausalLM's."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None = None) -> None:
        super().__init__(cfg, tp, quant)
        vision, hybrid = cfg.vision, cfg.hybrid
        if vision is None or hybrid is None:
            raise UnsupportedModelError(f"{cfg.architecture}: a vision model needs a vision_config")
        if vision.out_hidden_size != cfg.hidden_size:
            raise UnsupportedModelError(
                f"vision_config.out_hidden_size={vision.out_hidden_size} differs from the language model's "
                f"hidden_size={cfg.hidden_size}"
            )
        self.visual = VisionTower(vision) if tp.rank == 0 else None
        self.model.rotary = MultimodalRotaryEmbedding(
            hybrid.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, torch.get_default_dtype(),
            hybrid.mrope_section, cfg.rope_scaling,
        )  # fmt: skip

    def checkpoint_name(self, name: str) -> str | None:
        """The tower's tensors under `visual.`, the language model's as Qwen3_5ForCausalLM names them."""
        if name.startswith("model.visual."):
            return name.removeprefix("model.") if self.visual is not None else None
        return super().checkpoint_name(name)

    def bind_kernels(self, attention: AttentionBackend, kernels: LayerKernels) -> None:
        """The language model's kernels, and the tower's MLP activation on the C++ CPU kernels where bound."""
        super().bind_kernels(attention, kernels)
        if self.visual is not None:
            for module in self.visual.modules():
                if isinstance(module, VisionMLP):
                    module.kernels = kernels.cpu

    def encode_image(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's tokens as the language model embeds them [tokens, hidden] (rank 0's: the tower)."""
        if self.visual is None:
            raise RuntimeError("the vision tower is rank 0's: another tensor-parallel rank encodes no image")
        return self.visual(pixels, grid_thw)
