"""The prefix cache's lower tiers: host memory, then local disk, keyed by the block hashes the device
cache uses (worker/core/block_manager.py).

When a cached block is freed on the device (no request holds it, though it stays a prefix-cache hit there
until recycled), its KV is copied down: into a host slot, and from there (or straight from the device
when there is no host tier) into a disk file. The copies run on one offload thread, in order, so they
stay off the step's critical path; on CUDA the device-to-host copy is queued on a stream of its own. A
device block is recycled only once its copy is done (`fence`). A prefix hit in a lower tier is copied
back up into a device block when the scheduler admits the request (`load`), before any step computes
past it. A disk file that fails its check is deleted and reported as a miss, so the prefix is recomputed.

The host tier and its disk tier are write-through: a block goes to both, and the host tier evicts without
writing anything. On a CPU the device cache and the host tier are both RAM: there the disk tier is the one
that adds capacity.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nanovllm.common.block_hash import HashChanges
from nanovllm.common.logging import get_logger
from nanovllm.worker.runner.kv_disk import DiskTier, TierFaults

log = get_logger(__name__)


@dataclass
class TierStats:
    """One tier's traffic since start: blocks served from it, bytes and seconds each way."""

    hits: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    seconds_down: float = 0.0
    seconds_up: float = 0.0
    faults: TierFaults = field(default_factory=lambda: TierFaults("host"))


