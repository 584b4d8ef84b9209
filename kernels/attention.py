"""Paged-KV attention: the step's metadata, and the PyTorch reference backend that kernel backends
(kernels/backends.py) override op by op.

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's tokens live in
the blocks its block table lists, token i at slot block_table[i // block_size] * block_size + i % block_size.

A step's flat token batch is laid out in three segments, each attended in one batched call:
  decodes   one token per row, attending to the cache up to its own position (a decoding sequence's new
            token, or one token of a speculative verification, whose rows share a block table);
  fresh     whole prompts or first chunks (position 0 onwards): they attend only to their own new K/V,
            so the reference reads no cache, just applies causality;
  cached    chunks that continue a sequence (chunked prefill, prefix-cache hit): they read earlier K/V
            from the cache.
The metadata holds what every backend needs; what only the PyTorch reference needs (padding indices,
masks) is derived on first use, once per step, since every layer shares the step's metadata.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_kv import KVScales, dequantize, fake_quantize, is_fp8, quantize


@dataclass
class DecodeBatch:
    block_tables: torch.Tensor  # [num_seqs, max_blocks] long
    context_lens: torch.Tensor  # [num_seqs] long: tokens each query attends to, itself included
    block_size: int

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[num_seqs, 1, 1, max_blocks * block_size] bool, True = attend."""
        width = self.block_tables.shape[1] * self.block_size
        positions = torch.arange(width, device=self.context_lens.device)
        return (positions < self.context_lens[:, None])[:, None, None, :]

    @functools.cached_property
    def one_token_chunks(self) -> ChunkBatch:
        """The same queries as chunks of one token each (how batch-invariant Triton attention runs them)."""
        num_seqs = self.context_lens.shape[0]
        return ChunkBatch(
            query_start_loc=torch.arange(num_seqs + 1, device=self.context_lens.device),
            start_positions=self.context_lens - 1,
            block_tables=self.block_tables,
            max_query_len=1,
            num_tokens=num_seqs,
            block_size=self.block_size,
        )


@dataclass
class ChunkBatch:
    """Chunks of several sequences laid back to back: chunk i is the query_start_loc[i + 1] -
    query_start_loc[i] tokens from position start_positions[i] of its sequence."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] long, cumulative
    start_positions: torch.Tensor  # [num_seqs] long
    block_tables: torch.Tensor  # [num_seqs, max_blocks] long: the blocks up to each chunk's end
    max_query_len: int
    num_tokens: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.start_positions.shape[0]

    @functools.cached_property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @functools.cached_property
    def per_token(self) -> DecodeBatch:
        """Every token as a decode query of its own over its sequence's cache up to itself (how
        batch-invariant CPU attention runs chunks)."""
        lens = self.query_lens
        seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=lens.device), lens)
        offset = torch.arange(self.num_tokens, device=lens.device) - self.query_start_loc[:-1][seq]
        return DecodeBatch(
            block_tables=self.block_tables.index_select(0, seq),
            context_lens=self.start_positions[seq] + offset + 1,
            block_size=self.block_size,
        )

    @functools.cached_property
    def token_index(self) -> torch.Tensor:
        """Each flat token's row in the [num_seqs * max_query_len] padded layout."""
        rows = torch.arange(self.max_query_len, device=self.query_lens.device) < self.query_lens[:, None]
        return rows.flatten().nonzero().squeeze(1)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[num_seqs, 1, max_query_len, max_blocks * block_size] bool over the cached context, causal."""
        dev = self.start_positions.device
        q_pos = self.start_positions[:, None] + torch.arange(self.max_query_len, device=dev)
        k_pos = torch.arange(self.block_tables.shape[1] * self.block_size, device=dev)
        ends = self.start_positions + self.query_lens
        # Padded query rows (past a chunk's end) still see valid keys, so no row is fully masked.
        return ((k_pos <= q_pos[:, :, None]) & (k_pos < ends[:, None, None]))[:, None]


@dataclass
class StateBatch:
    """A hybrid model's per-request state for one step (worker/models/qwen3_5.py): each sequence's slot
    in the linear-attention layers' state tensors and its token count, in the step's layout order (the
    first `num_decodes` run one token each), and the slots of the sequences that start from the zero state
    this step (their first token is at position 0), the prefix-cache hits' snapshots to resume from, and
    the copies of the state to make at block boundaries (worker/core/block_manager.py) and after a
    verification's tokens (worker/core/recurrent_states.py)."""

    slots: torch.Tensor  # [num_seqs] long, on the device
    slot_list: list[int]
    num_tokens: list[int]
    num_decodes: int
    fresh_slots: torch.Tensor | None  # long, on the device; None when no sequence starts here
    # (snapshot row, slot): a prefix-cache hit's state copied into its sequence's slot before the step.
    restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Per sequence, (tokens into its chunk, snapshot row): the state after those tokens copied to the row.
    saves: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    # Sequences after the decodes that verify speculative proposals: their tokens run one at a time, as
    # decode steps would run them.
    num_verifies: int = 0

    @property
    def prepares(self) -> bool:
        """Whether a state starts or resumes here (work before the step's layers)."""
        return self.fresh_slots is not None or bool(self.restores)

    @property
    def keeps_decode_states(self) -> bool:
        """Whether a decode row's state is copied after its token."""
        return any(self.saves[: self.num_decodes])


