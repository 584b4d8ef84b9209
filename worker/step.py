"""The step's contract: the plain data that crosses the worker's rooms in one step.

The scheduler (core/) hands the runner a SchedulerOutput; the runner (runner/) turns it into StepInputs,
runs the model and gives the sampler (sample/) one SamplingRow per token to pick; the picks come back as a
SamplerOutput in a ModelRunnerOutput, and the scheduler applies them into RequestOutputs, with the step's
StepStats beside them. Nothing here has behaviour beyond packing itself for the tensor-parallel ranks, so
every room can import it. The types made once per row of a step are slotted: at batch 256 a step makes
a thousand of them, and a slotted instance is built and read faster than one with a __dict__.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.device import host_tensor
from nanovllm.worker.sequence import FinishReason, ImageInput, RequestTimeline, Sequence, TokenLogprobs


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens when scheduled)
    num_new_tokens: int
    # Proposed tokens computed after the sequence's last one (counted in num_new_tokens), to be verified.
    spec_token_ids: list[int] = field(default_factory=list)
    # A hybrid model's state (Sequence.state_slot): the snapshot row it starts from (a prefix-cache hit;
    # -1: none), and (position, snapshot row) where the step keeps a copy of it, at block boundaries the
    # chunk reaches (worker/core/block_manager.py decides both).
    state_restore: int = -1
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # True when this chunk reaches the end of the sequence's tokens as scheduled, so its last logits pick a
    # new token (with proposals: the logits at the last token and at each proposal pick one each). Fixed
    # here: the step appends its pick's place to the sequence when it is launched.
    samples: bool = field(init=False)
    # True instead when the sequence is a pooling request: its last token's vector is its result.
    pools: bool = field(init=False)

    def __post_init__(self) -> None:
        ends = self.start + self.num_new_tokens - len(self.spec_token_ids) == len(self.seq.token_ids)
        self.pools = ends and self.seq.pooling is not None
        self.samples = ends and not self.pools


@dataclass(slots=True)
class KVStore:
    """A cached device block freed this step, copied down: into host slot `host_slot` (-1: no host tier)
    and, with `to_disk`, on into the disk tier's file of `block_hash`."""

    block_id: int
    block_hash: int
    host_slot: int
    to_disk: bool


@dataclass(slots=True)
class StateStore:
    """A hybrid model's state snapshot in device row `row`, evicted from the device's snapshots, copied
    down beside the block of `block_hash` (the block it ends) that a lower tier holds: into host state row
    `host_row` (-1: not into host memory) and, with `to_disk`, into that block's disk file."""

    row: int
    block_hash: int
    host_row: int
    to_disk: bool


@dataclass(slots=True)
class KVLoad:
    """The block of `block_hash` copied up into device block `block_id`: from host slot `host_slot`, or
    from its disk file when that is -1. A hybrid model's hit that resumes at this block brings the state
    snapshot kept with it into device row `state_row` (-1: none), from host state row `host_state_row`
    (host memory's) or from the same disk file."""

    block_hash: int
    block_id: int
    host_slot: int
    state_row: int = -1
    host_state_row: int = -1


@dataclass
class KVTransfers:
    """The copies between the device cache and the prefix cache's lower tiers that the block manager
    decided since the last step (worker/core/kv_tiers.py). Every rank makes them before the step's
    forward pass, in this order: the stores (which read device blocks freed since), the state stores (a
    hybrid model's snapshot rows, read before this step's loads and forward pass write them again), the
    deletions of disk files the disk tier evicted, the fences (device blocks about to be written again wait
    for their copy down), the loads."""

    stores: list[KVStore] = field(default_factory=list)
    fences: list[int] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    disk_drops: list[int] = field(default_factory=list)
    state_stores: list[StateStore] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.fences or self.loads or self.disk_drops or self.state_stores)

    def pack(self) -> list[int]:
        """[counts..., (block, hash, slot, to_disk) per store, fences, (hash, block, slot, state row, host
        state row) per load, drops, (row, hash, host row, to_disk) per state store] (a hash is an unsigned
        64-bit integer: packed as the signed one of the same bits)."""
        values = [len(self.stores), len(self.fences), len(self.loads), len(self.disk_drops)]
        values.append(len(self.state_stores))
        for s in self.stores:
            values += [s.block_id, _signed(s.block_hash), s.host_slot, int(s.to_disk)]
        values += self.fences
        for load in self.loads:
            values += [_signed(load.block_hash), load.block_id, load.host_slot]
            values += [load.state_row, load.host_state_row]
        values += [_signed(h) for h in self.disk_drops]
        for st in self.state_stores:
            values += [st.row, _signed(st.block_hash), st.host_row, int(st.to_disk)]
        return values

    @classmethod
    def unpack(cls, values: list[int]) -> tuple[KVTransfers, int]:
        """The transfers packed at the start of `values`, and how many values they took."""
        ns, nf, nl, nd, nss = values[:5]
        pos = 5
        stores = []
        for _ in range(ns):
            block_id, block_hash, slot, to_disk = values[pos : pos + 4]
            stores.append(KVStore(block_id, _unsigned(block_hash), slot, bool(to_disk)))
            pos += 4
        fences = values[pos : pos + nf]
        pos += nf
        loads = []
        for _ in range(nl):
            block_hash, block_id, slot, state_row, host_state_row = values[pos : pos + 5]
            loads.append(KVLoad(_unsigned(block_hash), block_id, slot, state_row, host_state_row))
            pos += 5
        drops = [_unsigned(h) for h in values[pos : pos + nd]]
        pos += nd
        state_stores = []
        for _ in range(nss):
            row, block_hash, host_row, to_disk = values[pos : pos + 4]
            state_stores.append(StateStore(row, _unsigned(block_hash), host_row, bool(to_disk)))
            pos += 4
        return cls(stores, fences, loads, drops, state_stores), pos


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


