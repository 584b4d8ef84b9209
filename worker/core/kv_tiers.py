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

Plain bookkeeping on rank 0: the runners fill the same host slots and files on every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nanovllm.common.block_hash import HashChanges
from nanovllm.worker.step import KVLoad, KVStore, KVTransfers


class HostIndex:
    """`capacity` host slots: the hash each holds, least recently used first, and the free ones."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.index: OrderedDict[int, int] = OrderedDict()  # block hash -> slot
        self.free_slots = list(range(capacity - 1, -1, -1))

    def take_slot(self) -> tuple[int, int | None]:
        """A slot for a new block, and the hash it evicted, if it had to."""
        if self.free_slots:
            return self.free_slots.pop(), None
        evicted, slot = self.index.popitem(last=False)
        return slot, evicted


class DiskIndex:
    """The hashes with a file in the disk tier, least recently used first, at most `capacity` of them;
    `found`: those a previous run left (oldest first), which the runner found intact at start."""

    def __init__(self, capacity: int, found: list[int]) -> None:
        self.capacity = capacity
        self.index: OrderedDict[int, None] = OrderedDict((h, None) for h in found)


@dataclass
class TierCounts:
    hits: int = 0
    bytes_down: int = 0
    bytes_up: int = 0


class KVTiers:
    def __init__(self, host_slots: int, disk: DiskIndex | None, block_nbytes: int) -> None:
        self.host = HostIndex(host_slots) if host_slots else None
        self.disk = disk
        self.block_nbytes = block_nbytes
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
        disk.index[block_hash] = None
        while len(disk.index) > disk.capacity:
            evicted, _ = disk.index.popitem(last=False)
            self.transfers.disk_drops.append(evicted)
            if self.where(evicted) is None:
                self.events.evict(evicted)

    def recycle(self, block_id: int) -> None:
        """Device block `block_id` is about to be written again: its copy down, if any, must be done first."""
        if block_id in self._copying:
            self._copying.remove(block_id)
            self.transfers.fences.append(block_id)

    def load(self, block_hash: int, block_id: int) -> bool:
        """Copy the block of `block_hash` (held by a lower tier: see `where`) up into device block
        `block_id` in the next step; returns whether it comes from disk."""
        if self.host is not None and block_hash in self.host.index:
            self.host.index.move_to_end(block_hash)
            slot = self.host.index[block_hash]
        else:
            assert self.disk is not None  # a lower tier holds it
            self.disk.index.move_to_end(block_hash)
            slot = -1
        self.transfers.loads.append(KVLoad(block_hash, block_id, slot))
        return slot < 0

    def loaded(self, loads: list[KVLoad], failed: list[KVLoad]) -> None:
        """A step made `loads`, all but `failed`: count the hits, forget the hashes that failed."""
        failed_hashes = {load.block_hash for load in failed}
        for load in loads:
            if load.block_hash in failed_hashes:
                continue
            counts = self.counts["host" if load.host_slot >= 0 else "disk"]
            counts.hits += 1
            counts.bytes_up += self.block_nbytes
        for block_hash in failed_hashes:
            self.forget_on_disk(block_hash)

    def forget_on_disk(self, block_hash: int) -> None:
        """The disk tier does not hold `block_hash` after all (its write or its read failed)."""
        if self.disk is None or block_hash not in self.disk.index:
            return
        del self.disk.index[block_hash]
        if self.where(block_hash) is None:
            self.events.evict(block_hash)
