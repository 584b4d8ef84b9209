"""A scheduled step laid out as the model's inputs: the plain integers of StepInputs (what rank 0 also
sends to the other tensor-parallel ranks), then those integers on the device in two copies."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch

from nanovllm.kernels.attention import AttentionMetadata, ChunkBatch, DecodeBatch, StateBatch
from nanovllm.worker.device import host_tensor, to_device
from nanovllm.worker.runner.block_table_rows import BlockTableRows
from nanovllm.worker.runner.images import mrope_positions
from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import (
    ImageRows,
    PoolingRow,
    PromptScoring,
    ScheduledSequence,
    SchedulerOutput,
    SeqChunk,
    StepInputs,
)


class InputBuilder:
    def __init__(self, block_size: int, device: torch.device, block_rows: BlockTableRows) -> None:
        self.block_size = block_size
        self.device = device
        self.block_rows = block_rows

    def step_inputs(
        self,
        sched: SchedulerOutput,
        all_logits: bool,
        picked: Mapping[int, int] | None = None,
        lora_slot: Callable[[Sequence], int] | None = None,
    ) -> StepInputs:
        """The step as plain integers. Tokens are laid out decodes, then fresh prompts, then continuing
        chunks; logits are computed for each sampling sequence's last token (or every token). `picked`: the
        row of each sequence's pick (by seq_id) in the picks of the step launched before this one, which a
        sequence still waiting for that pick (Sequence.num_pending_tokens) takes its last input token from.

        A verification (a decoding sequence's last token and its proposals) runs as decode rows, one per
        token, each attending to the cache up to its own position: its K/V are stored before any row
        attends, so this is the causal chunk, computed exactly as the decode steps it replaces would
        compute each token (and replayable as a decode step on CUDA graphs). `lora_slot`: the LoRA slot
        of a sequence's rows, where some sequence of the step has an adapter."""
        bs = self.block_size
        nd = sched.num_decodes
        picked = picked or {}
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        deferred: list[tuple[int, int]] = []
        lora_slots: list[int] = []
        logits_index: list[int] = []
        prompt_rows: list[int] = []
        prompt_scoring: list[PromptScoring] = []
        pooling: list[PoolingRow] = []
        with_images: list[tuple[int, ScheduledSequence]] = []  # (first row, item) of sequences with images
        # Decodes first, one row each: the bulk of a step at a large batch, so written without the general
        # path's slices and generators (a decode's table is the sequence's own list, which BlockTableRows
        # keeps as a row).
        decodes: list[SeqChunk] = []
        for row, item in enumerate(sched.scheduled[:nd]):
            seq, position = item.seq, item.start
            table = seq.block_table
            input_ids.append(seq.token_ids[position])
            positions.append(position)
            slots.append(table[position // bs] * bs + position % bs)
            needed = position // bs + 1
            decode = SeqChunk(position, 1, table if len(table) == needed else table[:needed], seq.state_slot)
            if item.state_saves or item.state_restore >= 0:  # a hybrid model's, at a block boundary
                decode.state_restore = item.state_restore
                decode.state_saves = [(boundary - position, row) for boundary, row in item.state_saves]
            decodes.append(decode)
            if seq.images:
                with_images.append((row, item))
            if lora_slot is not None:
                lora_slots.append(lora_slot(seq))
            if seq.num_pending_tokens:
                deferred.append((row, self._pending_row(item, picked)))
            if item.samples:
                logits_index.append(row)
            elif item.pools:  # a pooling request's last token alone (a prefix-cache hit covered the rest)
                pooling.append(_pooling_row(seq, row))
            elif seq.scores_prompt:  # a one-token chunk of a prompt
                _score_prompt(item, row, prompt_rows, prompt_scoring)
        rest = sched.scheduled[nd:]
        verifying = [s for s in rest if s.spec_token_ids]
        chunks = [s for s in rest if not s.spec_token_ids]
        last_row: dict[int, int] = {}
        for item in layout_order(sched)[nd:]:
            seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start : end - len(item.spec_token_ids)])
            input_ids.extend(item.spec_token_ids)
            if seq.images:
                with_images.append((len(positions), item))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_row[seq.seq_id] = len(input_ids) - 1
            if item.pools:
                pooling.append(_pooling_row(seq, len(input_ids) - 1))
            if seq.scores_prompt:
                _score_prompt(item, len(input_ids) - item.num_new_tokens, prompt_rows, prompt_scoring)
            if lora_slot is not None:
                lora_slots.extend([lora_slot(seq)] * item.num_new_tokens)
            if seq.num_pending_tokens:
                deferred.append((len(input_ids) - 1, self._pending_row(item, picked)))
        if all_logits:
            logits_index = list(range(len(input_ids)))
        else:
            # One row per token to pick, in the scheduled order: a verified chunk's proposals each have theirs.
            for s in rest:
                if s.samples:
                    last = last_row[s.seq.seq_id]
                    logits_index.extend(range(last - len(s.spec_token_ids), last + 1))

        def chunk(item: ScheduledSequence, start: int, num_new_tokens: int) -> SeqChunk:
            # The sequence's own list where it is the whole table (BlockTableRows keeps its row).
            table, needed = item.seq.block_table, -(-(start + num_new_tokens) // bs)
            saves = [(boundary - start, row) for boundary, row in item.state_saves]
            return SeqChunk(
                start, num_new_tokens, table if len(table) == needed else table[:needed], item.seq.state_slot,
                item.state_restore, saves,
            )  # fmt: skip

        decodes += [chunk(s, p, 1) for s in verifying for p in range(s.start, s.start + s.num_new_tokens)]
        mrope, image_rows = _image_layout(positions, with_images) if with_images else ([], [])
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            decodes=decodes,
            fresh=[chunk(s, s.start, s.num_new_tokens) for s in chunks if s.start == 0],
            cached=[chunk(s, s.start, s.num_new_tokens) for s in chunks if s.start > 0],
            logits_index=logits_index,
            deferred=deferred,
            lora_slots=lora_slots,
            prompt_rows=prompt_rows,
            prompt_scoring=prompt_scoring,
            mrope_positions=mrope,
            image_rows=image_rows,
            pooling=pooling,
        )

    @staticmethod
    def _pending_row(item: ScheduledSequence, picked: Mapping[int, int]) -> int:
        """The row of the previous step's picks that holds `item`'s last input token."""
        seq = item.seq
        if seq.num_pending_tokens != 1 or item.start + item.num_new_tokens != len(seq.token_ids):
            raise RuntimeError(
                f"request {seq.request_id!r}: only a decode of its one pending token can be scheduled "
                f"({seq.num_pending_tokens} pending, positions {item.start}..{item.start + item.num_new_tokens})"
            )
        row = picked.get(seq.seq_id)
        if row is None:
            raise RuntimeError(f"request {seq.request_id!r} waits on a pick the last step did not make")
        return row

    def tensors(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The model's inputs on this runner's device: token ids, positions, attention metadata, and the
        rows whose logits are wanted. Two host-to-device copies: the step's integers, and its block tables
        (one array for the three groups of chunks, each group taking its rows)."""
        groups = (inputs.decodes, inputs.fresh, inputs.cached)
        # Each array starts 16-byte aligned in the one staged tensor: Triton compiles a kernel once per
        # alignment of its pointers, and a step must not meet a new one (a compile costs seconds).
        segments = [inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_index]
        segments.append([c.start + 1 for c in inputs.decodes])  # context lengths
        for chunks in groups[1:]:
            if chunks:
                query_start_loc = [0]
                for c in chunks:
                    query_start_loc.append(query_start_loc[-1] + c.num_new_tokens)
                segments += [query_start_loc, [c.start for c in chunks]]
        values: list[int] = []
        offsets = []
        for segment in segments:
            offsets.append(len(values))
            values += segment
            values += [0] * (len(values) % 2)
        packed = self.long(values)
        staged = [packed.narrow(0, offset, len(segment)) for offset, segment in zip(offsets, segments)]
        input_ids, positions, slot_mapping, logits_index, context_lens = staged[:5]
        chunks = [c for group in groups for c in group]
        tables = (
            to_device(self.block_rows.gather([c.block_table for c in chunks]), self.device)
            if chunks
            else None
        )
        starts = itertools.accumulate(len(group) for group in groups)
        decode_tables, fresh_tables, cached_tables = (
            tables[a - len(group) : a] if group and tables is not None else None
            for a, group in zip(starts, groups)
        )
        chunk_tensors = iter(staged[5:])

        def chunk_batch(chunks: list[SeqChunk], block_tables: torch.Tensor) -> ChunkBatch:
            return ChunkBatch(
                query_start_loc=next(chunk_tensors),
                start_positions=next(chunk_tensors),
                block_tables=block_tables,
                max_query_len=max(c.num_new_tokens for c in chunks),
                num_tokens=sum(c.num_new_tokens for c in chunks),
                block_size=self.block_size,
            )

        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            # each group's tables are there exactly when the group has chunks
            decode=DecodeBatch(decode_tables, context_lens, self.block_size)
            if decode_tables is not None
            else None,
            fresh=chunk_batch(inputs.fresh, fresh_tables) if fresh_tables is not None else None,
            cached=chunk_batch(inputs.cached, cached_tables) if cached_tables is not None else None,
            states=self._state_batch(inputs, chunks) if chunks and chunks[0].state_slot >= 0 else None,
        )
        return input_ids, positions, meta, logits_index

    def _state_batch(self, inputs: StepInputs, chunks: list[SeqChunk]) -> StateBatch:
        """A hybrid model's state slots for the step's sequences, in layout order. A verification's tokens
        are decode rows of one sequence, consecutive, each in its slot: one entry here, after the decodes,
        whose tokens run in order from the slot's state (the first token's chunk says what it restores and
        saves)."""
        entries: list[SeqChunk] = []
        num_tokens: list[int] = []
        for i, c in enumerate(chunks):
            if i and i < len(inputs.decodes) and c.state_slot == chunks[i - 1].state_slot:
                num_tokens[-1] += 1
            else:
                entries.append(c)
                num_tokens.append(c.num_new_tokens)
        num_groups = len(entries) - len(inputs.fresh) - len(inputs.cached)
        num_decodes = sum(1 for n in num_tokens[:num_groups] if n == 1)
        slot_list = [c.state_slot for c in entries]
        fresh = [c.state_slot for c in entries if c.start == 0]
        return StateBatch(
            slots=self.long(slot_list),
            slot_list=slot_list,
            num_tokens=num_tokens,
            num_decodes=num_decodes,
            fresh_slots=self.long(fresh) if fresh else None,
            restores=[(c.state_restore, c.state_slot) for c in entries if c.state_restore >= 0],
            saves=[c.state_saves for c in entries],
            num_verifies=num_groups - num_decodes,
        )

    def long(self, values: list[int]) -> torch.Tensor:
        return to_device(host_tensor(values), self.device)


def _image_layout(
    positions: list[int], with_images: list[tuple[int, ScheduledSequence]]
) -> tuple[list[int], list[ImageRows]]:
    """The step's three rows of RoPE positions (every row's position on each axis: text rows' as
    `positions`, the rows of sequences with images as worker/runner/images.py lays them out) and its image
    tokens' rows."""
    temporal, height, width = list(positions), list(positions), list(positions)
    image_rows: list[ImageRows] = []
    for row, item in with_images:
        start, end = item.start, item.start + item.num_new_tokens
        t, h, w = mrope_positions(item.seq.images, start, end)
        temporal[row : row + len(t)], height[row : row + len(h)], width[row : row + len(w)] = t, h, w
        for image in item.seq.images:
            first, last = max(start, image.offset), min(end, image.end)
            if first < last:
                image_rows.append(ImageRows(image, row + first - start, first - image.offset, last - first))
    return temporal + height + width, image_rows


