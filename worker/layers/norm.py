"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.common.errors import ConfigError
from nanovllm.worker.layers.kernels import PYTORCH
from nanovllm.worker.layers.loadable import LoadableTensor, read_float, set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        """`weight_offset`: added to the checkpoint's weight as it loads (1 for Qwen3.5's zero-centred
        norms, which apply 1 + w). Such a weight is kept in fp32, and a 16-bit model multiplies by it in
        fp32 and rounds once, as transformers does: 1 + w rounded to bf16 would scale every channel by up
        to 0.4% off."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(_norm_weight((hidden_size,), weight_offset), requires_grad=False)
        if weight_offset:
            set_weight_loader(self.weight, _offset_loader(weight_offset))
        # The C++ CPU kernels or the fused Triton kernels when in use (DecoderForCausalLM.bind_kernels): both
        # have rms_norm and add_rms_norm_.
        self.kernels = PYTORCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.triton is not None:  # a zero-centred norm's float32 weight too
            return self.kernels.triton.rms_norm(x, self.weight, self.eps)
        if self.weight.dtype != x.dtype:  # a zero-centred norm in a 16-bit model
            return _fp32_norm(x, self.weight, self.eps, self.kernels.cpu)
        if self.kernels.cpu is not None:
            return self.kernels.cpu.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # 16-bit, as transformers: normalise in fp32, round to the dtype, then multiply by the weight in
        # the dtype. F.rms_norm given the weight would multiply in fp32 and round once: other numbers.
        return F.rms_norm(x, self.weight.shape, None, self.eps).mul_(self.weight)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual), reusing both buffers: the caller owns them."""
        kernels = self.kernels.triton or self.kernels.cpu
        if kernels is not None:  # both take a zero-centred norm's float32 weight in a 16-bit model
            kernels.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x.add_(residual)
        return self.forward(residual), residual


def _norm_weight(shape: tuple[int, ...], offset: float) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.float32 if offset else None)


def _fp32_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cpu: ModuleType | None) -> torch.Tensor:
    """x normalised and multiplied by the float32 weight in float32, rounded once: on the C++ kernels
    when bound (row by row in a fixed order, whatever the rows beside it)."""
    if cpu is not None:
        return cpu.rms_norm_fp32_weight(x, weight, eps)
    return (F.rms_norm(x.float(), x.shape[-1:], None, eps) * weight).to(x.dtype)


def _offset_loader(offset: float):
    def load(param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        if param.shape != loaded.shape:
            raise ConfigError(
                f"checkpoint tensor {loaded.name} of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
            )
        param.data.copy_(read_float(loaded).float() + offset)  # the sum in fp32, as transformers computes it

    return load


class HeadRMSNorm(nn.Module):
    """Qwen3's per-head RMSNorm of q and k, applied to the stacked [T, q_heads + kv_heads, D] view in one
    pass: the q and k weights are packed into one [heads, D] parameter at load time."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, weight_offset: float = 0.0
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset  # see RMSNorm
        self.num_heads = num_heads
        self.weight = nn.Parameter(
            _norm_weight((num_heads + num_kv_heads, head_dim), weight_offset), requires_grad=False
        )
        set_weight_loader(self.weight, self.weight_loader)
        # The C++ CPU kernels when in use (DecoderForCausalLM.bind_kernels): PyTorch's rms_norm over the
        # heads costs a large MoE model milliseconds a layer (docs/performance.md#measurements-behind-choices-in-the-code).
        self.kernels = PYTORCH

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        rows = slice(0, self.num_heads) if shard_id == "q" else slice(self.num_heads, None)
        param.data[rows] = read_float(loaded).float() + self.weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != x.dtype:  # a zero-centred norm in a 16-bit model (see RMSNorm)
            return _fp32_norm(x, self.weight, self.eps, self.kernels.cpu)
        if self.kernels.cpu is not None:
            return self.kernels.cpu.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, x.shape[-1:], None, self.eps).mul_(self.weight)
