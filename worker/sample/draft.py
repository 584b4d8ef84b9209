"""Speculative decoding's draft model (speculative_method=draft): a small model with the target's vocabulary,
run by the same model runner, proposing each decoding sequence's next tokens greedily.

Its KV cache has the target's block geometry and is read and written through the target's block tables: the
blocks the scheduler gives a sequence hold both models' keys and values of its tokens, so the draft needs no
block manager of its own, and freeing a block frees both. `Sequence.num_draft_tokens` counts the tokens whose
draft KV is in the cache. A step first catches the draft up on the tokens it has not seen (the whole prompt
the first time; afterwards the token the verification picked past the last accepted proposal, or more after
steps without speculation), one chunk per sequence, which also gives the first proposal; then the draft
decodes the other proposals one position at a time. It runs after scheduling, into the cache slots the
scheduler reserved for the proposals, which the verification then overwrites with the target's KV.

Proposals decide only how many tokens a step keeps, never which (Scheduler.update_from_output): a draft that proposes
badly, or reads stale KV, costs speed, not correctness.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import ModuleType

import torch

from nanovllm.kernels.attention import AttentionMetadata
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.sample.paged_slots import chunk_slots, seq_chunk
from nanovllm.worker.sample.sampler import greedy_tokens
from nanovllm.worker.step import ScheduledSequence, StepInputs

Tensors = Callable[[StepInputs], tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]]


class DraftModel:
    def __init__(self, model: DecoderForCausalLM, config: ModelConfig, block_size: int) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.kv_cache = torch.empty(0)  # sized by allocate_cache once the target's block count is known
        self.cpu_kernels: ModuleType | None = None  # the C++ kernels (kernels/cpu_kernels.py) for the argmax

    def allocate_cache(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        """A cache of `num_blocks` blocks, numbered as the target's (its pad block included)."""
        cfg = self.config
        shape = (2, cfg.num_hidden_layers, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSequence], tensors: Tensors) -> None:
        """Replace each item's placeholder proposals (as many as the scheduler made room for) with the
        draft's greedy continuation of its sequence. `tensors` turns step inputs into the model's."""
        seqs = [item.seq for item in items]
        starts = [min(seq.num_draft_tokens, seq.num_tokens - 1) for seq in seqs]
        # Catch up: chunks from a sequence's start first, then continuing ones (StepInputs' layout).
        order = sorted(range(len(items)), key=lambda i: starts[i] > 0)
        chunks = [
            seq_chunk(seqs[i], starts[i], seqs[i].num_tokens - starts[i], self.block_size) for i in order
        ]
        inputs = StepInputs(
            input_ids=[t for i in order for t in seqs[i].token_ids[starts[i] :]],
            positions=[p for c in chunks for p in range(c.start, c.start + c.num_new_tokens)],
            slot_mapping=[s for i, c in zip(order, chunks) for s in chunk_slots(seqs[i], c, self.block_size)],
            decodes=[],
            fresh=[c for c in chunks if c.start == 0],
            cached=[c for c in chunks if c.start > 0],
            logits_index=[end - 1 for end in itertools.accumulate(c.num_new_tokens for c in chunks)],
        )
        proposals: list[list[int]] = [[] for _ in items]
        for i, token in zip(order, self._greedy(inputs, tensors)):
            proposals[i].append(token)
        # The other proposals, one position per forward pass.
        for step in range(1, max(len(item.spec_token_ids) for item in items)):
            active = [i for i, item in enumerate(items) if len(item.spec_token_ids) > step]
            decodes = [seq_chunk(seqs[i], seqs[i].num_tokens - 1 + step, 1, self.block_size) for i in active]
            inputs = StepInputs(
                input_ids=[proposals[i][-1] for i in active],
                positions=[c.start for c in decodes],
                slot_mapping=[
                    s for i, c in zip(active, decodes) for s in chunk_slots(seqs[i], c, self.block_size)
                ],
                decodes=decodes,
                fresh=[],
                cached=[],
                logits_index=list(range(len(active))),
            )
            for i, token in zip(active, self._greedy(inputs, tensors)):
                proposals[i].append(token)
        for item, proposal in zip(items, proposals):
            item.spec_token_ids = proposal
            # KV written up to the last proposal but one; Scheduler.update_from_output keeps what was accepted.
            item.seq.num_draft_tokens = item.seq.num_tokens + len(proposal) - 1

    def _greedy(self, inputs: StepInputs, tensors: Tensors) -> list[int]:
        input_ids, positions, meta, logits_index = tensors(inputs)
        hidden = self.model(input_ids, positions, meta)
        return greedy_tokens(
            self.model.compute_logits(hidden.index_select(0, logits_index)), self.cpu_kernels
        ).tolist()
