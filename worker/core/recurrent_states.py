"""A hybrid model's per-request state beside the paged KV cache: state slots and snapshot rows.

A hybrid model's linear-attention layers carry a recurrent state per request instead of a KV per token
(the shapes are the model's to declare: `DecoderForCausalLM.state_layout`). Rows 0.. of those state
tensors are slots: a sequence holds one from its first blocks until it frees them, so admission needs a
free slot as it needs free blocks. The rows after them are snapshots, which the prefix cache needs: a hit
resumes the linear layers from a snapshot of the state at the hit's last block boundary, so hits end at
the last block with one. Snapshots are kept by the hash of the block they end, least recently used
recycled first. A step copies the state into them at the boundaries the scheduler asks for
(`plan_saves`): every `snapshot_interval` tokens of a sequence (long shared prefixes), its branch points
(below) and its last boundary into the sequence's own row, which it leaves behind when it frees its
blocks (a conversation's next turn). They join the cache once the step has run and their blocks' hashes
are known (`publish`).

Branch points are where requests sharing a prefix are likely to part, which an interval misses when the
shared part is shorter than it (a system prompt, few-shot examples, a document asked several questions):

- the hint a request brings (`Sequence.shared_prefix_tokens`: the router's chat API sends where the
  chat's last user message begins), at the block boundary at or below it;
- where what its prompt shares with prompts seen before ends, when that is past the last snapshot it could
  resume from (`note_branch`, told at admission by the block manager; seen before: the KV cache's blocks,
  and the prompts admitted earlier in the same step, not cached yet). Sharing means that some other prompt
  had these blocks and then went elsewhere: two prompts have branched here, and a third sharing the prefix
  branches here too, so it is where a snapshot serves the most. The second request of a shared prefix
  computes it and leaves the snapshot; the third on resume there. It needs no hint (raw prompts, the
  offline API) and costs at most one row a request, only for a prompt that shares blocks no state covers,
  recycled as any other.

A branch point whose snapshot is cached, or planned by a step in flight (a burst sharing a system prompt
computes it in one step), is not copied again.

With the prefix cache's lower tiers (worker/core/kv_tiers.py), a snapshot evicted from its row goes down
beside its block (`spill`, which the block manager sets), and a hit from a lower tier that resumes where a
snapshot was kept there brings it back up into a row (`take_load_row`), which joins the cache once the
step has copied it (`arrived`). Such a load must not write a row that a sequence of the same step
restores from: rows restored in the step being scheduled are not taken for loads. A sequence whose blocks
come from disk resumes a step later, from the snapshot that came up or the one on the device where its
hits end (where it resumes if a load fails): those rows are pinned until then (`pin`), never recycled.

Speculative decoding verifies a sequence's last token and its K proposals in one step, each after the
one before it, and a rejected proposal must leave nothing in the state. Each slot has K speculation rows
after the snapshot rows: the verification copies the state after each of its first K tokens into them
(`verify_saves`), and when a proposal is rejected the sequence's next step first copies the row of its
last kept token back into its slot (`roll_back`, then `take_rollback` as the step is scheduled); all
accepted, the slot holds the right state already. A snapshot planned at a boundary inside a verification
joins the cache only when the tokens before that boundary were kept (`publish`).

The block manager (worker/core/block_manager.py) owns one of these for a hybrid model, as it owns the
lower KV tiers, and calls it where blocks are taken, hashed and freed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.common.block_hash import HashChanges, prefix_hashes
from nanovllm.worker.sequence import Sequence


@dataclass
class _PlannedSave:
    boundary: int  # tokens of the sequence whose state the copy holds
    row: int
    own: bool  # into the sequence's own row (its last boundary), not a shared snapshot
    branch: int | None = None  # a branch point's: the hash of the block it ends (no second copy of it)


class RecurrentStates:
    def __init__(
        self,
        num_slots: int,
        num_snapshots: int,
        snapshot_interval: int,
        block_size: int,
        caching: bool,
        num_speculative: int = 0,
    ) -> None:
        """`num_slots` state slots, rows 0.. of the state tensors; `num_snapshots` snapshot rows after them,
        kept only with the prefix cache on (`caching`); then `num_speculative` speculation rows per slot."""
        self.num_slots = num_slots
        self.num_speculative = num_speculative
        self._rollbacks: dict[int, int] = {}  # by seq_id: the speculation row its next step restores
        self.num_snapshots = num_snapshots
        self.block_size = block_size
        self.snapshot_interval = snapshot_interval
        self.caching = caching and num_snapshots > 0
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped lowest first
        self.free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self.cache: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot row, LRU first
        self.events = HashChanges()  # changes to `cache` not yet reported (take_events)
        # By seq_id: a sequence's own row and the tokens whose state it holds (its last block boundary),
        # and the copies a step in flight makes for it.
        self._own: dict[int, tuple[int, int]] = {}
        self._planned: dict[int, list[_PlannedSave]] = {}
        self._branches: dict[
            int, int
        ] = {}  # where what a sequence shares ends past its snapshots (note_branch)
        self._planned_branches: set[int] = set()  # the block hashes of branch points steps in flight copy
        # (block hash, row) by seq_id: a snapshot on its way up from a lower tier (take_load_row).
        self._arriving: dict[int, tuple[int, int]] = {}
        self._restored: set[int] = set()  # rows restored from by the step being scheduled
        self._pins: dict[int, list[int]] = {}  # by seq_id: rows a loading sequence may resume from (pin)
        self._pinned: Counter[int] = Counter()  # how many sequences pin each row
        # Called with (block hash, row) of a snapshot evicted from the cache, before the row is written again.
        self.spill: Callable[[int, int], None] | None = None

    @property
    def num_snapshots_held(self) -> int:
        """Snapshot rows holding a state: the cache's, running sequences' own and a step's copies."""
        return self.num_snapshots - len(self.free_snapshots)

    def take_events(self) -> HashChanges:
        events, self.events = self.events, HashChanges()
        return events

    def resumes_at(self, block_hash: int) -> bool:
        """Whether a prefix hit may end at the block of `block_hash` (a snapshot holds the state there)."""
        return block_hash in self.cache

    def take_slot(self, seq: Sequence) -> bool:
        """Give `seq` a slot if it has none; False when none is free."""
        if seq.state_slot < 0:
            if not self.free_slots:
                return False
            seq.state_slot = self.free_slots.pop()
        return True

    def restore(self, seq: Sequence) -> int:
        """The snapshot row a sequence admitted on prefix hits resumes from (-1: none, no hits)."""
        if not seq.block_hashes:
            return -1
        row = self.cache.get(seq.block_hashes[-1])
        if row is None:
            raise RuntimeError(f"request {seq.request_id!r} hit blocks past the last state snapshot")
        self.cache.move_to_end(seq.block_hashes[-1])
        self._restored.add(row)
        return row

    def verify_saves(self, seq: Sequence, start: int, num_tokens: int) -> list[tuple[int, int]]:
        """(boundary, speculation row) of the copies a verification of `num_tokens` tokens from position
        `start` makes: the state after each of its tokens but the last."""
        if num_tokens - 1 > self.num_speculative:
            raise RuntimeError(
                f"request {seq.request_id!r}: a verification of {num_tokens} tokens needs {num_tokens - 1} "
                f"speculation rows, this engine keeps {self.num_speculative} a slot"
            )
        return [(start + offset, self._speculation_row(seq, offset)) for offset in range(1, num_tokens)]

    def roll_back(self, seq: Sequence, verified: int, kept: int) -> None:
        """`seq` keeps the first `kept` of the `verified` tokens its last step verified: when it kept fewer,
        its next step restores the state after the last kept one (verify_saves' row) into its slot."""
        if kept < verified:
            self._rollbacks[seq.seq_id] = self._speculation_row(seq, kept)

    def take_rollback(self, seq: Sequence) -> int:
        """The speculation row the step being scheduled restores `seq`'s slot from (-1: none)."""
        return self._rollbacks.pop(seq.seq_id, -1)

    def _speculation_row(self, seq: Sequence, offset: int) -> int:
        """The row holding the state after `offset` (1..num_speculative) tokens of `seq`'s verification."""
        first = self.num_slots + self.num_snapshots + seq.state_slot * self.num_speculative
        return first + offset - 1

    def begin_step(self) -> None:
        """A new step is being scheduled: no row is restored from in it yet."""
        self._restored.clear()

    def load_row_available(self) -> bool:
        """Whether a row can be taken for a snapshot coming up from a lower tier (take_load_row)."""
        return bool(self.free_snapshots) or any(
            row not in self._restored and self._pinned[row] <= 0 for row in self.cache.values()
        )

    def take_load_row(self, seq: Sequence, block_hash: int) -> int:
        """A row for the snapshot at the block of `block_hash` that `seq`'s step copies up from a lower
        tier; it joins the cache when `arrived` says so. -1 when every row is taken (load_row_available
        said one was, but `seq`'s own pins took it): the block comes up without its snapshot."""
        row = self._take_snapshot_row(avoid=self._restored)
        if row >= 0:
            self._arriving[seq.seq_id] = (block_hash, row)
        return row

    def pin(self, seq: Sequence, block_hashes: list[int]) -> None:
        """Keep the cached snapshots at the blocks of `block_hashes` (those `seq`, loading, may resume
        from) in their rows until `arrived`."""
        rows = [self.cache[h] for h in block_hashes]
        self._pins.setdefault(seq.seq_id, []).extend(rows)
        self._pinned.update(rows)

    def arrived(self, seq: Sequence, ok: bool) -> None:
        """The step copied `seq`'s snapshot up (take_load_row), or failed to (`ok` False: its row is free
        again); its pins go."""
        self._pinned.subtract(self._pins.pop(seq.seq_id, []))
        entry = self._arriving.pop(seq.seq_id, None)
        if entry is None:
            return
        block_hash, row = entry
        if ok:
            self._cache_snapshot(block_hash, row)
        else:
            self.free_snapshots.append(row)

    def note_branch(self, seq: Sequence, boundary: int) -> None:
        """`seq`'s prompt shares its first `boundary` tokens with prompts seen before, past the last snapshot
        it may resume from: a branch point (see the module's docstring), where the step computing it saves
        one."""
        self._branches[seq.seq_id] = boundary

    def plan_saves(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """(boundary, snapshot row) of the copies of `seq`'s state that the step computing its tokens
        [start, end) makes, in order: at each multiple of snapshot_interval and each branch point it
        reaches, into a fresh row, and at the last block boundary it reaches, into the sequence's own row.
        Rows run out only when every one is some running sequence's own: those copies are then not made."""
        last = end // self.block_size * self.block_size
        if last <= start:
            return []
        planned = self._planned.setdefault(seq.seq_id, [])
        first_interval = (start // self.snapshot_interval + 1) * self.snapshot_interval
        shared: dict[int, int | None] = dict.fromkeys(range(first_interval, last + 1, self.snapshot_interval))
        for boundary in self._branch_points(seq):
            if start < boundary <= last and boundary not in shared:
                block_hash = self._hash_at(seq, boundary)
                if block_hash not in self.cache and block_hash not in self._planned_branches:
                    shared[boundary] = block_hash
        saves = []
        for boundary in sorted(shared):
            row = self._take_snapshot_row()
            if row < 0:
                break
            branch = shared[boundary]
            saves.append((boundary, row))
            planned.append(_PlannedSave(boundary, row, own=False, branch=branch))
            if branch is not None:
                self._planned_branches.add(branch)
        if not saves or saves[-1][0] != last:
            own_row = self._own[seq.seq_id][0] if seq.seq_id in self._own else self._take_snapshot_row()
            if own_row >= 0:
                self._own.setdefault(seq.seq_id, (own_row, 0))
                saves.append((last, own_row))
                planned.append(_PlannedSave(last, own_row, own=True))
        return saves

    def _branch_points(self, seq: Sequence) -> list[int]:
        """`seq`'s branch points: its hint's block boundary, and where what it shares ends (note_branch)."""
        points = [seq.shared_prefix_tokens // self.block_size * self.block_size]
        if seq.seq_id in self._branches:
            points.append(self._branches[seq.seq_id])
        return [p for p in points if p > 0]

    def _hash_at(self, seq: Sequence, boundary: int) -> int:
        """The hash of `seq`'s block that ends at `boundary`, chained on from the blocks it has hashed."""
        done = len(seq.block_hashes)  # < boundary's blocks: the boundary is past the computed tokens
        prev = seq.block_hashes[-1] if done else seq.cache_salt
        return prefix_hashes(seq.token_ids[done * self.block_size : boundary], self.block_size, salt=prev)[-1]

    def publish(self, seq: Sequence) -> None:
        """The copies the last step made of `seq`'s state: its own row now holds its last boundary's
        state; the others join the cache under their block's hash (a row whose hash is cached already
        goes back to the free rows). A copy past the tokens the sequence kept (a verification's rejected
        proposals) holds a state it never has: its row goes back, and an own row so written holds no
        boundary's state any more."""
        for save in self._planned.pop(seq.seq_id, []):
            if save.branch is not None:
                self._planned_branches.discard(save.branch)
            if save.boundary > seq.num_computed_tokens:
                if save.own:
                    self._own[seq.seq_id] = (save.row, 0)
                else:
                    self.free_snapshots.append(save.row)
            elif save.own:
                self._own[seq.seq_id] = (save.row, save.boundary)
            else:
                self._cache_snapshot(seq.block_hashes[save.boundary // self.block_size - 1], save.row)

    def release(self, seq: Sequence) -> None:
        """`seq` frees its blocks (call before they are forgotten): its own row joins the cache under its
        last boundary's block, for a next turn's hit; rows of copies no step made go back; so does the slot."""
        own = self._own.pop(seq.seq_id, None)
        if own is not None:
            row, tokens = own
            boundary_blocks = tokens // self.block_size
            if 0 < boundary_blocks <= len(seq.block_hashes):
                self._cache_snapshot(seq.block_hashes[boundary_blocks - 1], row)
            else:
                self.free_snapshots.append(row)
        for save in self._planned.pop(seq.seq_id, []):  # made by no step that ran (aborted, never launched)
            if save.branch is not None:
                self._planned_branches.discard(save.branch)
            if not save.own:
                self.free_snapshots.append(save.row)
        self._branches.pop(seq.seq_id, None)
        self._rollbacks.pop(seq.seq_id, None)
        self.arrived(seq, ok=False)  # a load it was waiting for (aborted while loading)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1

    def _take_snapshot_row(self, avoid: set[int] | frozenset[int] = frozenset()) -> int:
        """A free row, or the least recently used cached one neither in `avoid` nor pinned (its snapshot
        spilled); -1."""
        if self.free_snapshots:
            return self.free_snapshots.pop()
        for block_hash, row in self.cache.items():
            if row in avoid or self._pinned[row] > 0:
                continue
            del self.cache[block_hash]  # the loop ends here
            self.events.evict(block_hash)
            if self.spill is not None:
                self.spill(block_hash, row)
            return row
        return -1

    def _cache_snapshot(self, block_hash: int, row: int) -> None:
        if block_hash in self.cache:
            self.free_snapshots.append(row)
        else:
            self.cache[block_hash] = row
            self.events.store(block_hash)
