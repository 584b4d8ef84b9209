"""One forward pass's inputs as plain integers: what the model runner derives from a SchedulerOutput, and
what rank 0 sends to the other tensor-parallel ranks each step (one int64 tensor, no pickling)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqChunk:
    """The tokens [start, start + num_new_tokens) of one sequence, and the cache blocks they attend to."""

    start: int
    num_new_tokens: int
    block_table: list[int]  # the blocks up to this chunk's end


@dataclass
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    # Laid out in this order in the flat token arrays: decodes, then fresh prompts, then continuing chunks.
    decodes: list[SeqChunk]
    fresh: list[SeqChunk]
    cached: list[SeqChunk]
    logits_index: list[int]  # rows of the flat arrays whose logits are computed (sampled or inspected)
    # (row of input_ids, row of the previous step's picks): tokens still on the device, written there
    # before the forward pass (overlapped scheduling); input_ids holds a placeholder at those rows.
    deferred: list[tuple[int, int]] = field(default_factory=list)

    def pack(self) -> torch.Tensor:
        """[counts..., input_ids, positions, slot_mapping, (start, n, len, *table) per chunk, logits_index]"""
        if self.deferred:
            raise RuntimeError("a step whose tokens are still on rank 0's device cannot go to other ranks")
        groups = (self.decodes, self.fresh, self.cached)
        values = [len(self.input_ids), *(len(g) for g in groups), len(self.logits_index)]
        values += self.input_ids + self.positions + self.slot_mapping
        for group in groups:
            for chunk in group:
                values += [chunk.start, chunk.num_new_tokens, len(chunk.block_table), *chunk.block_table]
        values += self.logits_index
        return torch.tensor(values, dtype=torch.long)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> StepInputs:
        values = packed.tolist()
        n, nd, nf, nc, nl = values[:5]
        pos = 5

        def take(count: int) -> list[int]:
            nonlocal pos
            pos += count
            return values[pos - count : pos]

        input_ids, positions, slot_mapping = take(n), take(n), take(n)
        groups = []
        for count in (nd, nf, nc):
            chunks = []
            for _ in range(count):
                start, num_new, table_len = take(3)
                chunks.append(SeqChunk(start, num_new, take(table_len)))
            groups.append(chunks)
        return cls(input_ids, positions, slot_mapping, *groups, logits_index=take(nl))