def layout_order(sched: SchedulerOutput) -> list[ScheduledSequence]:
    """The step's sequences in the order their tokens are laid out (InputBuilder.step_inputs): decodes,
    verifications, fresh prompts, continuing chunks."""
    rest = sched.scheduled[sched.num_decodes :]
    chunks = [s for s in rest if not s.spec_token_ids]
    return [
        *sched.scheduled[: sched.num_decodes],
        *(s for s in rest if s.spec_token_ids),
        *(s for s in chunks if s.start == 0),
        *(s for s in chunks if s.start > 0),
    ]


def first_rows(sched: SchedulerOutput) -> list[tuple[ScheduledSequence, int]]:
    """Each of the step's sequences with the row of its first token in the step's layout."""
    rows, row = [], 0
    for item in layout_order(sched):
        rows.append((item, row))
        row += item.num_new_tokens
    return rows


def _pooling_row(seq: Sequence, row: int) -> PoolingRow:
    pooling = seq.pooling
    assert pooling is not None  # a ScheduledSequence that pools is a pooling request's
    return PoolingRow(seq.seq_id, row, list(pooling.token_ids))


def _score_prompt(
    item: ScheduledSequence, first_row: int, rows: list[int], scoring: list[PromptScoring]
) -> None:
    """The rows of `item`'s chunk (the first at `first_row`) whose logits score prompt tokens not yet
    scored: position p's logits score token p + 1, up to the prompt's last token (whose logits pick)."""
    seq = item.seq
    begin = max(item.start, len(seq.prompt_logprobs) - 1)
    end = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
    if begin >= end:
        return
    rows.extend(range(first_row + begin - item.start, first_row + end - item.start))
    targets = seq.token_ids[begin + 1 : end + 1]
    num_top = seq.params.prompt_logprobs
    assert num_top is not None  # seq.scores_prompt
    scoring.append(PromptScoring(seq.seq_id, targets, num_top))