class HostTier:
    """`num_slots` blocks of host memory (pinned when the device is a GPU), least recently used out first."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.buffer = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self.index: OrderedDict[int, int] = OrderedDict()  # block hash -> slot
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.busy: dict[int, Future] = {}  # slot -> the offload task still reading or writing it

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]

    def take_slot(self) -> tuple[int, int | None]:
        """A slot for a new block, and the hash it evicted, if it had to."""
        if self.free_slots:
            return self.free_slots.pop(), None
        evicted, slot = self.index.popitem(last=False)
        return slot, evicted


class KVOffload:
    """Host and disk tiers under one device KV cache of shape (2, layers, blocks, block_size, heads, dim)."""

    def __init__(self, kv_cache: torch.Tensor, host_blocks: int, disk: DiskTier | None) -> None:
        self.kv_cache = kv_cache
        block_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        self.block_nbytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        on_gpu = kv_cache.device.type == "cuda"
        self.host = HostTier(host_blocks, block_shape, kv_cache.dtype, on_gpu) if host_blocks else None
        self.disk = disk if disk is not None and disk.writable else None
        self.stats = {
            "host": TierStats(),
            "disk": TierStats(faults=disk.faults if disk else TierFaults("disk")),
        }
        self.events = HashChanges()
        if self.disk is not None:
            self.events.stored.update(self.disk.index)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._stream = torch.cuda.Stream(kv_cache.device) if on_gpu else None
        self._copying: dict[int, Future | torch.cuda.Event] = {}  # device block -> its copy down

    def take_events(self) -> HashChanges:
        """How the hashes held below the device changed since the last call (for the routers)."""
        events, self.events = self.events, HashChanges()
        return events

    def where(self, block_hash: int) -> str | None:
        """The tier holding `block_hash`: "host", "disk", or None."""
        if self.host is not None and block_hash in self.host.index:
            return "host"
        if self.disk is not None:
            self._forget_failed_writes()
            if block_hash in self.disk.index:
                return "disk"
        return None

    def held(self) -> list[int]:
        """Every hash a lower tier holds."""
        self._forget_failed_writes()
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
        started = time.perf_counter()
        on_disk = self.disk is not None and block_hash in self.disk.index
        if self.host is not None:
            if block_hash in self.host.index:
                self.host.index.move_to_end(block_hash)
                return
            slot, evicted = self.host.take_slot()
            if evicted is not None and self.where(evicted) is None:
                self.events.evict(evicted)
            if slot in self.host.busy:  # the slot's last block is still being written to disk
                self.host.busy.pop(slot).result()
            self.host.index[block_hash] = slot
            staging = self.host.buffer[slot]
        elif on_disk:
            self.disk.index.move_to_end(block_hash)
            return
        else:
            staging = None
        if not on_disk and self.disk is not None:
            self._admit_to_disk(block_hash)
        elif staging is None:
            return
        self.events.store(block_hash)
        write_to_disk = self.disk is not None and not on_disk
        task = self._copy_down(block_id, block_hash, staging, write_to_disk)
        if self.host is not None:
            self.host.busy[slot] = task
        tier = "host" if self.host is not None else "disk"
        self.stats[tier].bytes_down += self.block_nbytes
        self.stats[tier].seconds_down += time.perf_counter() - started

    def _admit_to_disk(self, block_hash: int) -> None:
        disk = self.disk
        disk.index[block_hash] = None
        while len(disk.index) > disk.capacity:
            evicted = next(iter(disk.index))
            del disk.index[evicted]
            self._thread.submit(disk.path(evicted).unlink, missing_ok=True)
            if self.where(evicted) is None:
                self.events.evict(evicted)

    def _copy_down(
        self, block_id: int, block_hash: int, staging: torch.Tensor | None, write_to_disk: bool
    ) -> Future:
        source = self.kv_cache[:, :, block_id]
        disk = self.disk if write_to_disk else None
        if self._stream is not None:  # CUDA: the copy on the offload stream, the thread waits for it
            staging = staging if staging is not None else torch.empty_like(source, device="cpu").pin_memory()
            self._stream.wait_stream(torch.cuda.current_stream(source.device))
            with torch.cuda.stream(self._stream):
                staging.copy_(source, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._copying[block_id] = done

            def task() -> None:
                done.synchronize()
                if disk is not None:
                    disk.write(block_hash, staging)

            return self._thread.submit(task)

        def copy_task() -> None:
            block = staging.copy_(source) if staging is not None else source.contiguous()
            if disk is not None:
                disk.write(block_hash, block)

        future = self._thread.submit(copy_task)
        self._copying[block_id] = future
        return future

    def fence(self, block_id: int) -> None:
        """Block `block_id` is about to be overwritten: its copy down must be done first."""
        copying = self._copying.pop(block_id, None)
        if copying is None:
            return
        if isinstance(copying, Future):
            copying.result()
        else:  # CUDA: the device waits, the host does not
            torch.cuda.current_stream(self.kv_cache.device).wait_event(copying)

    def load(self, block_hash: int, block_id: int) -> bool:
        """Copy the block of `block_hash` up into device block `block_id`; False when no lower tier can
        serve it (a disk file that failed its check is deleted: the caller recomputes it)."""
        started = time.perf_counter()
        target = self.kv_cache[:, :, block_id]
        tier = self.where(block_hash)
        if tier == "host":
            slot = self.host.index[block_hash]
            self.host.index.move_to_end(block_hash)
            if slot in self.host.busy:
                self.host.busy.pop(slot).result()
            target.copy_(self.host.buffer[slot], non_blocking=True)
        elif tier == "disk":
            self.drain()
            payload = self.disk.read(block_hash)
            if payload is None:
                self._evicted_if_gone(block_hash)
                return False
            self.disk.index.move_to_end(block_hash)
            block = torch.frombuffer(bytearray(payload), dtype=target.dtype).view(target.shape)
            target.copy_(block)
        else:
            return False
        stats = self.stats[tier]
        stats.hits += 1
        stats.bytes_up += self.block_nbytes
        stats.seconds_up += time.perf_counter() - started
        return True

    def drain(self) -> None:
        """Wait until the offload thread has done what it was given (a disk read must not race its write)."""
        self._thread.submit(lambda: None).result()
        self._forget_failed_writes()

    def _forget_failed_writes(self) -> None:
        while self.disk is not None and self.disk.failed_writes:
            block_hash = self.disk.failed_writes.popleft()
            self.disk.index.pop(block_hash, None)
            self._evicted_if_gone(block_hash)

    def _evicted_if_gone(self, block_hash: int) -> None:
        if self.where(block_hash) is None:
            self.events.evict(block_hash)

    def close(self) -> None:
        """Finish the copies and writes under way (a disk tier's files are then complete)."""
        self._thread.shutdown(wait=True)
