"""Decode steps replayed from captured CUDA graphs.

A decode-only step's shapes depend on one number, its batch size, so its forward pass can be captured once
per batch-size bucket and replayed: one graph launch instead of a few hundred kernel launches, which at small
batches cost the GPU more time than the kernels themselves. A step is padded up to its bucket. Padding rows
decode token 0 at position 0 into the KV cache's pad block, which no sequence owns, so every kernel sees
well-formed input and no sequence's cache changes. Prefill and mixed steps, and batches above the largest
bucket, run eagerly: their shapes change every step.

With LoRA on the Triton kernels, each bucket has a second graph for steps with adapter rows: every row runs
the adapter kernels with its slot from a static buffer, -1 (none) for base and padding rows, which the
kernels skip, so one graph serves any mix of adapters. Steps without adapters replay the plain graph.

A hybrid model's decode step (Qwen3.5) also takes each row's state slot from a static buffer, padding rows
a pad state row no sequence owns; what the step does to the state outside the kernels (zeroing a fresh
sequence's slot, a prefix hit's restore, the copies kept at block boundaries) runs eagerly around the replay.

Capturing is behind `GraphCapture`: `CudaGraphCapture` on CUDA, and `EagerReplay`, which runs the same static
buffers and padding eagerly. The CPU tests use the latter to check everything but the capture itself.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from nanovllm.common.logging import get_logger
from nanovllm.kernels.attention import AttentionMetadata, DecodeBatch, StateBatch
from nanovllm.worker.layers.lora import LoRABatch, LoRAContext
from nanovllm.worker.step import StepInputs

if TYPE_CHECKING:
    from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM

log = get_logger(__name__)

Forward = Callable[[], torch.Tensor]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return [*small, *range(16, max_num_seqs, 16), max_num_seqs]


class GraphCapture(Protocol):
    """Turns a forward pass over static buffers into something that replays it."""

    name: str

    def capture(self, forward: Forward) -> Forward:
        """Run `forward` once as a warm-up, then return a replay: a call that reruns it on whatever the
        static buffers hold and returns its (static) output."""
        ...


class EagerReplay:
    """Replays by calling the forward pass again: the static buffers and padding without a graph."""

    name = "eager"

    def capture(self, forward: Forward) -> Forward:
        forward()
        return forward


class CudaGraphCapture:
    """One CUDA graph per bucket, all allocating from one memory pool: captured largest first, each smaller
    graph's activations fit in memory the larger ones already hold."""

    name = "cuda"

    def __init__(self) -> None:
        self.pool: torch.cuda._POOL_HANDLE | None = None

    def capture(self, forward: Forward) -> Forward:
        forward()  # warm-up outside the graph: compiles Triton kernels, sets up cuBLAS workspaces
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


