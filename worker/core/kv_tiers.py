"""The prefix cache's lower tiers as the scheduler sees them: which block hashes host memory and the disk
hold, least recently used out first, and the copies that keep them so, recorded as the step's KVTransfers
(worker/step.py) for the runner to make on every rank (worker/runner/kv_offload.py).

When a cached block is freed on the device (no request holds it, though it stays a prefix-cache hit there
until recycled), it is copied down: into a host slot, and from there (or straight from the device when
there is no host tier) into a disk file. Host and disk are write-through: the host tier evicts without
writing anything. A device block recycled while its copy down may still be running is fenced. A hit in a
lower tier is copied back up into a device block; a load that some rank could not make (a disk file gone
or corrupt) comes back in the step's output and its hash is forgotten, as is a block whose write to disk
failed. On a CPU the device cache and the host tier are both RAM: there the disk tier adds capacity.

A hybrid model's state snapshots (worker/core/recurrent_states.py) go down with the blocks they end, so
that a hit from a lower tier resumes its linear layers from the snapshot kept there: a snapshot evicted
from the device's rows (`spill_state`) is copied into a host state row beside its block's host slot, and
into its block's disk file, where a lower tier holds that block without one. A hit whose last block has
one there brings it back up into a device snapshot row (`load` with a state row). A host state row is
recycled least recently used first (its block stays, without a state) and goes with its block's slot; the
disk tier caps the bytes of its files, those holding a state the larger.

Plain bookkeeping on rank 0: the runners fill the same host slots, state rows and files on every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nanovllm.common.block_hash import HashChanges
from nanovllm.worker.step import KVLoad, KVStore, KVTransfers, StateStore


class HostIndex:
    """`capacity` host slots: the hash each holds, least recently used first, and the free ones; and
    `state_capacity` host state rows for a hybrid model's snapshots, each beside a slot's block."""

    def __init__(self, capacity: int, state_capacity: int = 0) -> None:
        self.capacity = capacity
        self.index: OrderedDict[int, int] = OrderedDict()  # block hash -> slot
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.state_capacity = state_capacity
        self.states: OrderedDict[int, int] = OrderedDict()  # block hash (in `index`) -> state row
        self.free_state_rows = list(range(state_capacity - 1, -1, -1))

    def take_slot(self) -> tuple[int, int | None]:
        """A slot for a new block, and the hash it evicted, if it had to (with its state row, if any)."""
        if self.free_slots:
            return self.free_slots.pop(), None
        evicted, slot = self.index.popitem(last=False)
        if evicted in self.states:
            self.free_state_rows.append(self.states.pop(evicted))
        return slot, evicted

    def take_state_row(self, avoid: set[int]) -> int:
        """A state row for a new snapshot: a free one, or the least recently used one's not in `avoid`
        (its block stays); -1 when every one is in `avoid`."""
        if self.free_state_rows:
            return self.free_state_rows.pop()
        for block_hash, row in self.states.items():
            if row not in avoid:
                del self.states[block_hash]  # the loop ends here
                return row
        return -1


class DiskIndex:
    """The hashes with a file in the disk tier, least recently used first, and whether each file holds a
    state snapshot too: at most `capacity` bytes of files, `file_bytes` each and `state_bytes` more with a
    snapshot; `found`: those a previous run left (oldest first, with whether they hold one), which the
    runner found intact at start."""

    def __init__(
        self, capacity: int, found: list[tuple[int, bool]], file_bytes: int, state_bytes: int = 0
    ) -> None:
        self.capacity = capacity
        self.file_bytes = file_bytes
        self.state_bytes = state_bytes
        self.index: OrderedDict[int, bool] = OrderedDict(found)
        self.held_bytes = sum(self.size(has_state) for has_state in self.index.values())

    def size(self, has_state: bool) -> int:
        return self.file_bytes + (self.state_bytes if has_state else 0)


@dataclass
class TierCounts:
    hits: int = 0
    bytes_down: int = 0
    bytes_up: int = 0


class KVTiers:
    def __init__(
        self,
        host_slots: int,
        disk: DiskIndex | None,
        block_nbytes: int,
        host_state_rows: int = 0,
        state_nbytes: int = 0,
    ) -> None:
        """`block_nbytes`, `state_nbytes`: one block's and one state snapshot's bytes (each rank's share)."""
        self.host = HostIndex(host_slots, host_state_rows) if host_slots else None
        self.disk = disk
        self.block_nbytes = block_nbytes
        self.state_nbytes = state_nbytes
        self.counts = {"host": TierCounts(), "disk": TierCounts()}
        self.events = HashChanges()
        if disk is not None:
            self.events.stored.update(disk.index)
        self.transfers = KVTransfers()  # decided since the last step
        self._copying: set[int] = set()  # device blocks copied down since they were last recycled

    def take_events(self) -> HashChanges:
        """How the hashes held below the device changed since the last call (for the routers)."""
        events, self.events = self.events, HashChanges()
        return events

    def take_transfers(self) -> KVTransfers:
        """The copies decided since the last call, for the step about to run."""
        transfers, self.transfers = self.transfers, KVTransfers()
        return transfers

    def where(self, block_hash: int) -> str | None:
        """The tier holding `block_hash`: "host", "disk", or None."""
        if self.host is not None and block_hash in self.host.index:
            return "host"
        if self.disk is not None and block_hash in self.disk.index:
            return "disk"
        return None

    def has_state(self, block_hash: int) -> bool:
        """Whether a lower tier holds a state snapshot beside the block of `block_hash`."""
        if self.host is not None and block_hash in self.host.states:
            return True
        return self.disk is not None and self.disk.index.get(block_hash, False)

    def held(self) -> list[int]:
        """Every hash a lower tier holds."""
        hashes = set(self.host.index) if self.host is not None else set()
        if self.disk is not None:
            hashes.update(self.disk.index)
        return sorted(hashes)

    @property
    def num_blocks(self) -> dict[str, int]:
        return {
            "host": len(self.host.index) if self.host else 0,
            "disk": len(self.disk.index) if self.disk else 0,
        }

    def offer(self, block_id: int, block_hash: int) -> None:
        """A cached device block was freed: copy it down unless a lower tier holds its hash already."""
        on_disk = self.disk is not None and block_hash in self.disk.index
        host_slot = -1
        if self.host is not None:
            if block_hash in self.host.index:
                self.host.index.move_to_end(block_hash)
                return
            host_slot, evicted = self.host.take_slot()
            if evicted is not None and self.where(evicted) is None:
                self.events.evict(evicted)
            self.host.index[block_hash] = host_slot
        elif on_disk:
            assert self.disk is not None
            self.disk.index.move_to_end(block_hash)
            return
        to_disk = self.disk is not None and not on_disk
        if to_disk:
            self._admit_to_disk(block_hash)
        self.events.store(block_hash)
        self.transfers.stores.append(KVStore(block_id, block_hash, host_slot, to_disk))
        self._copying.add(block_id)
        self.counts["host" if self.host is not None else "disk"].bytes_down += self.block_nbytes

    def _admit_to_disk(self, block_hash: int) -> None:
        disk = self.disk
        assert disk is not None  # called only with a disk tier
        if block_hash in self.transfers.disk_drops:  # evicted earlier in this step: the write replaces it
            self.transfers.disk_drops.remove(block_hash)
        disk.index[block_hash] = False
        disk.held_bytes += disk.file_bytes
        self._fit_disk()

    def _fit_disk(self) -> None:
        """Evict the least recently used files until the disk tier's files fit its capacity."""
        disk = self.disk
        assert disk is not None  # called only with a disk tier
        while disk.held_bytes > disk.capacity and disk.index:
            evicted, has_state = disk.index.popitem(last=False)
            disk.held_bytes -= disk.size(has_state)
            self.transfers.disk_drops.append(evicted)
            if self.where(evicted) is None:
                self.events.evict(evicted)

    def spill_state(self, block_hash: int, row: int) -> None:
        """A hybrid model's snapshot of the state at the end of the block of `block_hash`, in device row
        `row`, leaves the device's snapshots (the row is about to be written again): copy it down beside
        that block, in the step about to run, into each lower tier that holds the block without one. A row
        this step loads a snapshot into holds nothing yet (a lower tier holds that one already), and a host
        state row this step loads from is not written (the step's state stores come before its loads)."""
        loads = self.transfers.loads
        if any(load.state_row == row for load in loads):
            return
        host, disk = self.host, self.disk
        host_row = -1
        if host is not None and host.state_capacity and block_hash in host.index:
            if block_hash in host.states:
                host.states.move_to_end(block_hash)
            else:
                host_row = host.take_state_row({load.host_state_row for load in loads})
                if host_row >= 0:
                    host.states[block_hash] = host_row
        to_disk = disk is not None and disk.index.get(block_hash) is False
        if to_disk:
            assert disk is not None
            disk.index[block_hash] = True
            disk.index.move_to_end(block_hash)
            disk.held_bytes += disk.state_bytes
            self._fit_disk()
        if host_row < 0 and not to_disk:
            return
        self.transfers.state_stores.append(StateStore(row, block_hash, host_row, to_disk))
        self.counts["host" if host_row >= 0 else "disk"].bytes_down += self.state_nbytes

    def recycle(self, block_id: int) -> None:
        """Device block `block_id` is about to be written again: its copy down, if any, must be done first."""
        if block_id in self._copying:
            self._copying.remove(block_id)
            self.transfers.fences.append(block_id)

    def load(self, block_hash: int, block_id: int, state_row: int = -1) -> bool:
        """Copy the block of `block_hash` (held by a lower tier: see `where`) up into device block
        `block_id` in the next step, and with `state_row` (>= 0) the state snapshot kept beside it (see
        `has_state`) into that device snapshot row; returns whether it comes from disk."""
        host = self.host
        host_state_row = -1
        if host is not None and block_hash in host.index and (state_row < 0 or block_hash in host.states):
            host.index.move_to_end(block_hash)
            slot = host.index[block_hash]
            if state_row >= 0:
                host.states.move_to_end(block_hash)
                host_state_row = host.states[block_hash]
        else:
            assert self.disk is not None  # a lower tier holds it (and its state, when asked for)
            self.disk.index.move_to_end(block_hash)
            slot = -1
        self.transfers.loads.append(KVLoad(block_hash, block_id, slot, state_row, host_state_row))
        return slot < 0

    def loaded(self, loads: list[KVLoad], failed: list[KVLoad]) -> None:
        """A step made `loads`, all but `failed`: count the hits, forget the hashes that failed."""
        failed_hashes = {load.block_hash for load in failed}
        for load in loads:
            if load.block_hash in failed_hashes:
                continue
            counts = self.counts["host" if load.host_slot >= 0 else "disk"]
            counts.hits += 1
            counts.bytes_up += self.block_nbytes + (self.state_nbytes if load.state_row >= 0 else 0)
        for block_hash in failed_hashes:
            self.forget_on_disk(block_hash)

    def forget_on_disk(self, block_hash: int) -> None:
        """The disk tier does not hold `block_hash` after all (its write or its read failed)."""
        if self.disk is None or block_hash not in self.disk.index:
            return
        self.disk.held_bytes -= self.disk.size(self.disk.index.pop(block_hash))
        if self.where(block_hash) is None:
            self.events.evict(block_hash)
