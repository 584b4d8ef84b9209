"""Speculative decoding's proposer: prompt lookup (n-gram).

A decoding sequence whose last n tokens (n from NGRAM_MAX down to NGRAM_MIN) occurred earlier in its prompt
or output is proposed the tokens that followed that earlier occurrence, up to K of them. The engine
verifies all proposals in one forward pass and keeps those the sampler would have chosen anyway
(LLMEngine._accept), so speculation changes how many forward passes a request takes, never its tokens. It
pays where the output quotes its input: edits, summaries that cite, code.
"""

from __future__ import annotations

NGRAM_MAX = 3
NGRAM_MIN = 1


def propose_ngram(token_ids: list[int], k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `token_ids`
    (NGRAM_MAX tokens down to NGRAM_MIN) that occurs earlier; [] when none does."""
    total = len(token_ids)
    for n in range(min(NGRAM_MAX, total - 1), NGRAM_MIN - 1, -1):
        suffix = token_ids[total - n :]
        # The latest occurrence that ends before the suffix itself starts.
        for start in range(total - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                follow = token_ids[start + n : start + n + k]
                if follow:
                    return follow
    return []
