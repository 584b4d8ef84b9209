"""What a layer's `weight_loader` reads from a checkpoint (worker/models/loader.py opens the files)."""

from __future__ import annotations

from typing import Protocol

import torch

from nanovllm.worker.layers.quantization import PackedWeight


class LoadableTensor(Protocol):
    """What a weight_loader reads: a checkpoint tensor's shape, all of it, or a slice along one dim."""

    name: str
    shape: torch.Size

    def read(self) -> torch.Tensor | PackedWeight: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | PackedWeight: ...
