"""The C++ CPU RMSNorm kernels against the PyTorch RMSNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


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