@dataclass(slots=True)
class LoadingSequence:
    """A request admitted with prefix hits in the lower tiers: the step copies the blocks of
    `block_hashes` up (its KVTransfers' loads), and the request computes from the next step on."""

    seq: Sequence
    block_hashes: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # decodes (one token) first, then chunks (prefill, or verification)
    num_decodes: int
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)
    loading: list[LoadingSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to copy."""
        return not self.scheduled and not self.kv_transfers


@dataclass(slots=True)
class SeqChunk:
    """The tokens [start, start + num_new_tokens) of one sequence, and the cache blocks they attend to."""

    start: int
    num_new_tokens: int
    block_table: list[int]  # the blocks up to this chunk's end
    # A hybrid model's: the sequence's slot in the linear layers' state (Sequence.state_slot), the snapshot
    # row copied into it before the chunk (-1: none), and (tokens into the chunk, snapshot row) where the
    # state after those tokens is copied to.
    state_slot: int = -1
    state_restore: int = -1
    state_saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class PromptScoring:
    """Rows of a step whose logits score a sequence's prompt (SamplingParams.prompt_logprobs): the k-th
    scores the next prompt token not scored yet after k others, `targets[k]`, with `num_top`
    alternatives."""

    seq_id: int
    targets: list[int]
    num_top: int


@dataclass(slots=True)
class PoolingRow:
    """Row `row` of a step is the last prompt token of sequence `seq_id`, a pooling request: its result is
    the row's final hidden state (`token_ids` empty) or the output head's logits of `token_ids` there
    (common/pooling.py)."""

    seq_id: int
    row: int
    token_ids: list[int]


@dataclass(slots=True)
class ImageRows:
    """Rows [row, row + count) of a step are tokens [first, first + count) of `image`'s tokens."""

    image: ImageInput
    row: int
    first: int
    count: int


@dataclass
class ImageEmbeddings:
    """A step's image tokens as the language model reads them: rows `rows` of the step take `embeddings`
    (one row each, in the model's dtype) in place of their placeholders' embeddings. Rank 0 makes them
    from the step's ImageRows (worker/runner/images.py: the tower and its encoder cache, rank 0's alone)
    and sends them to the other tensor-parallel ranks beside the packed step."""

    rows: list[int]
    embeddings: torch.Tensor


@dataclass
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    # Laid out in this order in the flat token arrays: decodes, then fresh prompts, then continuing chunks.
    decodes: list[SeqChunk]
    fresh: list[SeqChunk]
    cached: list[SeqChunk]
    logits_index: list[int]  # rows of the flat arrays whose logits are computed (sampled or inspected)
    # (row of input_ids, row of the previous step's picks): tokens still on the device, written there
    # before the forward pass (overlapped scheduling); input_ids holds a placeholder at those rows.
    deferred: list[tuple[int, int]] = field(default_factory=list)
    # Each row's LoRA slot (-1: the base model), or empty when no row has an adapter.
    lora_slots: list[int] = field(default_factory=list)
    # (slot, name, path) of each adapter rank 0 put into a slot for this step: the other tensor-parallel
    # ranks read it and fill the same slot with their share.
    lora_fills: list[tuple[int, str, str]] = field(default_factory=list)
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)
    # Rows of the flat arrays whose logits score prompt tokens (every rank computes them: the vocabulary
    # is split between the ranks), and, on rank 0 alone, what each sequence's rows score.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_scoring: list[PromptScoring] = field(default_factory=list)
    # A step with a sequence that has images (a vision model's): every row's temporal, then height, then
    # width RoPE position (3 x len(input_ids) values), and the rows that are image tokens (rank 0's: the
    # images themselves). Empty: text only, `positions` turn RoPE.
    mrope_positions: list[int] = field(default_factory=list)
    image_rows: list[ImageRows] = field(default_factory=list)
    # The image rows' embeddings, which rank 0 makes before the forward pass and every rank reads (their
    # rows travel packed, their embeddings beside: see TensorParallelGroup.send).
    image_embeddings: ImageEmbeddings | None = None
    # The rows whose vector a pooling request returns (every rank computes them: a score's head rows are
    # split between the ranks).
    pooling: list[PoolingRow] = field(default_factory=list)

    def pack(self) -> torch.Tensor:
        """[counts..., input_ids, positions, slot_mapping, (start, n, state slot, restore, saves, *saves, len,
        *table) per chunk, logits_index,
        lora_slots, the UTF-8 bytes of lora_fills as JSON, prompt_rows, (seq_id, row, len, *token_ids) per
        pooling row, mrope_positions, the image embeddings' rows, kv_transfers] (not prompt_scoring nor
        image_rows: rank 0's; not the image embeddings' values: a tensor sent beside)"""
        if self.deferred:
            raise RuntimeError("a step whose tokens are still on rank 0's device cannot go to other ranks")
        if self.image_rows and self.image_embeddings is None:
            raise RuntimeError("a step with images goes to other tensor-parallel ranks with their embeddings")
        groups = (self.decodes, self.fresh, self.cached)
        fills = list(json.dumps(self.lora_fills).encode()) if self.lora_fills else []
        values = [len(self.input_ids), *(len(g) for g in groups), len(self.logits_index)]
        values += [len(self.lora_slots), len(fills)]
        values += self.input_ids + self.positions + self.slot_mapping
        for group in groups:
            for chunk in group:
                values += [chunk.start, chunk.num_new_tokens, chunk.state_slot, chunk.state_restore]
                values += [len(chunk.state_saves), *(v for save in chunk.state_saves for v in save)]
                values += [len(chunk.block_table), *chunk.block_table]
        values += self.logits_index + self.lora_slots + fills + [len(self.prompt_rows), *self.prompt_rows]
        values.append(len(self.pooling))
        for p in self.pooling:
            values += [p.seq_id, p.row, len(p.token_ids), *p.token_ids]
        image_rows = self.image_embeddings.rows if self.image_embeddings is not None else []
        values += [len(self.mrope_positions), *self.mrope_positions, len(image_rows), *image_rows]
        values += self.kv_transfers.pack()
        return host_tensor(values)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> StepInputs:
        values = packed.tolist()
        n, nd, nf, nc, nl, ns, nb = values[:7]
        pos = 7

        def take(count: int) -> list[int]:
            nonlocal pos
            pos += count
            return values[pos - count : pos]

        input_ids, positions, slot_mapping = take(n), take(n), take(n)
        groups: list[list[SeqChunk]] = []
        for count in (nd, nf, nc):
            chunks = []
            for _ in range(count):
                start, num_new, state_slot, restore, num_saves = take(5)
                flat = take(2 * num_saves)
                saves = list(zip(flat[::2], flat[1::2]))
                (table_len,) = take(1)
                chunks.append(SeqChunk(start, num_new, take(table_len), state_slot, restore, saves))
            groups.append(chunks)
        logits_index, lora_slots, fills = take(nl), take(ns), take(nb)
        lora_fills = [tuple(fill) for fill in json.loads(bytes(fills))] if fills else []
        (num_prompt_rows,) = take(1)
        prompt_rows = take(num_prompt_rows)
        pooling = []
        for _ in range(take(1)[0]):
            seq_id, row, num_ids = take(3)
            pooling.append(PoolingRow(seq_id, row, take(num_ids)))
        mrope = take(take(1)[0])
        image_rows = take(take(1)[0])
        # the embeddings' values follow the packed step (TensorParallelGroup.send): filled in as they arrive
        embeddings = ImageEmbeddings(image_rows, torch.empty(0)) if image_rows else None
        kv_transfers, _ = KVTransfers.unpack(values[pos:])
        decodes, fresh, cached = groups
        return cls(
            input_ids, positions, slot_mapping, decodes, fresh, cached, logits_index=logits_index,
            lora_slots=lora_slots,
            lora_fills=lora_fills, kv_transfers=kv_transfers, prompt_rows=prompt_rows, pooling=pooling,
            mrope_positions=mrope, image_embeddings=embeddings,
        )  # fmt: skip


