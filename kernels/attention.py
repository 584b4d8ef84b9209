"""Paged-KV attention ops (PyTorch reference implementations; Triton versions will sit behind the same calls).

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's tokens live in
the blocks its block table lists, token i at slot block_table[i // block_size] * block_size + i % block_size.

A step's tokens are laid out decode-first: the first `num_decode_tokens` rows are one new token each of
sequences that are decoding; the rest are prefill chunks, sequence after sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto sequences and cache slots.

    Built once per step by the model runner and shared by every layer, so masks and gather indices are
    computed once, not per layer.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V is written
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] long
    prefill_mask: torch.Tensor | None  # [num_prefills, 1, max_query_len, max_blocks * block_size] bool
    prefill_token_index: torch.Tensor | None  # [num_prefill_tokens] long: row in the padded query layout
    max_query_len: int = 0

    @property
    def num_prefills(self) -> int:
        return 0 if self.prefill_block_tables is None else self.prefill_block_tables.shape[0]


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
    """[B, max_blocks] block ids -> [B, kv_heads, max_blocks * block_size, head_dim] contiguous K or V."""
    blocks = cache.index_select(0, block_tables.flatten())
    batch = block_tables.shape[0]
    return blocks.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a step's queries ([T, heads, head_dim]) over everything cached for their sequences.

    The new tokens' K/V must already be in the cache (store_kvcache), so prefix-cache hits, chunked
    prefill and decode all read keys the same way.
    """
    out = torch.empty_like(query)
    heads, head_dim = query.shape[1], query.shape[2]
    nd = meta.num_decode_tokens
    if nd:
        q = query[:nd].unsqueeze(2)  # [B, H, 1, D]
        k = _gather_kv(k_cache, meta.decode_block_tables)
        v = _gather_kv(v_cache, meta.decode_block_tables)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    if meta.num_prefills:
        batch, qlen = meta.num_prefills, meta.max_query_len
        padded = query.new_zeros(batch * qlen, heads, head_dim)
        padded.index_copy_(0, meta.prefill_token_index, query[nd:])
        q = padded.view(batch, qlen, heads, head_dim).transpose(1, 2)
        k = _gather_kv(k_cache, meta.prefill_block_tables)
        v = _gather_kv(v_cache, meta.prefill_block_tables)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.prefill_mask, scale=scale, enable_gqa=True)
        out[nd:] = (
            o.transpose(1, 2).reshape(batch * qlen, heads, head_dim).index_select(0, meta.prefill_token_index)
        )
    return out
