"""The C++ CPU layer kernels (RMSNorm, SwiGLU gate, RoPE) against their PyTorch versions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.worker.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.mark.parametrize("rows, hidden", [(1, 576), (37, 64), (300, 1024)])
def test_rms_norm_matches_torch(kernels, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen) * 3
    w = torch.rand(hidden, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (hidden,), w, 1e-5))


def test_add_rms_norm_updates_both_in_place(kernels):
    gen = torch.Generator().manual_seed(0)
    x, residual, w = torch.randn(9, 128, generator=gen), torch.randn(9, 128, generator=gen), torch.rand(128)
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual, (128,), w, 1e-6)
    kernels.add_rms_norm_(x, residual, w, 1e-6)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(x, expected)


def test_rejects_non_contiguous_input(kernels):
    x = torch.randn(8, 64).t()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels.rms_norm(x, torch.ones(8), 1e-6)


@pytest.mark.parametrize("rows, half", [(1, 1536), (13, 64)])
def test_silu_and_mul_matches_torch(kernels, rows, half):
    x = torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(rows)) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up)


def test_rotary_matches_torch_on_a_strided_view(kernels):
    rotary = RotaryEmbedding(head_dim=64, max_position=512, base=1e6, dtype=torch.float32)
    positions = torch.tensor([0, 1, 7, 300, 511])
    cos, sin = rotary.lookup(positions)
    qkv = torch.randn(5, (8 + 2 + 2) * 64)
    qk = qkv[:, : 10 * 64].view(5, 10, 64)  # q and k heads of a fused projection: rows are strided
    torch.testing.assert_close(kernels.rotary(qk, cos, sin), apply_rotary(qk, cos, sin))