@dataclass
class HeadPass:
    """One pass of the multi-token-prediction head (worker/sample/mtp.py), which every tensor-parallel rank
    runs on its share of the head: the pass's tokens and cache slots, and the hidden state each row reads
    (the model's final one at the row's position or, drafting further, the head's own), rank 0's, sent
    beside the packed inputs (the other ranks hold no record of which rows of which step those were)."""

    inputs: StepInputs
    hidden: torch.Tensor


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch: everything the sampler needs to know about its request."""

    params: SamplingParams
    prompt_token_ids: SequenceABC[int]
    output_token_ids: SequenceABC[int]
    # Logits forced to -inf this step (e.g. EOS/stop ids while below min_tokens).
    banned_token_ids: SequenceABC[int] = ()
    # Structured output: int32 [ceil(vocab / 32)], bit t % 32 of word t // 32 set where token t is allowed
    # (worker/sample/structured_output.py); None: every token is.
    token_bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None


@dataclass
class ModelRunnerOutput:
    """One new token for each scheduled sequence whose chunk `samples`, in their order in the
    SchedulerOutput, and where the step's time went (input preparation and sampling are the runner's
    overhead; `wait_s` is the host waiting for the device's results)."""

    sampler_output: SamplerOutput
    # The step's loads from the lower tiers that some rank could not make (a disk file gone or corrupt),
    # and the hashes whose copy down to disk failed on rank 0 since the last step.
    kv_failed_loads: list[KVLoad] = field(default_factory=list)
    kv_failed_writes: list[int] = field(default_factory=list)
    # By seq_id: the logprobs of the prompt tokens the step scored, following those scored before.
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # By seq_id: the result of each pooling request the step finished (float32, on the host).
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    wait_s: float = 0.0


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request: tokens added and, on its last step, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # None while running
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, these included
    # A request refused after it was queued (its constraint did not compile): its only output, terminal.
    error: str | None = None
    timeline: RequestTimeline | None = None  # on a finished request's last output
    # SamplingParams.prompt_logprobs: on the output that brings the first token, one per prompt token
    # (None for the first, which nothing precedes).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's result, on its one output (float32, on the host: common/pooling.py).
    pooled: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True)
