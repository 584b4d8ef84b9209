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
    # EngineConfig.deterministic: all-reduces sum the ranks' parts in rank order. A ring all-reduce adds
    # them in an order that depends on where an element falls in the ring's chunks, so on the tensor's
    # size, the batch; with two ranks a + b == b + a, so only more ranks need it.
    ordered_sum: bool = False

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's slice of `total`, or a clear error when it does not divide."""
        if total % self.size != 0:
            raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds. With fewer KV heads than ranks, each head is
        replicated on size // total consecutive ranks (as vLLM does), so every rank keeps one."""
        if total >= self.size:
            count = self.shard(total, "num_key_value_heads")
            return self.rank * count, count
        if self.size % total != 0:
            raise ConfigError(
                f"num_key_value_heads={total} cannot be replicated evenly over tensor_parallel_size={self.size}"
            )
        return self.rank // (self.size // total), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 2 and self.ordered_sum:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous())
            for part in parts[1:]:
                parts[0] += part
            return x.copy_(parts[0])
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_min(self, value: int) -> int:
        if self.size == 1:
            return value
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces only CUDA tensors
        x = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return int(x.item())

    def on_any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag set where it is set on some rank (every rank gets the same answer)."""
        if self.size == 1 or not flags:
            return flags
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        x = torch.tensor(flags, dtype=torch.uint8, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return [bool(v) for v in x.tolist()]

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
