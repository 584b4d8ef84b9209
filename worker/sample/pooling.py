"""A pooling request's result from the step's final hidden states: the last prompt token's vector
("embed"), or the output head's logits of the request's token ids there ("score"; common/pooling.py).

A rerank score needs two logits, not the vocabulary's: the model multiplies the hidden state by those two
rows of the head only (ParallelLMHead.token_logits), in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.step import PoolingRow


def pool(
    hidden: torch.Tensor,
    rows: list[PoolingRow],
    model: DecoderForCausalLM,
    long: Callable[[list[int]], torch.Tensor],
) -> dict[int, torch.Tensor]:
    """By seq_id, each pooling row's result (float32, on the host). `long` puts integers on the model's
    device. Every tensor-parallel rank calls it with the same rows (a score's logits are summed over the
    ranks' slices of the vocabulary)."""
    vectors = hidden.index_select(0, long([r.row for r in rows]))
    results = [vectors[i].float() for i in range(len(rows))]
    scored = [i for i, r in enumerate(rows) if r.token_ids]
    if scored:
        owners = [i for i in scored for _ in rows[i].token_ids]
        token_ids = [t for i in scored for t in rows[i].token_ids]
        logits = model.token_logits(vectors.index_select(0, long(owners)), long(token_ids))
        for i, part in zip(scored, logits.split([len(rows[i].token_ids) for i in scored])):
            results[i] = part
    host = torch.cat(results).cpu() if results else torch.empty(0)
    out, begin = {}, 0
    for row, result in zip(rows, results):
        out[row.seq_id] = host[begin : begin + len(result)]
        begin += len(result)
    return out
