"""Where a proposer's own pass writes its KV: a sequence's chunk of positions over its block table, and
those positions' cache slots (the draft model and the MTP head share the model's block tables)."""

from __future__ import annotations

from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import SeqChunk


def seq_chunk(seq: Sequence, start: int, num_new_tokens: int, block_size: int) -> SeqChunk:
    end = start + num_new_tokens
    return SeqChunk(start, num_new_tokens, seq.block_table[: -(-end // block_size)])


def chunk_slots(seq: Sequence, chunk: SeqChunk, block_size: int) -> list[int]:
    positions = range(chunk.start, chunk.start + chunk.num_new_tokens)
    return [seq.block_table[p // block_size] * block_size + p % block_size for p in positions]
