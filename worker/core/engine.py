"""The step-level engine: requests in, one scheduling + model step at a time, token deltas out.

This is the API the worker service drives; `LLM` wraps it for offline use.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.common.errors import AdapterError, DuplicateAdapterError, RequestError, UnknownAdapterError
from nanovllm.common.images import ImagePatches
from nanovllm.common.logging import get_logger
from nanovllm.common.pooling import PoolingParams
from nanovllm.common.request_checks import check_prompt, check_resumed_outputs, check_stop_token_ids
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.core.block_manager import BlockManager
from nanovllm.worker.core.kv_tiers import DiskIndex, KVTiers
from nanovllm.worker.core.recurrent_states import RecurrentStates
from nanovllm.worker.core.scheduler import Scheduler, request_output
from nanovllm.worker.models.lora_adapter import LoRAAdapter
from nanovllm.worker.runner.model_runner import LaunchedStep, ModelRunner
from nanovllm.worker.sample.rows import sampling_rows
from nanovllm.worker.sample.speculation import Proposer
from nanovllm.worker.sample.structured_output import ConstraintQueue, GrammarCompiler
from nanovllm.worker.sequence import ImageInput, Sequence, SequenceStatus
from nanovllm.worker.step import (
    EngineLoad,
    KVTierStats,
    RequestOutput,
    SchedulerOutput,
    StepResult,
    StepStats,
)

log = get_logger(__name__)


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
    """Requests in, one step at a time, token deltas out. Each step admits the requests whose constraint
    compiled, proposes speculative tokens, schedules, launches the model and sampler, and applies the picks
    of the step launched before it: the requests that advanced or finished, and the timings.

    Synchronously, a step is applied in the call that launched it. With async scheduling the engine
    schedules and launches step N+1 before it waits for step N's picks: N+1 takes them on the device, and a
    request that N finished has its row in N+1 discarded. Each sequence holds the place of its pick in
    flight (Sequence.num_pending_tokens), so the scheduler sees what it would see after N."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.kvcache_block_size,
            config.enable_prefix_caching,
            self._lower_tiers(),
            self._recurrent_states(),
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.eos_token_ids,
            config.max_loras or 0,
        )
        self.adapters: dict[str, LoRAAdapter] = {}
        for entry in config.lora_adapters:
            name, _, path = entry.partition("=")
            self.add_lora(name.strip(), path.strip())
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        vocab = self.model_config.vocab_size
        grammars = GrammarCompiler(config.model, vocab, sorted(self.eos_token_ids))
        self.constraints = ConstraintQueue(grammars, vocab, config.grammar_compile_timeout_s)
        self.proposer = Proposer(config)
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto"
            and self.runner.device.type == "cuda"
            and config.tensor_parallel_size == 1
            and config.speculative_method == "none"
            # A hybrid model's state snapshots are published as a step is applied: the next step must not
            # have run yet (worker/core/recurrent_states.py).
            and config.model_config.hybrid is None
        )
        self._inflight: _InFlight | None = None  # a launched step not yet applied (overlapped loop)
        # The step loop, chosen once (vLLM v1's step / step_with_batch_queue). The function, not the bound
        # method: an engine holding its own bound method is a reference cycle, which gc.freeze (below)
        # would keep, with its KV cache, for as long as the process lives after the engine is dropped.
        self._loop: Callable[[LLMEngine], StepResult] = (
            LLMEngine.step_overlapped if self.async_scheduling else LLMEngine.step_synchronous
        )
        _freeze_what_lasts()

    def _lower_tiers(self) -> KVTiers | None:
        """The bookkeeping of the prefix cache's lower tiers, over the host slots and disk files the runner
        made (and the files a previous run left there)."""
        offload = self.runner.kv_offload
        if offload is None or (not offload.host_slots and offload.disk is None):
            return None
        disk = offload.disk
        disk_index = None
        if disk is not None:
            disk_index = DiskIndex(disk.capacity, disk.found, disk.file_bytes, disk.state_nbytes)
        return KVTiers(
            offload.host_slots,
            disk_index,
            offload.block_nbytes,
            offload.host_state_rows,
            offload.state_nbytes,
        )

    def _recurrent_states(self) -> RecurrentStates | None:
        """A hybrid model's state slots and snapshot rows, over the rows the runner allocated."""
        runner, config = self.runner, self.config
        if not runner.num_state_slots:
            return None
        return RecurrentStates(
            runner.num_state_slots,
            runner.num_state_snapshots,
            config.state_snapshot_interval,
            config.kvcache_block_size,
            config.enable_prefix_caching,
            runner.state_rows_per_slot - 1,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        output_token_ids: list[int] | None = None,
        lora_name: str | None = None,
        shared_prefix_tokens: int = 0,
        images: list[ImagePatches] | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request. `output_token_ids` resumes one that generated those tokens elsewhere: it goes on
        after them exactly as if it had produced them here (see Submit.output_token_ids). `lora_name`:
        the loaded LoRA adapter it runs with (None: the base model). `shared_prefix_tokens`: how many of
        the prompt's first tokens other requests likely share (Sequence.shared_prefix_tokens). `images`: a
        vision model's, in prompt order, each in place of its run of placeholder tokens (one per token the
        image takes: common/images.py expand_placeholders). `pooling`: a pooling request (an embedding, a
        rerank score; common/pooling.py): its prompt is computed and its last token's vector is its one
        output (RequestOutput.pooled); `params` samples nothing then."""
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        adapter = None
        if lora_name is not None:
            adapter = self.adapters.get(lora_name)
            if adapter is None:
                loaded = ", ".join(repr(n) for n in self.adapters) or "none"
                raise UnknownAdapterError(f"LoRA adapter {lora_name!r} is not loaded; loaded: {loaded}")
        vocab = self.model_config.vocab_size
        if pooling is not None:
            self._check_pooling(pooling, params, images, output_token_ids)
        elif not self.model_config.has_head:
            raise RequestError(
                f"{self.config.model} is a {self.model_config.architecture} checkpoint without an output head: "
                "it serves embeddings (pooling requests) only, not generation"
            )
        check_prompt(prompt_token_ids, self.config.max_model_len, vocab, generates=pooling is None)
        check_stop_token_ids(params.stop_token_ids, vocab)
        if not 0 <= shared_prefix_tokens <= len(prompt_token_ids):
            raise RequestError(
                f"shared_prefix_tokens is {shared_prefix_tokens}, outside the prompt's "
                f"{len(prompt_token_ids)} tokens"
            )
        placed = self._place_images(prompt_token_ids, images) if images else []
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
            max_num_tokens=len(prompt_token_ids)
            if pooling is not None
            else min(len(prompt_token_ids) + params.max_tokens, self.config.max_model_len),
            adapter=adapter,
            pooling=pooling,
            shared_prefix_tokens=shared_prefix_tokens,
            images=placed,
        )
        self.requests[request_id] = seq
        if params.constraint is None:
            self.scheduler.add(seq)
        else:
            self.constraints.add(seq)

    def _check_pooling(
        self,
        pooling: PoolingParams,
        params: SamplingParams,
        images: list[ImagePatches] | None,
        output_token_ids: list[int] | None,
    ) -> None:
        """A pooling request computes its prompt and nothing more: no sampling options, images or outputs
        apply; a score needs the output head and token ids inside the vocabulary."""
        if params.constraint is not None or params.prompt_logprobs is not None:
            raise RequestError(
                "a pooling request samples nothing: constraints and prompt_logprobs do not apply"
            )
        if images or output_token_ids:
            raise RequestError("a pooling request takes no images and no output_token_ids")
        if pooling.kind == "score":
            if not self.model_config.has_head:
                raise RequestError(
                    f"{self.config.model} is a {self.model_config.architecture} checkpoint without an output "
                    "head: it cannot score (rerank), only embed"
                )
            check_stop_token_ids(pooling.token_ids, self.model_config.vocab_size, field="score token_ids")

    def _place_images(self, prompt: list[int], images: list[ImagePatches]) -> list[ImageInput]:
        """Each image at its run of placeholder tokens, the k-th run for the k-th image, its length the
        image's token count."""
        vision = self.model_config.vision
        if vision is None:
            raise RequestError(f"{self.config.model} has no vision tower: it takes no images")
        token, merge = vision.image_token_id, vision.spatial_merge_size
        runs: list[tuple[int, int]] = []  # (start, length) of each run of placeholder tokens
        for i, tok in enumerate(prompt):
            if tok == token:
                if runs and runs[-1][0] + runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                else:
                    runs.append((i, 1))
        if len(runs) != len(images):
            raise RequestError(
                f"the prompt has {len(runs)} run(s) of image placeholder tokens (id {token}) for {len(images)} "
                "image(s)"
            )
        placed = []
        for k, ((start, length), patches) in enumerate(zip(runs, images)):
            t, h, w = patches.grid_thw
            if length != patches.num_tokens(merge) or t != 1 or h % merge or w % merge:
                raise RequestError(
                    f"image {k}: {length} placeholder tokens for a grid of {t}x{h}x{w} patches "
                    f"({patches.num_tokens(merge)} tokens after the {merge}x{merge} merge)"
                )
            width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
            if patches.pixel_values.shape != (t * h * w, width):
                raise RequestError(
                    f"image {k}: pixel values of shape {patches.pixel_values.shape} for a grid of {t}x{h}x{w} "
                    f"patches of {width} values"
                )
            placed.append(ImageInput(start, length, (h // merge, w // merge), patches))
        return placed

    def add_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load the PEFT adapter in directory `path` under `name`; requests may name it from now on."""
        if not name:
            raise AdapterError("a LoRA adapter needs a name")
        if name in self.adapters:
            raise DuplicateAdapterError(
                f"a LoRA adapter named {name!r} is already loaded (from {self.adapters[name].path})"
            )
        adapter = self.runner.read_adapter(name, path)
        self.adapters[name] = adapter
        log.info("lora_loaded", name=name, path=path, rank=adapter.rank)
        return adapter

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name`: new requests may no longer name it; those already queued or running
        with it finish with it (its weights go once the last of them has)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            loaded = ", ".join(repr(n) for n in self.adapters) or "none"
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded; loaded: {loaded}")
        in_use = sum(1 for seq in self.requests.values() if seq.adapter is adapter)
        if not in_use:
            assert self.runner.adapter_slots is not None  # an adapter was loaded
            self.runner.adapter_slots.release(adapter)
        log.info("lora_unloaded", name=name, requests_finishing_with_it=in_use)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its final output (finish_reason "abort") comes from the next step."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if self.constraints.remove(request_id):  # never scheduled: no blocks
            seq.transition(SequenceStatus.FINISHED_ABORTED)
        else:
            seq.drop_pending_tokens()
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._aborted.append(request_output(seq, []))
        return True

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (joined, never orphaned). No step may follow."""
        self.constraints.shutdown()
        self.runner.shutdown()

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: requests in flight or to report, or copies to the lower tiers that the
        last requests' freed blocks left."""
        return bool(self.requests) or bool(self._aborted) or self.block_manager.has_transfers

    def drain_kv_tiers(self) -> None:
        """Wait for the copies to the lower tiers under way: the disk tier then holds the files it lists."""
        if self.runner.kv_offload is not None:
            self.block_manager.writes_failed(self.runner.kv_offload.drain())

    def load(self) -> EngineLoad:
        bm = self.block_manager
        lower = bm.lower_tiers.num_blocks if bm.lower_tiers is not None else {"host": 0, "disk": 0}
        snapshots = bm.states.num_snapshots_held if bm.states is not None else 0
        return EngineLoad(
            num_waiting=len(self.scheduler.waiting) + len(self.constraints),
            num_running=len(self.scheduler.running),
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            kv_host_blocks=lower["host"],
            kv_disk_blocks=lower["disk"],
            kv_tiers=self._tier_stats(lower),
            state_snapshot_rows=bm.states.num_snapshots if bm.states is not None else 0,
            state_snapshots=snapshots,
            state_snapshot_bytes=snapshots * self.runner.state_row_bytes,
        )

    def _tier_stats(self, blocks: dict[str, int]) -> dict[str, KVTierStats]:
        tiers = self.block_manager.lower_tiers
        if tiers is None:
            return {}
        offload = self.runner.kv_offload
        assert offload is not None  # the runner's with lower tiers
        stats = {}
        for tier, counts in tiers.counts.items():
            times = offload.stats[tier]
            stats[tier] = KVTierStats(
                blocks[tier], counts.hits, counts.bytes_down, counts.bytes_up, times.seconds_down,
                times.seconds_up, dict(times.faults.counts),
            )  # fmt: skip
        return stats

    def step(self) -> StepResult:
        """One step of the loop chosen at construction: step_synchronous, or step_overlapped."""
        return self._loop(self)

    def step_synchronous(self) -> StepResult:
        """Admit, propose, schedule, launch one step and apply its picks."""
        outputs, stats, started = self._begin()
        self.proposer.propose(self.scheduler.running)
        sched = self._schedule(stats, started)
        if sched.is_empty:
            return self._idle(outputs, stats)
        outputs += self._apply(self._execute(sched, stats), stats)
        return StepResult(outputs, stats)

    def step_overlapped(self) -> StepResult:
        """Admit, propose, schedule and launch step N+1, then apply step N's picks: N+1 takes them on the
        device (see the class docstring). A step whose sequences need their picks on the host first
        (penalties, constraints, proposals) is applied before the next is scheduled."""
        outputs, stats, started = self._begin()
        if self._inflight is not None and not self._inflight.overlappable:
            outputs += self._update(stats)
        self.proposer.propose(self.scheduler.running)
        sched = self._schedule(stats, started)
        if sched.is_empty:
            if self._inflight is not None:
                outputs += self._update(stats)
                return StepResult(outputs, stats)
            return self._idle(outputs, stats)
        previous, self._inflight = self._inflight, self._execute(sched, stats)
        if previous is not None:
            stats.overlapped = True
            outputs += self._apply(previous, stats)
        if not self._inflight.overlappable:
            outputs += self._update(stats)
        return StepResult(outputs, stats)

    def _begin(self) -> tuple[list[RequestOutput], StepStats, float]:
        """A step's first outputs (requests aborted since the last step, constraints refused), its stats,
        and when it started."""
        outputs, self._aborted = self._aborted, []
        stats, started = StepStats(), time.perf_counter()
        return outputs + self._admit(), stats, started

    def _schedule(self, stats: StepStats, started: float) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        stats.schedule_s = time.perf_counter() - started - stats.update_s - stats.wait_s
        return sched

    def _idle(self, outputs: list[RequestOutput], stats: StepStats) -> StepResult:
        """Nothing to run: wait for a constraint to compile unless there is something to report."""
        if len(self.constraints) and not outputs:
            self.constraints.wait()
        return StepResult(outputs, stats)

    def _admit(self) -> list[RequestOutput]:
        """Schedule the requests whose constraint compiled; refuse those whose constraint did not."""
        ready, refused = self.constraints.admit()
        for seq in ready:
            self.scheduler.add(seq)
        for seq, error in refused:
            del self.requests[seq.request_id]
            seq.transition(SequenceStatus.FINISHED_ABORTED)
            log.info("request_refused", request_id=seq.request_id, error=error[:300])
        return [RequestOutput(seq.request_id, [], None, error=error) for seq, error in refused]

    def _execute(self, sched: SchedulerOutput, stats: StepStats) -> _InFlight:
        """Launch a scheduled step: the draft model's proposals, the sampler's rows and their masks, then
        the forward pass and the sampler, queued on the device."""
        t0 = time.perf_counter()
        drafting = [s for s in sched.scheduled if s.spec_token_ids]
        if self.config.speculative_method in ("draft", "mtp") and drafting:
            self.runner.propose_draft(drafting)
        t_draft = time.perf_counter()
        rows = sampling_rows(sched, self.eos_token_ids)
        t_rows = time.perf_counter()
        masked = self.constraints.fill_masks(sched, rows)
        t_mask = time.perf_counter()
        launched = self.runner.launch(sched, rows)
        self.scheduler.on_launch(sched)
        proposed = sum(len(s.spec_token_ids) for s in drafting)
        verified = len(drafting) + proposed
        stats.num_prefill_tokens = sched.num_tokens - sched.num_decodes - verified
        stats.num_decode_tokens = sched.num_decodes + verified
        stats.num_spec_proposed = proposed
        stats.draft_s = t_draft - t0
        stats.rows_s = t_rows - t_draft
        stats.mask_s = t_mask - t_rows if masked else 0.0
        stats.prepare_s, stats.forward_s = launched.prepare_s, launched.forward_s
        stats.sample_s = launched.sample_s
        return _InFlight(sched, launched, self.async_scheduling and self._overlappable(sched))

    @staticmethod
    def _overlappable(sched: SchedulerOutput) -> bool:
        if sched.loading:  # the requests it loads run from where their loads got to
            return False
        if any(s.pools for s in sched.scheduled):  # its result finishes the request before the next step
            return False
        return not any(
            s.spec_token_ids or s.seq.grammar is not None or s.seq.params.has_penalties
            for s in sched.scheduled
            if s.samples
        )

    def _update(self, stats: StepStats) -> list[RequestOutput]:
        """Wait for the step in flight and apply its picks."""
        inflight, self._inflight = self._inflight, None
        assert inflight is not None  # called with a step in flight
        return self._apply(inflight, stats)

    def _apply(self, inflight: _InFlight, stats: StepStats) -> list[RequestOutput]:
        """Wait for a launched step's picks and apply them (Scheduler.update_from_output)."""
        result = inflight.launched.result()
        started = time.perf_counter()
        outputs, accepted = self.scheduler.update_from_output(inflight.sched, result)
        for out in outputs:
            if out.finish_reason is not None:
                del self.requests[out.request_id]
        stats.wait_s += result.wait_s
        stats.num_spec_accepted += accepted
        stats.update_s += time.perf_counter() - started
        return outputs
