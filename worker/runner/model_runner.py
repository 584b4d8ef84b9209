"""Executes a SchedulerOutput: builds the step's input tensors, runs the model, samples new tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import torch

from nanovllm.common.errors import AdapterError
from nanovllm.common.logging import get_logger
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.models.lora_adapter import LoRAAdapter, read_adapter
from nanovllm.worker.runner.build import ModelRunnerBase
from nanovllm.worker.runner.inputs import first_rows
from nanovllm.worker.runner.lora_slots import BASE_ROW, lora_batch
from nanovllm.worker.sample.pooling import pool
from nanovllm.worker.sample.sampler import SampledBatch
from nanovllm.worker.sample.scoring import PromptScorer, slice_rows
from nanovllm.worker.sequence import TokenLogprobs
from nanovllm.worker.step import (
    HeadPass,
    KVLoad,
    KVTransfers,
    ModelRunnerOutput,
    SamplerOutput,
    SamplingRow,
    ScheduledSequence,
    SchedulerOutput,
    StepInputs,
)

log = get_logger(__name__)


@dataclass
class LaunchedStep:
    """A step queued on the device, its picks on their way to the host: `result()` waits for them. On a
    CPU everything has run by the time `launch` returns."""

    sampled: SampledBatch | None  # None: no row picks a token (prompt chunks short of their end)
    prepare_s: float
    forward_s: float
    sample_s: float
    kv_failed_loads: list[KVLoad] = field(default_factory=list)
    kv_failed_writes: list[int] = field(default_factory=list)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)

    def result(self) -> ModelRunnerOutput:
        started = time.perf_counter()
        output = self.sampled.result() if self.sampled is not None else SamplerOutput([], [])
        wait_s = time.perf_counter() - started
        return ModelRunnerOutput(
            output, self.kv_failed_loads, self.kv_failed_writes, self.prompt_logprobs, self.pooled,
            self.prepare_s, self.forward_s, self.sample_s, wait_s,
        )  # fmt: skip


class ModelRunner(ModelRunnerBase):
    """Runs one step at a time: lays the scheduled step out as the model's inputs, runs the model on
    every tensor-parallel rank, and queues the sampler's picks (worker/runner/build.py builds the rest)."""

    def __init__(self, config: EngineConfig, tp: TPContext | None = None) -> None:
        # The last launched step's picks on the device, and each sampling sequence's row in them.
        self._picks: tuple[torch.Tensor, dict[int, int]] | None = None
        # What the last step's copies to and from the lower tiers left undone: loads (on any rank), writes.
        self._kv_failures: tuple[list[KVLoad], list[int]] = ([], [])
        self._prompt_logprobs: dict[int, list[TokenLogprobs]] = {}  # the last step's, by seq_id
        self._pooled: dict[int, torch.Tensor] = {}  # the last step's pooling results, by seq_id
        super().__init__(config, tp)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, rows: list[SamplingRow]) -> LaunchedStep:
        """Queue one step on the device without waiting for it. A sequence's pending token (the pick of
        the step launched before this one, Sequence.num_pending_tokens) is taken from that step's picks on
        the device."""
        t0 = time.perf_counter()
        if not sched.scheduled:  # only copies to and from the lower tiers
            self.forward(StepInputs([], [], [], [], [], [], [], kv_transfers=sched.kv_transfers))
            return LaunchedStep(
                None, 0.0, time.perf_counter() - t0, 0.0, *self._kv_failures, self._prompt_logprobs
            )
        inputs = self.step_inputs(sched, all_logits=False)
        plan = self.sampler.plan(rows)
        t1 = time.perf_counter()
        logits = self.forward(inputs, first_rows(sched) if self.mtp is not None else None)
        t2 = time.perf_counter()
        if logits is None:
            self._picks = None
            return LaunchedStep(
                None, t1 - t0, t2 - t1, 0.0, *self._kv_failures, self._prompt_logprobs, self._pooled
            )
        sampled = self.sampler.sample(logits, plan)
        # Each sampling sequence's last row is its pick (the one after any accepted proposals).
        last_rows, row = {}, -1
        for item in sched.scheduled:
            if item.samples:
                row += 1 + len(item.spec_token_ids)
                last_rows[item.seq.seq_id] = row
        self._picks = (sampled.token_ids, last_rows)
        return LaunchedStep(
            sampled, t1 - t0, t2 - t1, time.perf_counter() - t2, *self._kv_failures, self._prompt_logprobs,
            self._pooled,
        )  # fmt: skip

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, mtp_rows: list[tuple[ScheduledSequence, int]] | None = None
    ) -> torch.Tensor | None:
        """The step's copies to and from the lower tiers, then the model on its inputs, on every
        tensor-parallel rank: fp32 logits of the requested rows, or None when no row is requested (a prompt
        chunk that does not reach its end, or a step of copies only). With `mtp_rows` (each scheduled
        sequence and its first row), the multi-token-prediction head follows the model over the step's
        hidden states (worker/sample/mtp.py), last: its passes are collectives of their own, which the other
        ranks join after the step's."""
        if self.cpu_share is not None:
            self.cpu_share.refresh()
        try:
            if inputs.image_rows:  # the tower (rank 0's) before the step goes to the other ranks
                if self.images is None:
                    raise RuntimeError("a step carries images for a model without a vision tower")
                inputs.image_embeddings = self.images.splice(inputs.image_rows, self.dtype)
            if self.tp_group is not None:
                self.tp_group.send(inputs)
            self._prompt_logprobs, self._pooled = {}, {}
            if self.kv_offload is not None:
                self._kv_failures = self._copy_kv(inputs.kv_transfers)
            elif inputs.kv_transfers:
                raise RuntimeError("a step copies KV blocks to or from lower tiers this engine has none of")
            if not inputs.input_ids:
                return None
            input_ids, positions, meta, logits_index = self.inputs.tensors(inputs)
            self._take_pending(input_ids, inputs)
            if self.tp.rank > 0:  # rank 0 filled these slots as it laid the step out
                for slot, name, path in inputs.lora_fills:
                    assert self.adapter_slots is not None  # rank 0 fills slots of a model with them
                    self.adapter_slots.put(slot, self.read_adapter(name, path))
            splice = None
            if inputs.mrope_positions:  # a step with images: 3-D RoPE positions, the tower's tokens
                positions = self.inputs.long(inputs.mrope_positions).view(3, -1)
            if inputs.image_embeddings is not None:
                embedded = inputs.image_embeddings
                splice = (self.inputs.long(embedded.rows), embedded.embeddings.to(self.device))
            graphs = self.decode_graphs
            bucket = graphs.bucket(inputs) if graphs is not None and not inputs.mrope_positions else None
            if graphs is not None and bucket is not None:
                lora_slots = self.inputs.long(inputs.lora_slots) if inputs.lora_slots else None
                hidden = graphs.run(input_ids, positions, meta, bucket, lora_slots)
            else:
                if self.lora is not None:
                    self.lora.batch = lora_batch(
                        inputs.lora_slots, self.lora.num_slots, self.inputs.long, self.dtype
                    )
                hidden = self.model(input_ids, positions, meta, splice)
            if inputs.prompt_rows:
                self._prompt_logprobs = self._score_prompts(hidden, inputs)
            if inputs.pooling:
                self._pooled = pool(hidden, inputs.pooling, self.model, self.inputs.long)
            logits = None
            if inputs.logits_index:
                rows = hidden
                if inputs.logits_index != list(range(len(inputs.input_ids))):
                    rows = hidden.index_select(0, logits_index)
                logits = self.model.compute_logits(rows).float()
            if self.mtp is not None and mtp_rows is not None:
                self.mtp.absorb(mtp_rows, hidden, self.inputs.tensors)
            return logits
        except RuntimeError as exc:  # a collective failed: say which rank went away, if one did
            if self.tp_group is not None:
                self.tp_group.raise_if_dead(exc)
            raise

    @torch.inference_mode()
    def head_pass(self, head_pass: HeadPass) -> None:
        """Ranks 1..N-1: run a pass of the multi-token-prediction head that rank 0 sent."""
        if self.mtp is None:
            raise RuntimeError("a pass of the multi-token-prediction head reached a rank without the head")
        try:
            self.mtp.run_pass(head_pass, self.inputs.tensors)
        except RuntimeError as exc:
            if self.tp_group is not None:
                self.tp_group.raise_if_dead(exc)
            raise

    def hidden_layout(self) -> tuple[int, torch.dtype, torch.device]:
        """Hidden size, dtype and device of the model's hidden states (a HeadPass's rows, a step's image
        embeddings)."""
        return self.config.model_config.hidden_size, self.dtype, self.device

    def _score_prompts(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[int, list[TokenLogprobs]]:
        """The logprobs of the prompt tokens the step's rows score (worker/sample/scoring.py), their logits
        computed a slice of rows at a time on every rank (the vocabulary is split between them)."""
        scorer = PromptScorer(inputs.prompt_scoring) if self.tp.rank == 0 else None
        step = slice_rows(self.config.model_config.vocab_size)
        for begin in range(0, len(inputs.prompt_rows), step):
            rows = self.inputs.long(inputs.prompt_rows[begin : begin + step])
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
            if scorer is not None:
                scorer.add(logits)
        return scorer.result() if scorer is not None else {}

    def _copy_kv(self, transfers: KVTransfers) -> tuple[list[KVLoad], list[int]]:
        """Make the step's copies to and from the lower tiers (worker/runner/kv_offload.py): the loads
        that failed on any rank (every rank learns them: the request recomputes those blocks), and the
        writes to disk that failed on this one since the last step."""
        loads = transfers.loads
        assert self.kv_offload is not None  # called only with lower tiers
        failed, failed_writes = self.kv_offload.run(transfers)
        if self.tp.size > 1 and loads:
            here = {id(load) for load in failed}
            flags = self.tp.on_any_rank([id(load) in here for load in loads])
            failed = [load for load, flag in zip(loads, flags) if flag]
            self.kv_offload.forget(failed, here)
        return failed, failed_writes

    def _take_pending(self, input_ids: torch.Tensor, inputs: StepInputs) -> None:
        """Write the previous step's picks into `input_ids` (on the device) where `inputs` defers them."""
        if not inputs.deferred:
            return
        if self._picks is None:
            raise RuntimeError("a step defers tokens to the picks of a step that picked none")
        picks, _ = self._picks
        flat_rows, pick_rows = zip(*inputs.deferred)
        flat, rows = self.inputs.long([*flat_rows, *pick_rows]).chunk(2)
        input_ids.index_copy_(0, flat, picks.index_select(0, rows))

    def propose_draft(self, items: list[ScheduledSequence]) -> None:
        """speculative_method=draft or mtp: the draft model's proposals for `items`
        (worker/sample/draft.py), or the multi-token-prediction head's (worker/sample/mtp.py)."""
        if self.mtp is not None:
            try:
                self.mtp.propose(items, self.inputs.tensors)
            except RuntimeError as exc:  # a pass's collective failed: say which rank went away, if one did
                if self.tp_group is not None:
                    self.tp_group.raise_if_dead(exc)
                raise
        elif self.draft is not None:
            self.draft.propose(items, self.inputs.tensors)
        else:
            raise RuntimeError("propose_draft needs speculative_method=draft or mtp")

    def step_inputs(self, sched: SchedulerOutput, all_logits: bool) -> StepInputs:
        """The step as plain integers (worker/runner/inputs.py), pending tokens taken from the last picks,
        each adapter of the step in a LoRA slot, and its copies to and from the lower tiers."""
        picked = self._picks[1] if self._picks is not None else None
        # the engine's adapters are LoRAAdapters (a Sequence types its own by a protocol)
        adapters = [cast(LoRAAdapter, s.seq.adapter) for s in sched.scheduled if s.seq.adapter is not None]
        if not adapters:
            inputs = self.inputs.step_inputs(sched, all_logits, picked)
        else:
            if self.adapter_slots is None:
                raise RuntimeError("a step runs a LoRA adapter on a model built without LoRA slots")
            slots = self.adapter_slots.assign(adapters)
            inputs = self.inputs.step_inputs(
                sched,
                all_logits,
                picked,
                lambda seq: BASE_ROW if seq.adapter is None else slots[cast(LoRAAdapter, seq.adapter)],
            )
            inputs.lora_fills = [
                (slot, adapter.name, adapter.path) for slot, adapter in self.adapter_slots.filled
            ]
        inputs.kv_transfers = sched.kv_transfers
        return inputs

    def read_adapter(self, name: str, path: str) -> LoRAAdapter:
        """A LoRA adapter read and checked against this model (worker/models/lora_adapter.py)."""
        if self.lora is None:
            raise AdapterError(
                "LoRA is off in this engine: start it with --lora NAME=PATH or --max-loras N to load adapters"
            )
        return read_adapter(name, path, self.model, self.lora.max_rank)
