"""Continuous-batching scheduler: decides, each step, which tokens of which requests are computed.

Policy, in order:
1. Running requests: decodes first (one token each, so inter-token latency stays low), then the next
   chunk of any partially prefilled prompt. When KV blocks run out, the lowest-priority, newest running
   request not yet scheduled in this step is preempted (recompute: its blocks are freed and it goes back to
   waiting); if that is the request being scheduled, it preempts itself.
2. Waiting requests in priority order (lower value first, then arrival), with prefix-cache lookup (the
   device's blocks, then the lower tiers'), while the token budget, `max_num_seqs` and free blocks allow;
   one whose LoRA adapter would make the running requests' adapters more than `max_loras` waits, and those
   behind it may go first. A prompt longer than the remaining budget is chunked, so a long prompt never
   holds running decodes back for more than one step's budget. Hits in host memory are copied up before
   the step's forward pass; a request with hits on disk, where a read can fail, is loading for one step
   (its blocks are copied up) and runs from the next, from where its loads got to.
The scheduler decides; the model runner executes its SchedulerOutput; the scheduler then applies the
step's picks (`update_from_output`): new tokens, stop checks, finished requests, blocks for the prefix cache.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection

import torch

from nanovllm.common.logging import get_logger
from nanovllm.worker.core.block_manager import BlockManager
from nanovllm.worker.sequence import Sequence, SequenceStatus, TokenLogprobs
from nanovllm.worker.step import (
    LoadingSequence,
    ModelRunnerOutput,
    RequestOutput,
    ScheduledSequence,
    SchedulerOutput,
)

log = get_logger(__name__)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Collection[int] = frozenset(),
        max_loras: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.loading: list[Sequence] = []  # admitted, their lower tiers' blocks on their way up
        # A hybrid model's sequences whose loads arrived: their first chunk restores their state snapshot.
        self._resuming: set[int] = set()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        states = self.block_manager.states
        if states is not None:
            states.begin_step()
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        scheduled_ids: set[int] = set()

        # Decodes first, then chunks; each part in the running list's (priority) order.
        running = SequenceStatus.RUNNING
        order = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens <= 1]
        if len(order) < len(self.running):
            order += [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not running:  # preempted earlier in this loop
                continue
            num_tokens = len(seq.token_ids)
            if seq.num_pending_tokens and num_tokens >= seq.max_num_tokens:
                continue  # the pick of the step in flight is its last: nothing follows it
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            # A decode with proposals computes them too, when the budget and free blocks allow: a chunk
            # continuing the sequence, with the prefill chunks.
            spec = seq.spec_token_ids[: budget - 1] if num_new == 1 and seq.spec_token_ids else []
            if spec and self.block_manager.allocate_slots(seq, 1 + len(spec)):
                item = ScheduledSequence(seq, seq.num_computed_tokens, 1 + len(spec), spec)
                if states is not None:  # a rejection in its last step rolls the state back first
                    item.state_restore = states.take_rollback(seq)
                prefills.append(item)
                scheduled_ids.add(seq.seq_id)
                budget -= 1 + len(spec)
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not running:
                continue
            item = ScheduledSequence(seq, seq.num_computed_tokens, num_new)
            if seq.seq_id in self._resuming:
                self._resuming.remove(seq.seq_id)
                assert states is not None  # only a hybrid model's sequences resume
                item.state_restore = states.restore(seq)
            elif states is not None:
                item.state_restore = states.take_rollback(seq)
            (decodes if num_new == 1 else prefills).append(item)
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        loading: list[LoadingSequence] = []
        if not preempted:
            self._admit_waiting(budget, decodes, prefills, loading)
        scheduled = decodes + prefills
        if states is not None and states.caching:  # a hybrid model's state copies at block boundaries
            for item in scheduled:
                item.state_saves = states.plan_saves(item.seq, item.start, item.start + item.num_new_tokens)
        if states is not None:  # and after each verified token but the last, for a rejection's rollback
            for item in scheduled:
                if item.spec_token_ids:
                    item.state_saves += states.verify_saves(item.seq, item.start, item.num_new_tokens)
        # After the saves: a snapshot whose row they take may go down to a lower tier in this step.
        transfers = self.block_manager.take_transfers()
        return SchedulerOutput(scheduled, len(decodes), transfers, loading)

    def _admit_waiting(
        self,
        budget: int,
        decodes: list[ScheduledSequence],
        prefills: list[ScheduledSequence],
        loading: list[LoadingSequence],
    ) -> None:
        if not self.waiting:
            return
        bm = self.block_manager
        adapters = {s.adapter for s in self.running + self.loading if s.adapter is not None}
        admitting: dict[int, Sequence] = {}  # the prompts this step admits (get_computed_blocks)
        index = 0
        while (
            index < len(self.waiting)
            and budget > 0
            and len(self.running) + len(self.loading) < self.max_num_seqs
        ):
            seq = self.waiting[index]
            if seq.adapter is not None and seq.adapter not in adapters and len(adapters) >= self.max_loras:
                index += 1  # every LoRA slot is taken by the running requests' adapters
                continue
            # A prompt to score is computed whole: a hit's positions would have no logits.
            computed = [] if seq.scores_prompt else bm.get_computed_blocks(seq, admitting)
            lower = [] if seq.scores_prompt else bm.lower_hits(seq, computed)
            # Blocks in the lower tiers take device blocks but no budget: they are copied, not computed.
            num_lower = len(lower) * bm.block_size
            num_new = min(seq.num_tokens - len(computed) * bm.block_size - num_lower, budget)
            if not bm.allocate_slots(seq, num_lower + num_new, computed):
                break
            if lower and bm.load_lower_hits(seq, lower):
                # Some come from disk, where a load can fail: it runs from the next step, from where its
                # loads got to (the blocks for its first chunk are kept for it).
                self.loading.append(seq)
                loading.append(LoadingSequence(seq, lower))
            else:  # host memory's copies arrive before this step's forward pass, which computes after them
                if lower:
                    bm.finish_loads(seq, lower, set())
                num_cached = len(seq.block_hashes) * bm.block_size
                self._start_running(seq, num_cached)
                item = ScheduledSequence(
                    seq,
                    num_cached,
                    num_new,
                    state_restore=-1 if bm.states is None else bm.states.restore(seq),
                )
                (decodes if num_new == 1 else prefills).append(item)
                budget -= num_new
            self.waiting.pop(index)
            if seq.adapter is not None:
                adapters.add(seq.adapter)

    def _start_running(self, seq: Sequence, num_cached: int) -> None:
        """`seq` joins the running batch with its first `num_cached` tokens' KV in its blocks."""
        seq.num_computed_tokens = num_cached
        if not seq.admitted:
            seq.num_cached_tokens = num_cached
            seq.admitted = True
            seq.timeline.scheduled_ns = time.time_ns()
        seq.transition(SequenceStatus.RUNNING)
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def _finish_loading(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """The step made its copies to and from the lower tiers: the requests it loaded run from where
        their loads got to (a load that failed is recomputed from there)."""
        bm = self.block_manager
        bm.writes_failed(output.kv_failed_writes)
        bm.loads_done(sched.kv_transfers.loads, output.kv_failed_loads)
        failed = {load.block_hash for load in output.kv_failed_loads}
        for item in sched.loading:
            seq = item.seq
            if seq.status.finished:  # aborted meanwhile: its blocks are free already
                continue
            self.loading.remove(seq)
            bm.finish_loads(seq, item.block_hashes, failed)
            self._start_running(seq, len(seq.block_hashes) * bm.block_size)
            if bm.states is not None:
                self._resuming.add(seq.seq_id)

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        """Lowest priority, newest arrival among running requests not already scheduled this step."""
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled_ids:
                return seq
        raise RuntimeError("no preemptible request; the KV cache cannot hold the scheduled batch")

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._resuming.discard(seq.seq_id)
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
        elif seq in self.loading:
            self.loading.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.transition(status)
        self.block_manager.free(seq)
        self._resuming.discard(seq.seq_id)

    @staticmethod
    def on_launch(sched: SchedulerOutput) -> None:
        """The step is on its way: each sequence's scheduled tokens count as computed, each one that samples
        holds the place of its pick until the step's picks are applied, and its timeline counts the step."""
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_new_tokens
            if item.samples and not item.spec_token_ids:
                seq.add_pending_token()
            seq.timeline.on_step(sampled=item.samples)

    def update_from_output(
        self, sched: SchedulerOutput, output: ModelRunnerOutput
    ) -> tuple[list[RequestOutput], int]:
        """Apply a step: new tokens in the places their sequences held, finished requests, blocks for the
        prefix cache, the lower tiers' copies. Also returns how many proposals were accepted. A sequence
        that ended while the step ran (its previous step finished it, or it was aborted) has its picks
        discarded."""
        if sched.kv_transfers or output.kv_failed_writes:
            self._finish_loading(sched, output)
        if output.prompt_logprobs:
            self._add_prompt_logprobs(sched, output.prompt_logprobs)
        outputs = []
        accepted = 0
        sampler_out = output.sampler_output
        picks = zip(sampler_out.token_ids, sampler_out.logprobs)  # the sampler's rows, in order
        running = SequenceStatus.RUNNING
        for item in sched.scheduled:
            seq, spec = item.seq, item.spec_token_ids
            if not item.samples:
                if seq.status is running:
                    self.block_manager.cache_full_blocks(seq)
                    if item.pools:  # a pooling request's last chunk: its result ends it
                        outputs.append(self._finish_pooling(seq, output.pooled[seq.seq_id]))
                continue
            if spec:
                drawn = [next(picks) for _ in range(len(spec) + 1)]
                if seq.status.finished:
                    continue
                new_tokens, new_logprobs, status, num_accepted = self._verify(seq, spec, drawn)
                accepted += num_accepted
                states = self.block_manager.states
                if states is not None and status is None:
                    states.roll_back(seq, len(spec) + 1, len(new_tokens))
            else:  # one pick in the place the sequence held for it: the common row, written out
                token, logprob = next(picks)
                if seq.status.finished:
                    continue
                seq.resolve_pending_token(token)
                new_tokens, new_logprobs = [token], []
                if logprob is not None:
                    seq.logprobs.append(logprob)
                    new_logprobs.append(logprob)
                status = self._stop_status(seq, token, len(seq.token_ids) - seq.num_pending_tokens)
                if seq.grammar is not None and status is None:
                    status = self._constraint_status(seq, token)
            if seq.status is running:
                self.block_manager.cache_full_blocks(seq)
            if status is not None:
                seq.drop_pending_tokens()
                self.finish(seq, status)
            outputs.append(request_output(seq, new_tokens, new_logprobs))
        return outputs, accepted

    def _finish_pooling(self, seq: Sequence, result: torch.Tensor) -> RequestOutput:
        """A pooling request's only output: its result; it finishes, its full blocks kept for the prefix
        cache."""
        self.finish(seq, SequenceStatus.FINISHED_STOPPED)
        out = request_output(seq, [])
        out.pooled = result
        return out

    @staticmethod
    def _add_prompt_logprobs(sched: SchedulerOutput, scored: dict[int, list[TokenLogprobs]]) -> None:
        """Each sequence's prompt logprobs the step computed, after those it has (a step scores only
        positions not scored yet, worker/runner/inputs.py, so a recomputation adds none twice)."""
        for item in sched.scheduled:
            entry = scored.get(item.seq.seq_id)
            if entry is not None:
                item.seq.prompt_logprobs.extend(entry)

    def _verify(
        self, seq: Sequence, spec: list[int], drawn: list[tuple[int, TokenLogprobs | None]]
    ) -> tuple[list[int], list[TokenLogprobs], SequenceStatus | None, int]:
        """Append a verified chunk's picks: each one while the one before it was the proposal it was
        computed after (picks past the first rejected proposal were computed after a token the request does
        not have). Returns the tokens and logprobs kept, the status they end the sequence with, if any, and
        how many proposals were accepted."""
        new_tokens: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        status = None
        accepted = 0
        for j, (token, logprob) in enumerate(drawn):
            seq.token_ids.append(token)
            new_tokens.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
                new_logprobs.append(logprob)
            status = self._stop_status(seq, token, seq.num_tokens - seq.num_pending_tokens)
            if seq.grammar is not None and status is None:
                status = self._constraint_status(seq, token)
            if status is not None or j == len(spec) or token != spec[j]:
                break
            accepted += 1
        # The KV of accepted proposals is kept; the cache slots after them are overwritten later.
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.num_draft_tokens = min(seq.num_draft_tokens, seq.num_tokens - 1)
        return new_tokens, new_logprobs, status, accepted

    def _stop_status(self, seq: Sequence, token: int, num_tokens: int) -> SequenceStatus | None:
        """Whether `token`, the sequence's token number `num_tokens`, ends it."""
        params = seq.params
        is_stop = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        if is_stop and num_tokens - seq.num_prompt_tokens >= params.min_tokens:
            return SequenceStatus.FINISHED_STOPPED
        if num_tokens >= seq.max_num_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _constraint_status(seq: Sequence, token: int) -> SequenceStatus | None:
        """Advance the request's matcher; it stops once the constraint is complete with nothing to follow."""
        grammar = seq.grammar
        assert grammar is not None  # a constrained request's
        if not grammar.consume([token]):
            # The mask allowed only tokens that min_tokens or stop_token_ids banned; nothing can follow.
            log.warning(
                "constraint_rejected_token", request_id=seq.request_id, token=token, error=grammar.error
            )
            return SequenceStatus.FINISHED_STOPPED
        return SequenceStatus.FINISHED_STOPPED if grammar.is_stopped else None


def request_output(
    seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs] | None = None
) -> RequestOutput:
    """What a step did for `seq`: `tokens` added and, once it has finished, why."""
    finish_reason = seq.finish_reason
    # In field order, not by keyword: that takes half the time (180 against 380 ns), for every request
    # every step.
    out = RequestOutput(
        seq.request_id,
        tokens,
        finish_reason,
        logprobs or [],
        seq.num_prompt_tokens,
        seq.num_cached_tokens,
        len(seq.token_ids) - seq.num_prompt_tokens - seq.num_pending_tokens,  # num_output_tokens
        None,  # error
        seq.timeline if finish_reason is not None else None,
    )
    if tokens and seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
        out.prompt_logprobs = seq.prompt_logprobs
        seq.prompt_logprobs_sent = True
    return out
