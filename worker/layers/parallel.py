"""Tensor-parallel placement of a layer: which rank this is and how many share the layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanovllm.common.errors import ConfigError


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's slice of `total`, or a clear error when it does not divide."""
        if total % self.size != 0:
            raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
