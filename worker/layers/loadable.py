"""What a layer's `weight_loader` reads from a checkpoint (worker/models/loader.py opens the files)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from nanovllm.worker.layers.block_fp8 import BlockFp8Weight
from nanovllm.worker.layers.quantization import PackedWeight


class LoadableTensor(Protocol):
    """What a weight_loader reads: a checkpoint tensor's shape, all of it, or a slice along one dim."""

    name: str
    shape: torch.Size

    def read(self) -> torch.Tensor | PackedWeight | BlockFp8Weight: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | PackedWeight | BlockFp8Weight: ...


def set_weight_loader(weight: torch.Tensor | nn.Module, loader: Callable[..., Any]) -> None:
    """Give a parameter (or a packed weight) the `weight_loader` that worker/models/loader.py calls for it:
    an attribute of the object itself, which torch's types do not declare."""
    weight.weight_loader = loader  # type: ignore[union-attr]


def read_float(loaded: LoadableTensor) -> torch.Tensor:
    """All of a checkpoint tensor that is never packed (a norm's weight, a bias)."""
    value = loaded.read()
    assert isinstance(value, torch.Tensor), f"{loaded.name} is packed"
    return value