@dataclass
class AttentionMetadata:
    """How one step's tokens map onto sequences and cache slots; built once per step by the model
    runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V is written
    decode: DecodeBatch | None = None
    fresh: ChunkBatch | None = None
    cached: ChunkBatch | None = None
    states: StateBatch | None = None  # hybrid models only

    def segments(self) -> list[tuple[str, int, int]]:
        """(kind, first token, end token) of each present segment, in layout order."""
        spans, begin = [], 0
        if self.decode is not None:
            spans.append(("decode", begin, begin + self.decode.context_lens.shape[0]))
            begin = spans[-1][2]
        for kind, batch in (("fresh", self.fresh), ("cached", self.cached)):
            if batch is not None:
                spans.append((kind, begin, begin + batch.num_tokens))
                begin = spans[-1][2]
        return spans


def _gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, kv_heads, max_blocks * block_size, head_dim] in `dtype` (a strided
    view of the gathered blocks; dequantized with the heads' `scale` from an FP8 cache)."""
    if is_fp8(cache.dtype):  # index_select has no FP8 kernels: gather the bytes
        blocks = cache.view(torch.uint8).index_select(0, block_tables.flatten()).view(cache.dtype)
    else:
        blocks = cache.index_select(0, block_tables.flatten())
    blocks = blocks.view(block_tables.shape[0], -1, cache.shape[2], cache.shape[3]).transpose(1, 2)
    return blocks if scale is None else dequantize(blocks, scale, dtype, heads_axis=1)


def _gather_pair(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_scales: KVScales | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales.key, kv_scales.value)
    return _gather_kv(k_cache, block_tables, k_scale, dtype), _gather_kv(
        v_cache, block_tables, v_scale, dtype
    )


def _pad(x: torch.Tensor, batch: ChunkBatch) -> torch.Tensor:
    """[T, heads, D] -> [num_seqs, heads, max_query_len, D], zero rows where a chunk is shorter."""
    padded = x.new_zeros(batch.num_seqs * batch.max_query_len, *x.shape[1:])
    padded.index_copy_(0, batch.token_index, x)
    return padded.view(batch.num_seqs, batch.max_query_len, *x.shape[1:]).transpose(1, 2)


def _unpad(out: torch.Tensor, batch: ChunkBatch) -> torch.Tensor:
    flat = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_query_len, *out.shape[1:2], out.shape[3])
    return flat.index_select(0, batch.token_index)


class AttentionBackend:
    """The PyTorch reference for every op; a kernel backend overrides the ops it has kernels for.
    query [T, heads, D]; key, value [T, kv_heads, D]; caches as in the module docstring."""

    name = "torch"

    def store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None:
        """Write new tokens' K/V into their cache slots (quantized with `kv_scales` into an FP8 cache)."""
        if kv_scales is not None:
            key, value = (
                quantize(key, kv_scales.key, k_cache.dtype),
                quantize(value, kv_scales.value, v_cache.dtype),
            )
            key, value, k_cache, v_cache = (x.view(torch.uint8) for x in (key, value, k_cache, v_cache))
        k_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """One query per sequence over its cached context (gather, then SDPA)."""
        k, v = _gather_pair(k_cache, v_cache, batch.block_tables, kv_scales, query.dtype)
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2), k, v, attn_mask=batch.mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    def fresh(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ChunkBatch,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Causal attention of each prompt over its own new K/V (as an FP8 cache holds them: a prompt sees
        what its later tokens and a prefix-cache hit on it will read).

        Several prompts go through one SDPA call, padded to the longest. One call per prompt computes less
        and is faster on one thread, but on 2 threads its thousands of small parallel regions a step made
        W64's prefill several times slower (docs/performance.md#measurements-behind-choices-in-the-code): each region waits for both threads, and
        any other load on the machine stretches every wait. key and value are None only for a backend that
        reads them from the cache (forward)."""
        assert key is not None and value is not None
        if kv_scales is not None:
            key, value = (
                fake_quantize(key, kv_scales.key, k_cache.dtype),
                fake_quantize(value, kv_scales.value, v_cache.dtype),
            )
        if batch.num_seqs == 1:
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        q, k, v = (_pad(x, batch) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return _unpad(o, batch)

    def cached(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ChunkBatch,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Chunks continuing a sequence, over its cached K/V (their own already stored)."""
        k, v = _gather_pair(k_cache, v_cache, batch.block_tables, kv_scales, query.dtype)
        o = F.scaled_dot_product_attention(
            _pad(query, batch), k, v, attn_mask=batch.mask, scale=scale, enable_gqa=True
        )
        return _unpad(o, batch)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Causal attention for a step's queries; this step's K/V are already in the cache. key and value
        may be None where the backend's fresh() reads them from the cache too (TritonAttention).
        kv_scales: an FP8 cache's (kernels/fp8_kv.py), None for a cache in the model's dtype."""
        spans = meta.segments()
        out = None if len(spans) == 1 else torch.empty_like(query)
        for kind, begin, end in spans:
            q = query[begin:end]
            # segments() lists only the batches that are present
            if kind == "decode":
                assert meta.decode is not None
                o = self.decode(q, k_cache, v_cache, meta.decode, scale, kv_scales)
            elif kind == "fresh":
                assert meta.fresh is not None
                k, v = (None, None) if key is None or value is None else (key[begin:end], value[begin:end])
                o = self.fresh(q, k, v, k_cache, v_cache, meta.fresh, scale, kv_scales)
            else:
                assert meta.cached is not None
                o = self.cached(q, k_cache, v_cache, meta.cached, scale, kv_scales)
            if out is None:
                return o  # a one-segment step: nothing to place
            out[begin:end] = o
        assert out is not None  # more than one segment
        return out
