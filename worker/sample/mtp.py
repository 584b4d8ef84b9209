"""Speculative decoding's multi-token-prediction proposer (speculative_method=mtp): Qwen3.5's own head
(`mtp.*`, worker/models/qwen3_5.py MultiTokenPredictor) proposes each decoding sequence's next tokens.

The head at position p reads the model's final hidden state at p and the token at p + 1, and predicts the
token at p + 2; drafting further, it reads its own hidden state and its last proposal. Its one attention
layer keeps a KV cache of its own with the model's block geometry, read and written through the model's
block tables (as the draft model's: worker/sample/draft.py), so the blocks the scheduler hands a sequence
hold both and the head needs no block manager.

The model's hidden states exist only in the step that computes them, so the head follows the model there
(`absorb`, called by the runner after each forward pass): it runs over every position whose next token is
known (a prompt chunk's rows, but its last when that row picks a token), and the hidden states of the
other rows (a decode's, a verification's) wait in `_pending` until their next token is known: at the next
step, either the proposal's first pass (`propose`: those positions up to the sequence's last token, whose
last row gives the first proposal), or that step's `absorb` when the sequence does not speculate. A
verification's rows past its last accepted proposal are dropped then: the model recomputes those positions.
So a sequence's pending rows are at most the K + 1 of one verification, and the head's KV at a position
is written from the model's own hidden state once the token after it is known. What a proposal wrote past
that (its own drafts' KV) is overwritten when the head catches up there.

With speculative_draft_vocab = N the head picks among the first N token ids only: its output projection
reads N rows of the LM head (the whole vocabulary is 248,320 rows on Qwen3.5, a third of the 0.8B's
weights, read once per proposal), and byte-level BPE numbers its commonest tokens first.

With tensor parallelism every rank runs each pass of the head on its share of it (its heads, and their KV
in a cache of its own; worker/models/qwen3_5.py MultiTokenPredictor says why it is split): rank 0 keeps the
records above and hands each pass to the others (`share`, with the rows' hidden states: the other ranks
keep no record of which rows those are), which run it (`run_pass`) with its collectives. The proposals are
rank 0's (the vocabulary-parallel logits are gathered there) and travel to the other ranks as the
verification's tokens.

Proposals decide only how many tokens a step keeps, never which (Scheduler.update_from_output): a head that
proposes badly, or reads KV it never wrote (a prefix-cache hit's blocks, written by whoever computed them),
costs speed, not correctness.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from nanovllm.kernels.attention import AttentionMetadata
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from nanovllm.worker.sample.paged_slots import chunk_slots, seq_chunk
from nanovllm.worker.sample.sampler import greedy_tokens
from nanovllm.worker.sequence import Sequence, SequenceStatus
from nanovllm.worker.step import HeadPass, ScheduledSequence, StepInputs

Tensors = Callable[[StepInputs], tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]]


@dataclass
class _Rows:
    """The model's final hidden states of `seq` at positions first, first + 1, ... (one row each)."""

    seq: Sequence
    first: int
    hidden: torch.Tensor

    @property
    def end(self) -> int:
        return self.first + self.hidden.shape[0]


