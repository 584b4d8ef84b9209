"""LoRA on the linear layers: y = x W^T + (x A^T) (s B)^T, each row with the adapter of its request.

A model serving adapters holds `num_slots` of them at once. Each adapted projection keeps every slot's A
and B, ranks padded with zeros to `max_rank` and the scale s folded into B when the slot is filled. A step
groups its rows by slot (LoRABatch) and each group costs two small matmuls per part of a projection
(S-LoRA's shrink and expand), so one step serves the base model and several adapters together. A fused
projection (q/k/v, gate/up) holds one A and one B per part, each part's rows of the output its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRABatch:
    """Which rows of a step's tokens run which slot: (slot, row indices); indices None: every row."""

    groups: list[tuple[int, torch.Tensor | None]]


class LoRAContext:
    """What a model's adapted layers share: the step's LoRABatch (None: no row has an adapter), set by the
    runner before each forward pass."""

    def __init__(self, num_slots: int, max_rank: int) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.batch: LoRABatch | None = None


# One part of a projection's output: (shard id, first output feature, number of them). The shard ids are
# the model's (DecoderForCausalLM.packed_modules_mapping): "q", "k", "v", 0 (gate), 1 (up), None (whole).
Part = tuple[object, int, int]

# (A [rank, in_features], B [features of the part, rank]) of one part, B already scaled.
PartWeights = tuple[torch.Tensor, torch.Tensor]


class LoRAWeights(nn.Module):
    """Every slot's A and B for one projection of `in_features` inputs whose output is cut into `parts`."""

    def __init__(self, context: LoRAContext, in_features: int, parts: list[Part]) -> None:
        super().__init__()
        self.context = context
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(size for _, _, size in parts)
        slots, rank = context.num_slots, context.max_rank
        a = torch.zeros(slots, len(parts) * rank, in_features)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, self.out_features, rank), persistent=False)

    def fill(self, slot: int, weights: dict[object, PartWeights]) -> None:
        """Put an adapter's parts in `slot`; parts it does not adapt are zero there."""
        rank = self.context.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, (shard, offset, size) in enumerate(self.parts):
            if shard not in weights:
                continue
            a, b = weights[shard]
            self.lora_a[slot, i * rank : i * rank + a.shape[0]].copy_(a)
            self.lora_b[slot, offset : offset + size, : b.shape[1]].copy_(b)

    def add_to(
        self, y: torch.Tensor, x: torch.Tensor, project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        """y += each row's adapter applied to x, for the rows of the context's batch. `project(x, w)` is
        the layer's x @ w.T (its kernels, batch-invariant where the layer's are)."""
        batch = self.context.batch
        if batch is None:
            return
        rank = self.context.max_rank
        for slot, rows in batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            a, b = self.lora_a[slot], self.lora_b[slot]
            deltas = [
                project(project(xs, a[i * rank : (i + 1) * rank]), b[offset : offset + size])
                for i, (_, offset, size) in enumerate(self.parts)
            ]
            delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=1)
            if rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows, delta)
