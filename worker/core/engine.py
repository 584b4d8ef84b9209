"""The step-level engine: requests in, one scheduling + model step at a time, token deltas out.

This is the API the worker service drives; `LLM` wraps it for offline use.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from nanovllm.common.errors import RequestError
from nanovllm.common.logging import get_logger
from nanovllm.common.request_checks import check_prompt, check_resumed_outputs, check_stop_token_ids
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.core.block_manager import BlockManager
from nanovllm.worker.core.scheduler import Scheduler
from nanovllm.worker.runner.model_runner import LaunchedStep, ModelRunner
from nanovllm.worker.sample.speculation import propose_ngram
from nanovllm.worker.sample.structured_output import Grammar, GrammarCompiler, MaskFiller
from nanovllm.worker.sequence import (
    Sequence,
    SequenceStatus,
    TokenLogprobs,
    TokenSlice,
)
from nanovllm.worker.step import (
    EngineLoad,
    RequestOutput,
    SamplerOutput,
    SamplingRow,
    ScheduledSequence,
    SchedulerOutput,
    StepResult,
    StepStats,
)

log = get_logger(__name__)

DRAFT_PLACEHOLDER = 0  # a proposal the draft model has yet to make (LLMEngine._propose)
# While only constraints are compiling, a step waits this long at most for one to finish, so the thread
# that drives the engine still takes new commands promptly.
GRAMMAR_WAIT_S = 0.02


def _freeze_what_lasts() -> None:
    """Move every object that exists now (the model's modules, the tokenizer's tables, the caches'
    bookkeeping: they live as long as the engine) out of the garbage collector's sight: each full
    collection walked them all, which at batch 256 made some steps several ms longer
    (bench/host_overhead.py). They are handed back at exit, so the interpreter's last collection still
    frees them (extensions such as Triton's report objects left alive then)."""
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


@dataclass
class _InFlight:
    """A launched step whose picks the engine has yet to apply."""

    sched: SchedulerOutput
    launched: LaunchedStep
    # The next step may be scheduled and launched before this one's picks are applied: none of its
    # sequences needs its new token on the host to build the next step (penalties, constraints, proposals).
    overlappable: bool


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.hf_config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        vocab = self.model_config.vocab_size
        self.grammars = GrammarCompiler(config.model, vocab, sorted(self.eos_token_ids))
        # Requests waiting for their constraint: request id -> (sequence, compiled matcher, deadline).
        self._compiling: dict[str, tuple[Sequence, Future, float]] = {}
        self._masks: MaskFiller | None = None  # built with the first constrained request
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto"
            and self.runner.device.type == "cuda"
            and config.tensor_parallel_size == 1
            and config.speculative_method == "none"
        )
        self._inflight: _InFlight | None = None
        _freeze_what_lasts()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. `output_token_ids` resumes one that generated those tokens elsewhere: it goes on
        after them exactly as if it had produced them here (see Submit.output_token_ids)."""
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        vocab = self.model_config.vocab_size
        check_prompt(prompt_token_ids, self.config.max_model_len, vocab)
        check_stop_token_ids(params.stop_token_ids, vocab)
        outputs = list(output_token_ids or ())
        if outputs:
            check_resumed_outputs(
                outputs, len(prompt_token_ids), params.max_tokens, self.config.max_model_len, vocab
            )
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            priority=priority,
            token_ids=list(prompt_token_ids) + outputs,
            max_num_tokens=min(len(prompt_token_ids) + params.max_tokens, self.config.max_model_len),
        )
        self.requests[request_id] = seq
        if params.constraint is None:
            self.scheduler.add(seq)
            return
        deadline = time.monotonic() + self.config.grammar_compile_timeout_s
        self._compiling[request_id] = (seq, self.grammars.compile(params.constraint), deadline)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its final output (finish_reason "abort") comes from the next step."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if self._compiling.pop(request_id, None) is not None:  # never scheduled: no blocks
            seq.transition(SequenceStatus.FINISHED_ABORTED)
        else:
            seq.drop_pending_tokens()
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._aborted.append(self._output(seq, []))
        return True

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (joined, never orphaned). No step may follow."""
        self.grammars.shutdown()
        self.runner.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def load(self) -> EngineLoad:
        bm = self.block_manager
        return EngineLoad(
            num_waiting=len(self.scheduler.waiting) + len(self._compiling),
            num_running=len(self.scheduler.running),
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def step(self) -> StepResult:
        """Schedule and launch one step, and apply the results of the step launched before it: the
        requests that advanced or finished, and the timings.

        Synchronously, a step is applied in the call that launched it. With async scheduling the engine
        schedules and launches step N+1 before it waits for step N's picks: N+1 takes them on the device,
        and a request that N finished has its row in N+1 discarded. Each sequence holds the place of its
        pick in flight (Sequence.num_pending_tokens), so the scheduler sees what it would see after N."""
        outputs, self._aborted = self._aborted, []
        stats = StepStats()
        t0 = time.perf_counter()
        outputs.extend(self._admit_compiled())
        if self._inflight is not None and not self._inflight.overlappable:
            outputs.extend(self._apply_inflight(stats))
        self._propose()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        stats.schedule_s = t1 - t0 - stats.update_s - stats.wait_s
        if sched.is_empty:
            if self._inflight is not None:
                outputs.extend(self._apply_inflight(stats))
            elif self._compiling and not outputs:
                wait([future for _, future, _ in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
            return StepResult(outputs, stats)
        if self.config.speculative_method == "draft":
            drafting = [s for s in sched.scheduled if s.spec_token_ids]
            if drafting:
                self.runner.propose_draft(drafting)
        t_draft = time.perf_counter()
        rows = [row for s in sched.scheduled if s.samples for row in self._sampling_rows(s)]
        t_rows = time.perf_counter()
        masked = self._constrain(sched, rows)
        t_mask = time.perf_counter()
        launched = self.runner.launch(sched, rows)
        for item in sched.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens
            if item.samples and not item.spec_token_ids:
                item.seq.add_pending_token()
        verified = sum(1 + len(s.spec_token_ids) for s in sched.scheduled if s.spec_token_ids)
        stats.num_prefill_tokens = sched.num_tokens - sched.num_decodes - verified
        stats.num_decode_tokens = sched.num_decodes + verified
        stats.num_spec_proposed = sum(len(s.spec_token_ids) for s in sched.scheduled)
        stats.draft_s = t_draft - t1
        stats.rows_s = t_rows - t_draft
        stats.mask_s = t_mask - t_rows if masked else 0.0
        stats.prepare_s, stats.forward_s = launched.prepare_s, launched.forward_s
        stats.sample_s = launched.sample_s
        previous = self._inflight
        self._inflight = _InFlight(sched, launched, self.async_scheduling and self._overlappable(sched))
        if previous is not None:
            stats.overlapped = True
            outputs.extend(self._apply(previous, stats))
        if not self._inflight.overlappable:
            outputs.extend(self._apply_inflight(stats))
        return StepResult(outputs, stats)

    @staticmethod
    def _overlappable(sched: SchedulerOutput) -> bool:
        return not any(
            s.spec_token_ids or s.seq.grammar is not None or s.seq.params.has_penalties
            for s in sched.scheduled
            if s.samples
        )

    def _apply_inflight(self, stats: StepStats) -> list[RequestOutput]:
        inflight, self._inflight = self._inflight, None
        return self._apply(inflight, stats)

    def _apply(self, inflight: _InFlight, stats: StepStats) -> list[RequestOutput]:
        """Wait for a launched step's picks and apply them."""
        result = inflight.launched.result()
        started = time.perf_counter()
        outputs, accepted = self._update(inflight.sched, result.sampler_output)
        stats.wait_s += result.wait_s
        stats.num_spec_accepted += accepted
        stats.update_s += time.perf_counter() - started
        return outputs

    def _propose(self) -> None:
        """Speculative decoding: proposals for each sequence about to decode, unless the batch is larger
        than speculative_max_batch (it then keeps the device busy without them). A proposal never runs
        past max_tokens or max_model_len, counting the token its verification adds. The draft model
        proposes after scheduling, into the cache slots the scheduler reserves: here it gets placeholders
        that say how many it may propose."""
        config = self.config
        decoding = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        method = config.speculative_method
        speculate = method != "none" and len(decoding) <= config.speculative_max_batch
        for seq in decoding:
            room = min(
                config.num_speculative_tokens,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                config.max_model_len - seq.num_tokens,
            )
            if not speculate or room <= 0:
                seq.spec_token_ids = []
            elif method == "ngram":
                proposal = propose_ngram(seq.token_ids, room)
                if seq.grammar is not None:  # what the constraint rejects could never be accepted
                    proposal = proposal[: seq.grammar.valid_prefix(proposal)]
                seq.spec_token_ids = proposal
            else:
                seq.spec_token_ids = [DRAFT_PLACEHOLDER] * room

    def _sampling_rows(self, item: ScheduledSequence) -> list[SamplingRow]:
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
                eos = () if params.ignore_eos or seq.grammar is not None else tuple(self.eos_token_ids)
                banned = eos + tuple(params.stop_token_ids)
            output = (
                seq.output_token_ids + spec[:j] if j else TokenSlice(seq.token_ids, seq.num_prompt_tokens)
            )
            rows.append(SamplingRow(params, seq.prompt_token_ids, output, banned))
        return rows

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose constraint compiled, each with its own matcher (advanced past the
        tokens a resumed request brought); refuse those whose constraint failed or ran out of time."""
        refused = []
        now = time.monotonic()
        for request_id, (seq, future, deadline) in list(self._compiling.items()):
            if not future.done() and now < deadline:
                continue
            del self._compiling[request_id]
            error = None
            if not future.done():
                error = (
                    f"SamplingParams.{seq.params.constraint[0]} did not compile within grammar_compile_timeout_s "
                    f"= {self.config.grammar_compile_timeout_s} s"
                )
            elif future.exception() is not None:
                error = str(future.exception())
            else:
                seq.grammar = Grammar(future.result())
                if not seq.grammar.consume(seq.output_token_ids):
                    error = f"output_token_ids do not match the request's constraint: {seq.grammar.error}"
            if error is None:
                self.scheduler.add(seq)
                continue
            del self.requests[request_id]
            seq.transition(SequenceStatus.FINISHED_ABORTED)
            log.info("request_refused", request_id=request_id, error=error[:300])
            refused.append(RequestOutput(request_id, [], None, error=error))
        return refused

    def _constrain(self, sched: SchedulerOutput, rows: list[SamplingRow]) -> bool:
        """Give the rows of constrained requests their token bitmasks; False when no row is constrained.
        Row j of a request with proposals is masked as if its first j proposals had been accepted. Rows
        after a proposal the constraint rejects keep no mask: their picks are never kept, since the pick at
        that proposal cannot equal it."""
        entries, offsets, offset = [], [], 0
        for item in sched.scheduled:
            item.seq.timeline.on_step(sampled=item.samples)
            if not item.samples:
                continue
            grammar = item.seq.grammar
            if grammar is not None:
                spec = item.spec_token_ids
                entries.append((grammar, spec[: grammar.valid_prefix(spec)]))
                offsets.append(offset)
            offset += 1 + len(item.spec_token_ids)
        if not entries:
            return False
        if self._masks is None:
            self._masks = MaskFiller(self.model_config.vocab_size, torch.get_num_threads())
        bitmask = self._masks.fill(entries)
        row = 0
        for (_, accepted), offset in zip(entries, offsets):
            for j in range(1 + len(accepted)):
                rows[offset + j].token_bitmask = bitmask[row]
                row += 1
        return True

    def _update(self, sched: SchedulerOutput, sampler_out: SamplerOutput) -> tuple[list[RequestOutput], int]:
        """Apply a step: new tokens in the places their sequences held, finished requests, blocks for the
        prefix cache. Also returns how many proposals were accepted. A sequence that ended while the step
        ran (its previous step finished it, or it was aborted) has its picks discarded."""
        outputs = []
        accepted = 0
        picks = iter(zip(sampler_out.token_ids, sampler_out.logprobs))  # the sampler's rows, in order
        for item in sched.scheduled:
            seq, spec = item.seq, item.spec_token_ids
            if not item.samples:
                if seq.status is SequenceStatus.RUNNING:
                    self.block_manager.cache_full_blocks(seq)
                continue
            drawn = [next(picks) for _ in range(len(spec) + 1)]
            if seq.status.finished:
                continue
            new_tokens: list[int] = []
            new_logprobs: list[TokenLogprobs] = []
            status = None
            # Keep each pick while the one before it was the proposal it was computed after: picks past
            # the first rejected proposal were computed after a token the request does not have.
            for j, (token, logprob) in enumerate(drawn):
                if spec:
                    seq.token_ids.append(token)
                else:
                    seq.resolve_pending_token(token)
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
            if spec:
                # The KV of accepted proposals is kept; the cache slots after them are overwritten later.
                seq.num_computed_tokens = seq.num_tokens - 1
                seq.num_draft_tokens = min(seq.num_draft_tokens, seq.num_tokens - 1)
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)
            if status is not None:
                seq.drop_pending_tokens()
                self.scheduler.finish(seq, status)
                del self.requests[seq.request_id]
            outputs.append(self._output(seq, new_tokens, new_logprobs))
        return outputs, accepted

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
        if not seq.grammar.consume([token]):
            # The mask allowed only tokens that min_tokens or stop_token_ids banned; nothing can follow.
            log.warning(
                "constraint_rejected_token", request_id=seq.request_id, token=token, error=seq.grammar.error
            )
            return SequenceStatus.FINISHED_STOPPED
        return SequenceStatus.FINISHED_STOPPED if seq.grammar.is_stopped else None

    @staticmethod
    def _output(
        seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs] | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            finish_reason=seq.finish_reason,
            new_logprobs=logprobs or [],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens - seq.num_pending_tokens,
            timeline=seq.timeline if seq.finish_reason is not None else None,
        )