def _reserved(device: torch.device) -> int:
    """GPU memory torch's allocator holds (0 on CPU): what capturing the graphs added to it is their cost."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


class DecodeGraphs:
    """Static input buffers sized for the largest bucket, and one replay per bucket."""

    def __init__(
        self,
        model: nn.Module,
        capture: GraphCapture,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
        lora: LoRAContext | None = None,
        pad_state_row: int | None = None,
    ) -> None:
        """`lora`: the model's LoRA context, where its adapters run on the Triton kernels (the only ones
        that take a graph's every-row batch); then adapter steps replay too. `pad_state_row`: a hybrid
        model's state row for padding rows (None: the model has no per-request state)."""
        self.buckets = batch_buckets(max_num_seqs)
        self.block_size = block_size
        self.device = device
        rows = self.buckets[-1]
        # Every row starts as a padding row; a step overwrites the rows it uses.
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), pad_block * block_size, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.block_tables = torch.full((rows, max_blocks_per_seq), pad_block, dtype=torch.long, device=device)
        self.pad = (0, 0, pad_block * block_size, 1, pad_block)  # a padding row's id, position, slot, ...
        self.lora = lora
        self.lora_slots = torch.full((rows,), -1, dtype=torch.long, device=device)  # each row's adapter
        self.model = model
        self.pad_state_row = pad_state_row
        self.state_slots = torch.full((rows,), pad_state_row or 0, dtype=torch.long, device=device)

        started, before = time.perf_counter(), _reserved(device)
        self.replays: dict[int, Forward] = {}
        self.adapter_replays: dict[int, Forward] = {}
        for size in reversed(self.buckets):
            self.replays[size] = capture.capture(self._forward_of(model, size, adapters=False))
            if lora is not None:
                self.adapter_replays[size] = capture.capture(self._forward_of(model, size, adapters=True))
        log.info(
            "decode_graphs_captured",
            capture=capture.name,
            buckets=len(self.buckets),
            adapters=lora is not None,
            largest=rows,
            seconds=round(time.perf_counter() - started, 2),
            graph_mib=round((_reserved(device) - before) / 2**20, 1),
        )

    def _forward_of(self, model: nn.Module, size: int, adapters: bool) -> Forward:
        def forward() -> torch.Tensor:
            # Fresh metadata on every call: its lazily derived tensors (the reference backend's masks) must
            # be computed inside the capture, not reused from the warm-up.
            decode = DecodeBatch(self.block_tables[:size], self.context_lens[:size], self.block_size)
            meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], decode=decode)
            if self.pad_state_row is not None:  # the state's own work runs around the replay (run)
                meta.states = StateBatch(self.state_slots[:size], [], [1] * size, size, None)
            if self.lora is not None:
                self.lora.batch = LoRABatch.every_row(self.lora_slots[:size]) if adapters else None
            return model(self.input_ids[:size], self.positions[:size], meta)

        return forward

    def bucket(self, inputs: StepInputs) -> int | None:
        """The bucket a step replays in, or None when it must run eagerly (adapter rows among them, unless
        the graphs were captured with adapters)."""
        n = len(inputs.decodes)
        adapters_eager = inputs.lora_slots and self.lora is None
        if inputs.fresh or inputs.cached or adapters_eager or n == 0 or n > self.buckets[-1]:
            return None
        if max(len(c.block_table) for c in inputs.decodes) > self.block_tables.shape[1]:
            return None
        if inputs.decodes[0].state_slot >= 0 and len({c.state_slot for c in inputs.decodes}) < n:
            return None  # a hybrid model's verification: its tokens walk one state in order, eagerly
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        size: int,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode-only step of n rows (its inputs on the device),
        replayed in bucket `size`; `lora_slots` [n]: each row's adapter slot, -1 for none, when any row has
        one. The padding rows are rewritten each time, since a larger step before may have left real
        sequences' values in them."""
        decode = meta.decode
        assert decode is not None  # a decode-only step
        # The tables may carry a padding column past the static buffer's width (BlockTableRows).
        n, width = input_ids.shape[0], min(decode.block_tables.shape[1], self.block_tables.shape[1])
        pad_id, pad_pos, pad_slot, pad_len, pad_block = self.pad
        for static, real, pad in (
            (self.input_ids, input_ids, pad_id),
            (self.positions, positions, pad_pos),
            (self.slot_mapping, meta.slot_mapping, pad_slot),
            (self.context_lens, decode.context_lens, pad_len),
        ):
            static[:n].copy_(real)
            static[n:size].fill_(pad)
        # Columns past `width` keep older block ids: every id is a real block, and the context length
        # masks them out.
        self.block_tables[:n, :width].copy_(decode.block_tables[:, :width])
        self.block_tables[n:size, :width].fill_(pad_block)
        states = meta.states
        hybrid = cast("Qwen3_5ForCausalLM", self.model)  # the only model whose steps have states
        if states is not None:
            assert self.pad_state_row is not None  # given for a model with states
            self.state_slots[:n].copy_(states.slots)
            self.state_slots[n:size].fill_(self.pad_state_row)
            hybrid.prepare_states(states)
        if lora_slots is None:
            hidden = self.replays[size]()[:n]
        else:
            self.lora_slots[:n].copy_(lora_slots)
            self.lora_slots[n:size].fill_(-1)
            hidden = self.adapter_replays[size]()[:n]
        if states is not None:
            hybrid.keep_decode_states(states)
        return hidden
