"""Speculative decoding's proposals: prompt lookup (n-gram), or places for the draft model's or MTP head's.

A decoding sequence whose last n tokens (n from NGRAM_MAX down to NGRAM_MIN) occurred earlier in its prompt
or output is proposed the tokens that followed that earlier occurrence, up to K of them. The engine
verifies all proposals in one forward pass and keeps those the sampler would have chosen anyway
(Scheduler.update_from_output), so speculation changes how many forward passes a request takes, never its tokens. It
pays where the output quotes its input: edits, summaries that cite, code.
"""

from __future__ import annotations

from nanovllm.worker.config import EngineConfig
from nanovllm.worker.sequence import Sequence

NGRAM_MAX = 3
NGRAM_MIN = 1
DRAFT_PLACEHOLDER = 0  # a proposal the draft model or MTP head has yet to make (draft.py, mtp.py)


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


class Proposer:
    """Proposals for each sequence about to decode, unless the batch is larger than speculative_max_batch
    (it then keeps the device busy without them). A proposal never runs past max_tokens or max_model_len,
    counting the token its verification adds. The draft model and the MTP head propose after scheduling,
    into the cache slots the scheduler reserves: here they get placeholders that say how many they may
    propose."""

    def __init__(self, config: EngineConfig) -> None:
        self.method = config.speculative_method
        self.num_tokens = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.max_model_len = config.max_model_len

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` of each running sequence about to decode ([] for none)."""
        if self.method == "none":  # nothing ever set them: a pass over the batch would only write []s
            return
        decoding = [s for s in running if s.num_uncomputed_tokens == 1 and s.pooling is None]
        speculate = self.method != "none" and len(decoding) <= self.max_batch
        for seq in decoding:
            room = min(
                self.num_tokens,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens,
            )
            if not speculate or room <= 0:
                seq.spec_token_ids = []
            elif self.method == "ngram":
                proposal = propose_ngram(seq.token_ids, room)
                if seq.grammar is not None:  # what the constraint rejects could never be accepted
                    proposal = proposal[: seq.grammar.valid_prefix(proposal)]
                seq.spec_token_ids = proposal
            else:
                seq.spec_token_ids = [DRAFT_PLACEHOLDER] * room
