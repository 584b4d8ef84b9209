"""LoRA on the linear layers: y = x W^T + (x A^T) (s B)^T, each row with the adapter of its request.

A model serving adapters holds `num_slots` of them at once. Each adapted projection keeps every slot's A
and B, ranks padded with zeros to `max_rank` and the scale s folded into B when the slot is filled. A fused
projection (q/k/v, gate/up) has one A and one B per part: the parts' A are stacked ([parts * rank, in]),
and each part's B covers that part's output features ([out, rank]). Per part a slot costs a shrink x A^T and
an expand (x A^T) B^T (S-LoRA's and punica's two steps).

A step groups its rows by slot (LoRABatch), and each projection adds every group's share in one of four
ways: on a CPU one C++ call for all groups (kernels/csrc/lora_cpu.cpp); on the Triton path two kernels
over every adapted row (kernels/triton_layers.py, punica's BGMV; no host synchronisation); both sum each
row on its own (batch-invariant). Without either, PyTorch: for a single group or in a batch-invariant
layer the layer's own matmuls group by group; for several groups batched matmuls over the groups padded
to the largest one (so the number of calls does not grow with the number of adapters), the padding rows
masked out before they are added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.worker.layers.kernels import LayerKernels


@dataclass
class LoRABatch:
    """A step's rows that run an adapter, grouped by slot (ascending). `groups`: (slot, its rows), rows
    None where one slot has every row of the step; `rows` [R], `starts` [G + 1] and `slots` [G] lay the
    same groups out flat (group g is rows[starts[g]:starts[g + 1]]), on the host, and `device_rows` [R]
    with each one's slot, `row_slots` [R], on the device. With several groups also
    `padded_rows` [G * m] (each group's rows repeated up to the largest group's m), `mask` [G, m, 1] (1 for
    a real row) and `slot_index` ([G] on the device; None when the groups are every slot in order)."""

    groups: list[tuple[int, torch.Tensor | None]]
    rows: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    device_rows: torch.Tensor
    row_slots: torch.Tensor
    padded_rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    slot_index: torch.Tensor | None = None

    @classmethod
    def every_row(cls, row_slots: torch.Tensor) -> LoRABatch:
        """Every row of a step with its slot, negative for a row without an adapter, all on the device: the
        batch of a captured decode graph, whose launches must not depend on which rows have adapters. Only
        the Triton kernels take it (they skip the negative rows); it has no host-side groups."""
        rows = torch.arange(row_slots.shape[0], device=row_slots.device)
        empty = torch.zeros(0, dtype=torch.long)
        return cls([], empty, torch.zeros(1, dtype=torch.long), empty, rows, row_slots)


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

    lora_a: torch.Tensor  # registered buffers
    lora_b: torch.Tensor

    def __init__(self, context: LoRAContext, in_features: int, parts: list[Part]) -> None:
        super().__init__()
        self.context = context
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(size for _, _, size in parts)
        self.part_bounds = [offset for _, offset, _ in parts] + [self.out_features]
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
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        kernels: LayerKernels,
    ) -> None:
        """y += each row's adapter applied to x, for the rows of the context's batch. `project(x, w)` is
        the layer's x @ w.T (its kernels, deterministic where the layer's are)."""
        cpu_kernels, triton_kernels = kernels.cpu, kernels.triton
        batch = self.context.batch
        if batch is None:
            return
        every_row = not batch.groups  # LoRABatch.every_row, in a captured decode graph
        if every_row and (triton_kernels is None or not y.is_contiguous()):
            raise RuntimeError("a batch of every row (LoRABatch.every_row) runs on the Triton kernels only")
        if cpu_kernels is not None and y.is_contiguous() and not every_row:
            cpu_kernels.lora_add_(
                y, x, self.lora_a, self.lora_b, batch.rows, batch.starts, batch.slots, self.part_bounds
            )
        elif triton_kernels is not None and y.is_contiguous():
            triton_kernels.lora_add_(
                y, x, self.lora_a, self.lora_b, batch.device_rows, batch.row_slots, self.part_bounds
            )
        elif batch.mask is None or kernels.deterministic:
            for slot, rows in batch.groups:
                xs = x if rows is None else x.index_select(0, rows)
                delta = self._expand(project(xs, self.lora_a[slot]), self.lora_b[slot], project)
                if rows is None:
                    y.add_(delta)
                else:
                    y.index_add_(0, rows, delta)
        else:
            groups, m = batch.mask.shape[0], batch.mask.shape[1]
            assert batch.padded_rows is not None  # set with mask
            xs = x.index_select(0, batch.padded_rows).view(groups, m, -1)
            a, b = self.lora_a, self.lora_b
            if batch.slot_index is not None:
                a, b = a.index_select(0, batch.slot_index), b.index_select(0, batch.slot_index)
            delta = self._expand(_bmm(xs, a), b, _bmm)
            y.index_add_(0, batch.padded_rows, delta.mul_(batch.mask).view(groups * m, -1))

    def _expand(
        self,
        shrunk: torch.Tensor,
        b: torch.Tensor,
        matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Each part's ranks of `shrunk` ([..., parts * rank]) times its B ([..., out, rank]) transposed:
        [..., out]. `matmul(x, w)` is x @ w.T over the last two dims."""
        rank = self.context.max_rank
        deltas = [
            matmul(shrunk[..., i * rank : (i + 1) * rank], b[..., offset : offset + size, :])
            for i, (_, offset, size) in enumerate(self.parts)
        ]
        return deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)


def _bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for batches of matrices."""
    return torch.bmm(x, w.transpose(1, 2))
