"""What the sampler sees of a scheduled step: one SamplingRow per token it picks."""

from __future__ import annotations

from collections.abc import Collection

from nanovllm.worker.sequence import TokenSlice
from nanovllm.worker.step import SamplingRow, ScheduledSequence, SchedulerOutput


def sampling_rows(sched: SchedulerOutput, eos_token_ids: Collection[int]) -> list[SamplingRow]:
    """The rows of every scheduled sequence whose chunk samples, in order."""
    rows: list[SamplingRow] = []
    for item in sched.scheduled:
        if not item.samples:
            continue
        seq = item.seq
        if item.spec_token_ids or seq.num_output_tokens < seq.params.min_tokens:
            rows += _rows(item, eos_token_ids)
        else:  # the common row, written out: one per decoding sequence, every step
            output = TokenSlice(seq.token_ids, seq.num_prompt_tokens)
            rows.append(SamplingRow(seq.params, seq.prompt_token_ids, output))
    return rows


def _rows(item: ScheduledSequence, eos_token_ids: Collection[int]) -> list[SamplingRow]:
    """One row per token the step picks for `item`: with proposals, row j sees the first j proposals as
    its output so far, as the same request without speculation would have at that position (its
    penalties, min_tokens bans and the seed of its draw all follow from that)."""
    seq, spec = item.seq, item.spec_token_ids
    params = seq.params
    rows = []
    for j in range(len(spec) + 1):
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens + j < params.min_tokens:
            # Under a constraint EOS is the constraint's to allow, exactly when it is complete.
            eos = () if params.ignore_eos or seq.grammar is not None else tuple(eos_token_ids)
            banned = eos + tuple(params.stop_token_ids)
        output = seq.output_token_ids + spec[:j] if j else TokenSlice(seq.token_ids, seq.num_prompt_tokens)
        rows.append(SamplingRow(params, seq.prompt_token_ids, output, banned))
    return rows