class EngineLoad:
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    kv_host_blocks: int = 0  # blocks held in the prefix cache's lower tiers (worker/core/kv_tiers.py)
    kv_disk_blocks: int = 0
    kv_tiers: dict[str, KVTierStats] = field(default_factory=dict)  # by tier, when there are lower tiers
    # A hybrid model's state snapshots (worker/core/recurrent_states.py): rows kept for them, rows holding
    # one, and the bytes those take (each rank's share with tensor parallelism).
    state_snapshot_rows: int = 0
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0


@dataclass(frozen=True)
class KVTierStats:
    """One lower tier of the prefix cache since start: blocks held, blocks served from it, bytes each way,
    the engine thread's seconds each way (queueing copies down, copying up), faults by kind."""

    blocks: int
    hits: int
    bytes_down: int
    bytes_up: int
    seconds_down: float
    seconds_up: float
    faults: dict[str, int]


@dataclass
class StepStats:
    """Timing of the last step, split so the benchmark can report the Python overhead (scheduling, input
    preparation, sampling, applying results) apart from the model's forward pass (LM head included)."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_spec_proposed: int = 0  # speculative decoding: tokens proposed and verified this step
    num_spec_accepted: int = 0  # ... and of those, the ones kept
    overlapped: bool = False  # a step was launched before the picks of the one before it were applied
    schedule_s: float = 0.0
    draft_s: float = 0.0  # the draft model's proposals (speculative_method=draft)
    rows_s: float = 0.0  # each sampling sequence's rows for the sampler
    mask_s: float = 0.0  # structured output: the constrained rows' token masks (0 when none)
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    wait_s: float = 0.0  # the host waiting for the device's results (on a CPU: nothing, it computed them)
    update_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return (
            self.schedule_s
            + self.draft_s
            + self.rows_s
            + self.mask_s
            + self.prepare_s
            + self.sample_s
            + self.update_s
        )


@dataclass
class StepResult:
    outputs: list[RequestOutput]  # one per request that advanced or finished this step
    stats: StepStats
