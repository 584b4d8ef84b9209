"""Continuous-batching scheduler: decides, each step, which tokens of which requests are computed.

Policy, in order:
1. Running requests: decodes first (one token each, so inter-token latency stays low), then the next
   chunk of any partially prefilled prompt. When KV blocks run out, the lowest-priority, newest running
   request not yet scheduled in this step is preempted (recompute: its blocks are freed and it goes back to
   waiting); if that is the request being scheduled, it preempts itself.
2. Waiting requests in priority order (lower value first, then arrival), with prefix-cache lookup, while
   the token budget, `max_num_seqs` and free blocks allow. A prompt longer than the remaining budget is
   chunked, so a long prompt never holds running decodes back for more than one step's budget.
The scheduler only decides; the model runner executes its SchedulerOutput, and the engine (`LLMEngine._update`)
applies the results.
"""

from __future__ import annotations

import bisect
import time

from nanovllm.worker.core.block_manager import BlockManager
from nanovllm.worker.sequence import Sequence, SequenceStatus
from nanovllm.worker.step import ScheduledSequence, SchedulerOutput


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        scheduled_ids: set[int] = set()

        # Decodes first, then chunks; each part in the running list's (priority) order.
        order = [s for s in self.running if s.num_uncomputed_tokens <= 1]
        if len(order) < len(self.running):
            order += [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq.num_pending_tokens and seq.num_tokens >= seq.max_num_tokens:
                continue  # the pick of the step in flight is its last: nothing follows it
            num_new = min(seq.num_uncomputed_tokens, budget)
            # A decode with proposals computes them too, when the budget and free blocks allow: a chunk
            # continuing the sequence, with the prefill chunks.
            spec = seq.spec_token_ids[: budget - 1] if num_new == 1 else []
            if spec and self.block_manager.allocate_slots(seq, 1 + len(spec)):
                prefills.append(ScheduledSequence(seq, seq.num_computed_tokens, 1 + len(spec), spec))
                scheduled_ids.add(seq.seq_id)
                budget -= 1 + len(spec)
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            item = ScheduledSequence(seq, seq.num_computed_tokens, num_new)
            (decodes if num_new == 1 else prefills).append(item)
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        if not preempted:
            budget = self._admit_waiting(budget, decodes, prefills)
        return SchedulerOutput(decodes + prefills, len(decodes))

    def _admit_waiting(
        self, budget: int, decodes: list[ScheduledSequence], prefills: list[ScheduledSequence]
    ) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            computed = self.block_manager.get_computed_blocks(seq)
            num_cached = len(computed) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed):
                break
            self.waiting.pop(0)
            seq.num_computed_tokens = num_cached
            if not seq.admitted:
                seq.num_cached_tokens = num_cached
                seq.admitted = True
                seq.timeline.scheduled_ns = time.time_ns()
            seq.transition(SequenceStatus.RUNNING)
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            (decodes if num_new == 1 else prefills).append(ScheduledSequence(seq, num_cached, num_new))
            budget -= num_new
        return budget

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        """Lowest priority, newest arrival among running requests not already scheduled this step."""
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled_ids:
                return seq
        raise RuntimeError("no preemptible request; the KV cache cannot hold the scheduled batch")

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_draft_tokens = 0  # the draft model's KV went with the blocks
        self.running.remove(seq)
        seq.transition(SequenceStatus.WAITING)
        self.num_preemptions += 1
        seq.timeline.preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Move `seq` to a terminal state (including abort from any state) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.transition(status)
        self.block_manager.free(seq)
