"""The kernels a model's layers run on: chosen once by the model runner (worker/runner/build.py, with the
attention backend) and bound to every layer that has a variant (DecoderForCausalLM.bind_kernels)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class LayerKernels:
    # The C++ CPU kernels (kernels/cpu_kernels.py: RMSNorm, RoPE, the SwiGLU gate, the few-rows and
    # quantized projections), or None for PyTorch.
    cpu: ModuleType | None = None
    # The fused Triton layer kernels (kernels/triton_layers.py), for an attention backend that reads a
    # step's K/V from the cache, or None.
    triton: ModuleType | None = None
    # EngineConfig.deterministic: the projections on kernels whose sums do not depend on the number of rows
    # (worker/layers/linear.py); the other layers work row by row.
    deterministic: bool = False


PYTORCH = LayerKernels()
