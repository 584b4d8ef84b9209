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

A hybrid model's sequence also holds a state slot, and its prefix hits end where a snapshot of that state
does: worker/core/recurrent_states.py, which the block manager calls where blocks are taken, hashed and
freed. With lower tiers, a snapshot evicted from the device goes down beside its block, and a prompt's
hits in the lower tiers end at the last block with a snapshot on the device or kept beside it below, which
comes back up with the block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from nanovllm.common.block_hash import HashChanges, hash_block
from nanovllm.common.errors import ConfigError
from nanovllm.worker.core.kv_tiers import KVTiers
from nanovllm.worker.core.recurrent_states import RecurrentStates
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
        states: RecurrentStates | None = None,
    ) -> None:
        """`states`: a hybrid model's state slots and snapshots (None: the model has no per-request state)."""
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"need at least one block of one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lower_tiers = lower_tiers if enable_prefix_caching else None
        self.states = states
        if states is not None and self.lower_tiers is not None:
            states.spill = self.lower_tiers.spill_state
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Blocks with ref_count 0, oldest-freed first; cached ones among them are still hits until recycled.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache_events = CacheEvents()  # changes to `cached` not yet reported (see take_cache_events)
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
        return (
            bool(self.cache_events)
            or bool(self.lower_tiers is not None and self.lower_tiers.events)
            or bool(self.states is not None and self.states.events)
        )

    def take_cache_events(self) -> CacheEvents:
        """The changes to the cached hashes (the device's and the lower tiers') since the last call."""
        events, self.cache_events = self.cache_events, CacheEvents()
        if self.lower_tiers is not None:
            lower = self.lower_tiers.take_events()
            events.lower_stored, events.lower_evicted = lower.stored, lower.evicted
        if self.states is not None:
            events.state = self.states.take_events()
        return events

    def lower_cached(self) -> list[int]:
        """Every hash the lower tiers hold."""
        return self.lower_tiers.held() if self.lower_tiers is not None else []

    def state_cached(self) -> list[int]:
        """The hashes of the blocks that end at a state snapshot (a hybrid model's resume points)."""
        return sorted(self.states.cache) if self.states is not None else []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence, admitting: dict[int, Sequence] | None = None) -> list[int]:
        """Cached blocks covering a prefix of `seq`. The last token is always left out so that at least one
        token is computed and yields logits.

        A hybrid model's hits end at the last block with a snapshot of its state. Where `seq` shares more
        blocks than that with prompts seen before, the end of what it shares is a branch point, which it
        keeps a snapshot at (worker/core/recurrent_states.py). Seen before: the KV cache's blocks, and the
        prompts in `admitting` (those its step admitted before it, whose blocks are not cached yet, by the
        hash of their first block; it joins them)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev = seq.cache_salt
        first = None  # the hash of its first block
        resumable = 0  # hits up to the last block whose state a snapshot holds (a hybrid model's)
        for i in range((seq.num_tokens - 1) // self.block_size):
            prev = hash_block(prev, seq.block_key(i, self.block_size))
            if not i:
                first = prev
            block_id = self.cached.get(prev)
            if block_id is None:
                break
            hits.append(block_id)
            if self.states is not None and self.states.resumes_at(prev):
                resumable = len(hits)
        if self.states is None:
            return hits
        if self.states.caching and first is not None:
            shared = len(hits)
            other = seq if admitting is None else admitting.setdefault(first, seq)
            if other is not seq:
                common = _common_prefix(seq.token_ids, other.token_ids)
                shared = max(shared, min(common, seq.num_tokens - 1) // self.block_size)
            if shared > resumable:
                self.states.note_branch(seq, shared * self.block_size)
        return hits[:resumable]

    def lower_hits(self, seq: Sequence, device_hits: list[int]) -> list[int]:
        """The hashes of the blocks that continue `seq`'s prefix in the lower tiers past its device hits
        (get_computed_blocks'; the last token left out as there). A hybrid model's end at the last block
        whose state a snapshot holds, on the device or beside the block in a lower tier (then with a
        device row free to take it)."""
        tiers, states = self.lower_tiers, self.states
        if tiers is None:
            return []
        hashes: list[int] = []
        resumable = 0
        prev = self.blocks[device_hits[-1]].block_hash if device_hits else seq.cache_salt
        for i in range(len(device_hits), (seq.num_tokens - 1) // self.block_size):
            prev = hash_block(prev, seq.block_key(i, self.block_size))
            if tiers.where(prev) is None:
                break
            hashes.append(prev)
            if states is not None and (states.resumes_at(prev) or tiers.has_state(prev)):
                resumable = len(hashes)
        if states is None:
            return hashes
        if resumable and not states.resumes_at(hashes[resumable - 1]) and not states.load_row_available():
            # No row to bring the snapshot up into: to the last one on the device.
            resumable = max((i + 1 for i in range(resumable) if states.resumes_at(hashes[i])), default=0)
        return hashes[:resumable]

    def load_lower_hits(self, seq: Sequence, hashes: list[int]) -> bool:
        """Copy the blocks of `hashes` up, in the next step, into the blocks `seq` was just given after its
        device hits (allocate_slots made room for them as new tokens), and a hybrid model's snapshot at the
        last of them when it is kept below. Returns whether some come from disk, where a load can fail
        (finish_loads then waits for the step's output)."""
        first = len(seq.block_hashes)
        states = self.states
        state_row = -1
        if states is not None:  # it resumes at the last one, or where its device hits end if a load fails
            states.pin(seq, seq.block_hashes[-1:])
            if states.resumes_at(hashes[-1]):
                states.pin(seq, hashes[-1:])
            else:
                state_row = states.take_load_row(seq, hashes[-1])
        from_disk = False
        assert self.lower_tiers is not None  # `hashes` are lower tiers' hits
        for i, block_hash in enumerate(hashes):
            row = state_row if i == len(hashes) - 1 else -1
            from_disk |= self.lower_tiers.load(block_hash, seq.block_table[first + i], row)
        return from_disk

    def finish_loads(self, seq: Sequence, hashes: list[int], failed: set[int]) -> int:
        """The step made `seq`'s loads of `hashes` (load_lower_hits), all but those of the hashes in
        `failed`: the blocks before the first failure join the prefix cache (an identical block computed
        or loaded meanwhile keeps the entry); returns how many. A hybrid model's end at the last of them
        with a snapshot (the one that came up with the last block, if every load was made): the
        sequence computes the others again."""
        first = len(seq.block_hashes)
        kept = len(hashes)
        if failed.intersection(hashes):
            kept = next(i for i, h in enumerate(hashes) if h in failed)
        if self.states is not None:
            self.states.arrived(seq, ok=kept == len(hashes))
            while kept and not self.states.resumes_at(hashes[kept - 1]):
                kept -= 1
        loaded = 0
        for block_hash in hashes[:kept]:
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
        if self.states is not None and not self.states.take_slot(seq):
            return False
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
            block_hash = hash_block(prev, seq.block_key(i, self.block_size))
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block_hash not in self.cached:  # an identical block computed concurrently keeps the entry
                self.cached[block_hash] = block.block_id
                block.block_hash = block_hash
                self.cache_events.store(block_hash)
        if self.states is not None:
            self.states.publish(seq)

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
        if self.states is not None:
            self.states.release(seq)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share: a binary search over slices, compared in C."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; they differ within [:high + 1]
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low
