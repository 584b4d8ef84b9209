"""Paged-KV attention ops (PyTorch reference implementations; Triton versions will sit behind the same calls).

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's tokens live in
the blocks its block table lists, token i at slot block_table[i // block_size] * block_size + i % block_size.

A step's flat token batch is laid out in three segments, each attended in one batched call:
  decodes   one new token per sequence, attending to everything cached for it;
  fresh     whole prompts or first chunks (position 0 onwards): they attend only to their own new K/V,
            so no cache read is needed, just causality;
  cached    chunks that continue a sequence (chunked prefill, prefix-cache hit): they read earlier K/V
            from the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DecodeBatch:
    block_tables: torch.Tensor  # [num_seqs, max_blocks] long
    context_lens: torch.Tensor  # [num_seqs] long: tokens each query attends to, itself included
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass
class FreshBatch:
    """Variable-length prompts (or first chunks) padded to [num_seqs, max_query_len]; `token_index` maps
    each flat token to its row in the padded layout."""

    num_seqs: int
    max_query_len: int
    token_index: torch.Tensor  # [num_tokens] long

    @property
    def num_tokens(self) -> int:
        return self.token_index.shape[0]


@dataclass
class PrefillBatch(FreshBatch):
    """Chunks that continue a sequence: padded like prompts, and attending to the cache as well."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] long
    mask: torch.Tensor  # [num_seqs, 1, max_query_len, context] bool, True = attend


@dataclass
class AttentionMetadata:
    """How one step's tokens map onto sequences and cache slots; built once per step by the model
    runner and shared by every layer, so masks and indices are not rebuilt per layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V is written
    decode: DecodeBatch | None = None
    fresh: FreshBatch | None = None
    cached: PrefillBatch | None = None

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode is None else self.decode.block_tables.shape[0]


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V ([T, kv_heads, head_dim]) into their cache slots."""
    k_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, kv_heads, max_blocks * block_size, head_dim] (a strided view)."""
    blocks = cache.index_select(0, block_tables.flatten())
    return blocks.view(block_tables.shape[0], -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def _pad(x: torch.Tensor, batch: FreshBatch) -> torch.Tensor:
    """[T, heads, D] -> [num_seqs, heads, max_query_len, D], zero rows where a chunk is shorter."""
    padded = x.new_zeros(batch.num_seqs * batch.max_query_len, *x.shape[1:])
    padded.index_copy_(0, batch.token_index, x)
    return padded.view(batch.num_seqs, batch.max_query_len, *x.shape[1:]).transpose(1, 2)


def _unpad(out: torch.Tensor, batch: FreshBatch) -> torch.Tensor:
    flat = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_query_len, *out.shape[1:2], out.shape[3])
    return flat.index_select(0, batch.token_index)


def fresh_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: FreshBatch, scale: float
) -> torch.Tensor:
    """Causal attention of each prompt over its own new K/V ([T, heads, D] laid back to back).

    Several prompts go through one SDPA call, padded to the longest. One call per prompt computes less
    (up to 2.6x less on prompts of 32-256 tokens) and is 2x faster on one thread, but on 2 threads its
    ~2,000 small parallel regions per step made W64's prefill 2-4x slower (measured): each region waits
    for both threads, and any other load on the machine stretches every wait."""
    if batch.num_seqs == 1:
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    q, k, v = (_pad(x, batch) for x in (query, key, value))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return _unpad(o, batch)


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    """One query per sequence [B, heads, D] over its cached context (PyTorch: gather, then SDPA)."""
    k = _gather_kv(k_cache, batch.block_tables)
    v = _gather_kv(v_cache, batch.block_tables)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), k, v, attn_mask=batch.mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """Causal attention for a step's queries [T, heads, D]; key/value [T, kv_heads, D] are this step's new
    K/V, already written to the cache by store_kvcache. `decode_kernel(query, k_cache, v_cache,
    block_tables, context_lens, scale)` replaces the PyTorch decode path when given (kernels/csrc)."""
    out = torch.empty_like(query)
    begin = 0
    if meta.decode is not None:
        end = begin + meta.num_decode_tokens
        batch = meta.decode
        if decode_kernel is not None:
            o = decode_kernel(
                query[begin:end], k_cache, v_cache, batch.block_tables, batch.context_lens, scale
            )
        else:
            o = decode_attention(query[begin:end], k_cache, v_cache, batch, scale)
        if end == query.shape[0]:
            return o  # decode-only step: nothing else to place
        out[begin:end] = o
        begin = end
    if meta.fresh is not None:
        end = begin + meta.fresh.num_tokens
        o = fresh_prefill_attention(query[begin:end], key[begin:end], value[begin:end], meta.fresh, scale)
        if begin == 0 and end == query.shape[0]:
            return o  # prompt-only step
        out[begin:end] = o
        begin = end
    if meta.cached is not None:
        batch, end = meta.cached, begin + meta.cached.num_tokens
        q = _pad(query[begin:end], batch)
        k = _gather_kv(k_cache, batch.block_tables)
        v = _gather_kv(v_cache, batch.block_tables)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale, enable_gqa=True)
        out[begin:end] = _unpad(o, batch)
    return out