class MtpProposer:
    def __init__(
        self,
        model: Qwen3_5ForCausalLM,
        block_size: int,
        draft_vocab: int = 0,
        share: Callable[[HeadPass], None] | None = None,
    ) -> None:
        if model.mtp is None:
            raise ValueError("an MtpProposer needs the model's multi-token-prediction head (enable_mtp)")
        self.model = model
        self.block_size = block_size
        self.draft_vocab = draft_vocab  # proposals among the first draft_vocab token ids (0: all)
        self.share = share  # rank 0 of several: hands each pass to the other ranks before running it
        self.kv_cache = torch.empty(0)  # sized by allocate_cache once the model's block count is known
        self._pending: dict[int, _Rows] = {}  # by seq_id: rows whose next token was not known yet
        self.cpu_kernels: ModuleType | None = None  # the C++ kernels (kernels/cpu_kernels.py) for the argmax

    def allocate_cache(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        """The head's KV cache: `num_blocks` blocks numbered as the model's (its pad block included), in the
        model's dtype (one layer's KV is small beside the model's)."""
        assert self.model.mtp is not None  # checked at construction
        attn = self.model.mtp.attention()
        shape = (2, num_blocks, self.block_size, attn.num_kv_heads, self.model.config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.k_cache, attn.v_cache = self.kv_cache[0], self.kv_cache[1]

    @torch.inference_mode()
    def absorb(
        self, rows: list[tuple[ScheduledSequence, int]], hidden: torch.Tensor, tensors: Tensors
    ) -> None:
        """After a forward pass whose final hidden states are `hidden`: run the head over the positions whose
        next token is now known (the step's and those pending from the last one), keep the others pending.
        `rows`: each scheduled sequence with the row of its first token in `hidden`."""
        runs: list[_Rows] = []
        for item, row in rows:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            known = len(seq.token_ids) - seq.num_pending_tokens
            committed = max(0, min(n, known - 1 - start))  # rows whose next token the sequence holds
            run = self._caught_up(seq.seq_id, start)
            if committed:
                here = hidden[row : row + committed]
                if run is not None and run.end == start:
                    run.hidden = torch.cat([run.hidden, here])
                else:
                    if run is not None:
                        runs.append(run)
                    run = _Rows(seq, start, here)
            if run is not None:
                runs.append(run)
            if committed < n:
                self._pending[seq.seq_id] = _Rows(
                    seq, start + committed, hidden[row + committed : row + n].clone()
                )
        self._forget_finished()
        if runs:
            self._run(runs, [], tensors)

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSequence], tensors: Tensors) -> None:
        """Replace each item's placeholder proposals (as many as the scheduler made room for) with the
        head's greedy continuation: first over the sequence's pending positions up to its last token (the
        last row proposes the first token), then one pass per further proposal on its own hidden state."""
        runs = []
        for item in items:
            seq = item.seq
            last = len(seq.token_ids) - 1  # the position the verification computes first
            run = self._caught_up(seq.seq_id, last)
            if run is None or run.end != last:
                raise RuntimeError(
                    f"request {seq.request_id!r}: the model's hidden state at position {last - 1} is not "
                    "pending for the multi-token-prediction head"
                )
            runs.append(run)
        hidden, tokens = self._run(runs, [run.end - run.first - 1 for run in runs], tensors)
        proposals = [[token] for token in tokens]
        row_of = {i: i for i in range(len(items))}  # each item's row in `hidden`
        for step in range(1, max(len(item.spec_token_ids) for item in items)):
            active = [i for i, item in enumerate(items) if len(item.spec_token_ids) > step]
            decodes = [seq_chunk(items[i].seq, runs[i].end - 1 + step, 1, self.block_size) for i in active]
            inputs = StepInputs(
                input_ids=[proposals[i][-1] for i in active],
                positions=[c.start for c in decodes],
                slot_mapping=[
                    s for i, c in zip(active, decodes) for s in chunk_slots(items[i].seq, c, self.block_size)
                ],
                decodes=decodes,
                fresh=[],
                cached=[],
                logits_index=list(range(len(active))),
            )
            rows = torch.tensor([row_of[i] for i in active], device=hidden.device)
            hidden, new = self._forward(inputs, hidden.index_select(0, rows), tensors)
            row_of = {i: j for j, i in enumerate(active)}
            for i, token in zip(active, new):
                proposals[i].append(token)
        for item, proposal in zip(items, proposals):
            item.spec_token_ids = proposal

    def _caught_up(self, seq_id: int, upto: int) -> _Rows | None:
        """The pending rows of a sequence before position `upto` (their next tokens are known now), taken
        out of `_pending`; None when none are."""
        rows = self._pending.pop(seq_id, None)
        if rows is None or rows.first >= upto:
            return None
        end = min(upto, rows.end)
        return _Rows(rows.seq, rows.first, rows.hidden[: end - rows.first])

    def _forget_finished(self) -> None:
        """Pending rows of sequences that finished or were preempted are never needed."""
        for seq_id in [
            i for i, rows in self._pending.items() if rows.seq.status is not SequenceStatus.RUNNING
        ]:
            del self._pending[seq_id]

    def _run(self, runs: list[_Rows], picks: list[int], tensors: Tensors) -> tuple[torch.Tensor, list[int]]:
        """The head over each run's positions (a chunk per sequence, each row's input the token after its
        position): the head's hidden states at the rows `picks` (one per run, into its run) and the greedy
        tokens they predict ([] when `picks` is)."""
        order = sorted(range(len(runs)), key=lambda i: runs[i].first > 0)  # StepInputs: fresh, then cached
        chunks = {
            i: seq_chunk(runs[i].seq, runs[i].first, runs[i].hidden.shape[0], self.block_size) for i in order
        }
        firsts = list(itertools.accumulate((chunks[i].num_new_tokens for i in order), initial=0))
        first_row = {i: firsts[j] for j, i in enumerate(order)}
        inputs = StepInputs(
            input_ids=[t for i in order for t in runs[i].seq.token_ids[runs[i].first + 1 : runs[i].end + 1]],
            positions=[p for i in order for p in range(runs[i].first, runs[i].end)],
            slot_mapping=[s for i in order for s in chunk_slots(runs[i].seq, chunks[i], self.block_size)],
            decodes=[],
            fresh=[chunks[i] for i in order if chunks[i].start == 0],
            cached=[chunks[i] for i in order if chunks[i].start > 0],
            logits_index=[first_row[i] + pick for i, pick in enumerate(picks)],
        )
        hidden = torch.cat([runs[i].hidden for i in order])
        return self._forward(inputs, hidden, tensors)

    def _forward(
        self, inputs: StepInputs, hidden: torch.Tensor, tensors: Tensors
    ) -> tuple[torch.Tensor, list[int]]:
        """The head on `inputs` with the hidden states `hidden` (one row each), on every rank: its hidden
        states at the rows of `inputs.logits_index`, and the greedy tokens they predict."""
        if self.share is not None:
            self.share(HeadPass(inputs, hidden))
        return self.run_pass(HeadPass(inputs, hidden), tensors)

    @torch.inference_mode()
    def run_pass(self, head_pass: HeadPass, tensors: Tensors) -> tuple[torch.Tensor, list[int]]:
        """One pass of the head on this rank (ranks 1..N-1 run rank 0's as they receive them)."""
        inputs, hidden = head_pass.inputs, head_pass.hidden
        input_ids, positions, meta, logits_index = tensors(inputs)
        out = self.model.mtp_forward(input_ids, hidden, positions, meta)
        if not inputs.logits_index:
            return out[:0], []
        out = out.index_select(0, logits_index)
        return out, greedy_tokens(self.model.compute_logits(out, self.draft_vocab), self.cpu_kernels).tolist()
