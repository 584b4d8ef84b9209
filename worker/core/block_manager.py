"""Paged KV-cache block allocation with prefix caching.

A full block is identified by a hash chaining the previous block's hash with its own token ids, so equal
hashes mean equal prefixes; a request with a LoRA adapter starts its chain from the adapter's salt, so
prefixes computed under different adapters never meet. Blocks are shared by reference count. A block enters the hash table only
after its KV has been computed (`cache_full_blocks`), never at allocation. Freed blocks keep their hash
and stay reusable until they are recycled, least recently freed first.

With lower tiers (worker/core/kv_tiers.py), a freed cached block is also copied down to host memory or
disk; a prompt's hash chain continues there past its last device hit, and those blocks are copied back up
into fresh device blocks by the step that admits the request (`load_lower_hits`), joining the prefix cache
at once from host memory, and from disk once that step says they arrived (`finish_loads`).

A hybrid model's sequence also holds a state slot (the linear-attention layers' per-request state) from
its first blocks until it frees them: admission needs a free slot as it needs free blocks. Its prefix
cache needs the state too: a hit resumes the linear layers from a snapshot of the state at the hit's last
block boundary, so hits end at the last block with one. Snapshot rows (beside the live slots in the same
state tensors) are kept by block hash, least recently used recycled first. A step copies the state into
them at the boundaries the scheduler asks for (`plan_state_saves`): every `snapshot_interval` tokens of a
sequence (shared prefixes), and its last boundary, into the sequence's own row, which it leaves behind
when it frees its blocks (a conversation's next turn). They join the cache once the step has run and
their blocks' hashes are known (`cache_full_blocks`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from nanovllm.common.block_hash import HashChanges, hash_block
from nanovllm.common.errors import ConfigError
from nanovllm.worker.core.kv_tiers import KVTiers
from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import KVLoad, KVTransfers


@dataclass
class CacheEvents(HashChanges):
    """The device's cached hashes' changes (HashChanges), and the lower tiers' beside them (filled by
    BlockManager.take_cache_events)."""

    lower_stored: set[int] = field(default_factory=set)
    lower_evicted: set[int] = field(default_factory=set)
    # A hybrid model's: the hashes of blocks that end at a state snapshot (a hit may resume there).
    state: HashChanges = field(default_factory=HashChanges)

    def __bool__(self) -> bool:
        return bool(self.stored or self.evicted or self.lower_stored or self.lower_evicted or self.state)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        lower_tiers: KVTiers | None = None,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        snapshot_interval: int = 0,
    ) -> None:
        """`num_state_slots`: a hybrid model's state slots (0: the model has no per-request state), rows
        0.. of its state tensors; `num_state_snapshots`: the snapshot rows after them, taken every
        `snapshot_interval` tokens of a sequence and at its last block boundary."""
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"need at least one block of one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lower_tiers = lower_tiers if enable_prefix_caching else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Blocks with ref_count 0, oldest-freed first; cached ones among them are still hits until recycled.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache_events = CacheEvents()  # changes to `cached` not yet reported (see take_cache_events)
        self.has_state_slots = num_state_slots > 0
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped lowest first
        self.caches_state = self.has_state_slots and enable_prefix_caching and num_state_snapshots > 0
        self.snapshot_interval = snapshot_interval
        self.free_snapshots = list(range(num_state_slots + num_state_snapshots - 1, num_state_slots - 1, -1))
        self.state_cache: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot row, LRU first
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def has_transfers(self) -> bool:
        """Whether copies to or from the lower tiers wait for a step."""
        return self.lower_tiers is not None and bool(self.lower_tiers.transfers)

    @property
    def has_cache_events(self) -> bool:
        """Whether the device's or a lower tier's cached hashes changed since the last take_cache_events."""
        return bool(self.cache_events) or bool(self.lower_tiers is not None and self.lower_tiers.events)

    def take_cache_events(self) -> CacheEvents:
        """The changes to the cached hashes (the device's and the lower tiers') since the last call."""
        events, self.cache_events = self.cache_events, CacheEvents()
        if self.lower_tiers is not None:
            lower = self.lower_tiers.take_events()
            events.lower_stored, events.lower_evicted = lower.stored, lower.evicted
        return events

    def lower_cached(self) -> list[int]:
        """Every hash the lower tiers hold."""
        return self.lower_tiers.held() if self.lower_tiers is not None else []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of `seq`. The last token is always left out so that at least one
        token is computed and yields logits."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev = seq.cache_salt
        resumable = 0  # hits up to the last block whose state a snapshot holds (a hybrid model's)
        for i in range((seq.num_tokens - 1) // self.block_size):
            prev = hash_block(prev, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.cached.get(prev)
            if block_id is None:
                break
            hits.append(block_id)
            if prev in self.state_cache:
                resumable = len(hits)
        return hits[:resumable] if self.has_state_slots else hits

    def state_restore(self, seq: Sequence) -> int:
        """The snapshot row a hybrid sequence admitted on prefix hits resumes from (-1: none, no hits)."""
        if not self.has_state_slots or not seq.block_hashes:
            return -1
        row = self.state_cache.get(seq.block_hashes[-1])
        if row is None:
            raise RuntimeError(f"request {seq.request_id!r} hit blocks past the last state snapshot")
        self.state_cache.move_to_end(seq.block_hashes[-1])
        return row

    def plan_state_saves(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """(boundary, snapshot row) of the copies of `seq`'s state that the step computing its tokens
        [start, end) makes: at each multiple of snapshot_interval it reaches, into a fresh row, and at the
        last block boundary it reaches, into the sequence's own row. Rows run out only when every one is
        some running sequence's own: those copies are then not made."""
        last = end // self.block_size * self.block_size
        if last <= start:
            return []
        saves = []
        first_interval = (start // self.snapshot_interval + 1) * self.snapshot_interval
        for boundary in range(first_interval, last + 1, self.snapshot_interval):
            row = self._take_snapshot_row()
            if row < 0:
                break
            saves.append((boundary, row))
            seq.pending_snapshots.append((boundary, row, False))
        if not saves or saves[-1][0] != last:
            if seq.state_snapshot < 0:
                seq.state_snapshot = self._take_snapshot_row()
            if seq.state_snapshot >= 0:
                saves.append((last, seq.state_snapshot))
                seq.pending_snapshots.append((last, seq.state_snapshot, True))
        return saves

    def _take_snapshot_row(self) -> int:
        if self.free_snapshots:
            return self.free_snapshots.pop()
        if self.state_cache:
            block_hash, row = self.state_cache.popitem(last=False)
            self.cache_events.state.evict(block_hash)
            return row
        return -1

    def _publish_snapshots(self, seq: Sequence) -> None:
        """The copies the last step made of `seq`'s state: its own row now holds its last boundary's
        state; the others join the cache under their block's hash (a row whose hash is cached already
        goes back to the free rows)."""
        for boundary, row, own in seq.pending_snapshots:
            if own:
                seq.snapshot_tokens = boundary
            else:
                self._cache_snapshot(seq.block_hashes[boundary // self.block_size - 1], row)
        seq.pending_snapshots = []

    def _cache_snapshot(self, block_hash: int, row: int) -> None:
        if block_hash in self.state_cache:
            self.free_snapshots.append(row)
        else:
            self.state_cache[block_hash] = row
            self.cache_events.state.store(block_hash)

    def lower_hits(self, seq: Sequence, device_hits: list[int]) -> list[int]:
        """The hashes of the blocks that continue `seq`'s prefix in the lower tiers past its device hits
        (get_computed_blocks'; the last token left out as there)."""
        if self.lower_tiers is None:
            return []
        hashes: list[int] = []
        prev = self.blocks[device_hits[-1]].block_hash if device_hits else seq.cache_salt
        for i in range(len(device_hits), (seq.num_tokens - 1) // self.block_size):
            prev = hash_block(prev, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if self.lower_tiers.where(prev) is None:
                break
            hashes.append(prev)
        return hashes

    def load_lower_hits(self, seq: Sequence, hashes: list[int]) -> bool:
        """Copy the blocks of `hashes` up, in the next step, into the blocks `seq` was just given after its
        device hits (allocate_slots made room for them as new tokens). Returns whether some come from disk,
        where a load can fail (finish_loads then waits for the step's output)."""
        first = len(seq.block_hashes)
        from_disk = False
        assert self.lower_tiers is not None  # `hashes` are lower tiers' hits
        for i, block_hash in enumerate(hashes):
            from_disk |= self.lower_tiers.load(block_hash, seq.block_table[first + i])
        return from_disk

    def finish_loads(self, seq: Sequence, hashes: list[int], failed: set[int]) -> int:
        """The step made `seq`'s loads of `hashes` (load_lower_hits), all but those of the hashes in
        `failed`: the blocks before the first failure join the prefix cache (an identical block computed
        or loaded meanwhile keeps the entry); returns how many."""
        first = len(seq.block_hashes)
        loaded = 0
        for block_hash in hashes:
            if block_hash in failed:
                break
            block = self.blocks[seq.block_table[first + loaded]]
            seq.block_hashes.append(block_hash)
            if block_hash not in self.cached:
                self.cached[block_hash] = block.block_id
                block.block_hash = block_hash
                self.cache_events.store(block_hash)
            loaded += 1
        if not seq.admitted:
            self.prefix_hit_tokens += loaded * self.block_size
        return loaded

    def loads_done(self, loads: list[KVLoad], failed: list[KVLoad]) -> None:
        """A step made `loads`, all but `failed` (its output says): the lower tiers count their hits and
        forget the hashes that failed."""
        if self.lower_tiers is not None and loads:
            self.lower_tiers.loaded(loads, failed)

    def writes_failed(self, hashes: list[int]) -> None:
        """Copies down to disk that failed: the disk tier does not hold those hashes."""
        for block_hash in hashes:
            assert self.lower_tiers is not None  # they were written by it
            self.lower_tiers.forget_on_disk(block_hash)

    def take_transfers(self) -> KVTransfers:
        """The copies to and from the lower tiers decided since the last call, for the next step."""
        return self.lower_tiers.take_transfers() if self.lower_tiers is not None else KVTransfers()

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | tuple[()] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after those already computed (plus, for a sequence
        being admitted, the prefix-cache hits in `computed_blocks`). Returns False, changing nothing, when
        there are not enough free blocks."""
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = (
            -(-(num_computed + num_new_tokens) // self.block_size)
            - len(seq.block_table)
            - len(computed_blocks)
        )
        if needed <= 0 and not computed_blocks:  # a decode within its last block: the common case
            return True
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - revived:
            return False
        if self.has_state_slots and seq.state_slot < 0:
            if not self.free_state_slots:
                return False
            seq.state_slot = self.free_state_slots.pop()
        if not seq.admitted:  # a request's prompt, once: a preempted one's recomputation is no new query
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            assert block.block_hash is not None  # a prefix-cache hit
            seq.block_hashes.append(block.block_hash)
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if self.lower_tiers is not None:
            self.lower_tiers.recycle(block_id)
        if block.block_hash is not None:  # recycling evicts it from the prefix cache
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                self.cache_events.evict(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` that is full and whose KV is computed. Call after each step."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            block_hash = hash_block(prev, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block_hash not in self.cached:  # an identical block computed concurrently keeps the entry
                self.cached[block_hash] = block.block_id
                block.block_hash = block_hash
                self.cache_events.store(block_hash)
        if seq.pending_snapshots:
            self._publish_snapshots(seq)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks. Tail blocks are freed first so that they are recycled before the
        shared prefix blocks that other requests are more likely to hit."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if self.lower_tiers is not None and block.block_hash is not None:
                    self.lower_tiers.offer(block_id, block.block_hash)
        if seq.state_snapshot >= 0:  # its last boundary's state, left for a next turn's hit
            boundary_blocks = seq.snapshot_tokens // self.block_size
            if 0 < boundary_blocks <= len(seq.block_hashes):
                self._cache_snapshot(seq.block_hashes[boundary_blocks - 1], seq.state_snapshot)
            else:
                self.free_snapshots.append(seq.state_snapshot)
            seq.state_snapshot, seq.snapshot_tokens = -1, 0
        for _, row, own in seq.pending_snapshots:  # made by no step that ran (aborted, or never launched)
            if not own:
                self.free_snapshots.append(row)
        seq.pending_snapshots = []
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1
