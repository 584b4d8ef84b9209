"""A request as the engine tracks it: its tokens, its KV blocks and an explicit, checked state."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Protocol

from nanovllm.common.block_hash import block_key
from nanovllm.common.errors import InvalidStateTransition
from nanovllm.common.images import ImagePatches
from nanovllm.common.pooling import PoolingParams
from nanovllm.common.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token plus, when asked for, the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first; empty when logprobs == 0
    rank: int | None = None  # the token's place in the distribution (1: the most likely); prompt tokens'


class GrammarState(Protocol):
    """Where a constrained request is in its constraint (sample/structured_output.py's Grammar)."""

    def consume(self, token_ids: list[int]) -> bool: ...

    def valid_prefix(self, token_ids: list[int]) -> int: ...

    @property
    def is_stopped(self) -> bool: ...

    @property
    def error(self) -> str: ...


class Adapter(Protocol):
    """The LoRA adapter a request runs with (worker/models/lora_adapter.py's LoRAAdapter)."""

    name: str

    @property
    def cache_salt(self) -> int: ...


class TokenSlice(SequenceABC):
    """tokens[start:] of a list that grows, without copying it: a sequence's outputs as a sampling row
    sees them, built every step for every row (a copy would cost the sequence's length each time)."""

    __slots__ = ("_start", "_stop", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens, self._start, self._stop = tokens, start, len(tokens)

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        return self._tokens[self._start : self._stop][index]


@dataclass(frozen=True)
class ImageInput:
    """An image of a prompt: its patches, and where its `num_tokens` placeholder tokens begin (`offset`);
    they form a grid of `grid_hw` merged patches, row-major."""

    offset: int
    num_tokens: int
    grid_hw: tuple[int, int]
    patches: ImagePatches

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def content_hash(self) -> int:
        return self.patches.content_hash


PENDING_TOKEN = -1  # the place of a token a step in flight is picking (Sequence.num_pending_tokens)


class FinishReason(str, enum.Enum):
    """Why a request ended. A str, so LLM.generate's outputs compare equal to nano-vllm's strings; the
    worker link's enum spells the same names (FINISH_REASON_STOP, ...)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # Identity, not `in _FINISHED`: hashing an enum member runs Python code, and this is per row.
        return self is not SequenceStatus.RUNNING and self is not SequenceStatus.WAITING


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}

# Preemption is RUNNING -> WAITING; every finished state is terminal.
_ALLOWED = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING} | _FINISHED,
}


@dataclass
class RequestTimeline:
    """What a request went through in this engine, for its trace span (worker/service/request_span.py). Times are
    time.time_ns() (0: not yet). A step that computed some of its tokens without sampling is a prefill
    chunk (or a recomputation after a preemption); one that sampled is a decode step, except the first,
    which ends the prefill and counts as its last chunk."""

    arrival_ns: int = field(default_factory=time.time_ns)
    scheduled_ns: int = 0  # first admitted to the running batch
    first_token_ns: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    preemptions: int = 0

    def on_step(self, sampled: bool) -> None:
        if not sampled:
            self.prefill_chunks += 1
        elif self.first_token_ns:
            self.decode_steps += 1
        else:
            self.first_token_ns = time.time_ns()
            self.prefill_chunks += 1


@dataclass(eq=False)
class Sequence:
    """One request. `num_computed_tokens` counts tokens whose KV is in the cache (so a prefix-cache hit
    or a chunk of prefill advances it); tokens past it are scheduled in later steps."""

    seq_id: int  # engine-wide arrival order; ties in priority are broken by it
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full, computed blocks
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one per prompt token scored so far (the first token's is None).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # with the first new token's output
    admitted: bool = False
    # Tokens proposed for the next step by speculative decoding (worker/sample/speculation.py): not part of the
    # sequence until the step verifies them.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # tokens whose KV the draft model holds (worker/sample/draft.py)
    # A hybrid model's: the slot of the linear layers' state the sequence holds while it has blocks (-1: none;
    # worker/core/recurrent_states.py).
    state_slot: int = -1
    # The prompt's images, in prompt order (a vision model's; worker/runner/images.py).
    images: list[ImageInput] = field(default_factory=list)
    # How many of the prompt's first tokens other requests likely share (the router's chat API: where the
    # chat's last user message begins; 0: no hint): a hybrid model keeps a snapshot of its state there.
    shared_prefix_tokens: int = 0
    grammar: GrammarState | None = None  # structured output: where the request is in its constraint
    adapter: Adapter | None = None  # LoRA: None runs the base model
    # A pooling request (embeddings, rerank scores): its prompt is computed and its last token's vector
    # returned, then it finishes; it generates nothing (common/pooling.py).
    pooling: PoolingParams | None = None
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    # The last tokens of `token_ids` that a step in flight is picking: their places are held (by
    # PENDING_TOKEN) so the next step can be scheduled before the host knows them (LLMEngine.step).
    num_pending_tokens: int = 0
    # The most tokens it can reach: the prompt and max_tokens outputs, within max_model_len (the engine
    # sets it; 0 here means the prompt and max_tokens alone).
    max_num_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if not self.max_num_tokens:
            self.max_num_tokens = self.num_prompt_tokens + self.params.max_tokens
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt tokens' logprobs are asked for and some are still to compute (the prompt is
        then computed, not served from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def add_pending_token(self) -> None:
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token: int) -> None:
        """The first pending token is now known."""
        self.token_ids[len(self.token_ids) - self.num_pending_tokens] = token
        self.num_pending_tokens -= 1

    def drop_pending_tokens(self) -> None:
        """Forget the places of picks still in flight: the request ended before them."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens :]
            self.num_pending_tokens = 0

    @property
    def cache_salt(self) -> int | None:
        """Where the hash chain of this sequence's prefix-cache blocks starts: a block computed under one
        adapter (or none) never serves another."""
        return self.adapter.cache_salt if self.adapter is not None else None

    def block_key(self, index: int, block_size: int) -> list[int]:
        """What block `index`'s hash covers (common/block_hash.py block_key: the router hashes a prompt's
        blocks the same way)."""
        begin, end = index * block_size, (index + 1) * block_size
        if not self.images:
            return self.token_ids[begin:end]
        return block_key(self.token_ids, begin, end, self.images)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.seq_id)

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason(self.status.value) if self.status.finished else None

    def transition(self, new: SequenceStatus) -> None:
        if new not in _ALLOWED.get(self.status, set()):
            raise InvalidStateTransition(
                f"request {self.request_id!r}: {self.status.name} -> {new.name} is not a valid transition"
            )
        self.status = new
