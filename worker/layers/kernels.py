"""The kernels a model's layers run on: chosen once by the model runner (worker/runner/build.py, with the
attention backend) and bound to every layer that has a variant (DecoderForCausalLM.bind_kernels)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch


class GatedDeltaKernels(Protocol):
    """A hybrid model's causal convolution and gated delta rule on its state rows, in place: a decode step's
    B sequences of one token each (`slots` their rows), or one sequence's prompt chunk token by token
    through the same arithmetic (`slot` its row), and the gates (g, beta) of a step's tokens. The C++ CPU
    kernels (kernels/csrc/gated_delta_cpu.cpp) and kernels/triton_gated_delta.py export these five calls.
    The rule's output is float32, or written into `out` (contiguous [rows, heads, dv], its values rounded to
    its dtype): on a GPU the copy a caller would make is a kernel launch of its own."""

    def delta_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> Sequence[torch.Tensor]: ...

    def causal_conv_decode_(
        self, x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor: ...

    def gated_delta_decode_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def causal_conv_chunk_(
        self, x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, slot: int
    ) -> torch.Tensor: ...

    def gated_delta_chunk_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slot: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class GatedDeltaPrompts(Protocol):
    """Prompt chunks of several sequences through a chunked form of the rule in one call (fla-core's on
    CUDA: kernels/fla_gated_delta.py), each from and into its state row: the rows of q, k, v, g and beta are
    the sequences' `lengths` tokens one after another, `slots` their rows of `state`."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: list[int],
        lengths: list[int],
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayerKernels:
    # The C++ CPU kernels (kernels/cpu_kernels.py: RMSNorm, RoPE, the SwiGLU gate, the few-rows and
    # quantized projections), or None for PyTorch.
    cpu: ModuleType | None = None
    # The fused Triton layer kernels (kernels/triton_layers.py), for an attention backend that reads a
    # step's K/V from the cache, or None.
    triton: ModuleType | None = None
    # The block-FP8 projection (kernels/triton_block_fp8.py), bound with the Triton attention backend: a
    # BlockFp8Weight's bytes read as they are; without it they are dequantized per call.
    block_fp8: ModuleType | None = None
    # EngineConfig.deterministic: the projections on kernels whose sums do not depend on the number of rows
    # (worker/layers/linear.py); the other layers work row by row.
    deterministic: bool = False
    # EngineConfig.exact_quantized_matmuls: packed weights meet x in its dtype, not x quantized to int8 for the
    # C++ kernel's integer dots.
    exact_quantized: bool = False
    # A hybrid model's linear-attention state work: the C++ CPU kernels, the Triton ones with the Triton
    # attention backend, or None for PyTorch (worker/models/qwen3_5.py's GatedDeltaNet).
    gated_delta: GatedDeltaKernels | None = None
    # Where set, a hybrid model's prompt chunks go through it, the step's sequences together, rather than
    # token by token through `gated_delta` (decode steps and verifications stay there).
    gated_delta_prompts: GatedDeltaPrompts | None = None


PYTORCH = LayerKernels()
