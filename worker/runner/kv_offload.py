"""The copies between the device's KV cache and the prefix cache's lower tiers, made by every rank before a
step's forward pass: the step's KVTransfers (worker/step.py), which the scheduler decided
(worker/core/kv_tiers.py) in host slots and disk files this rank holds its share of each block in.

Copies down run on one offload thread, in order, so they stay off the step's critical path; on CUDA the
device-to-host copy is queued on a stream of its own. A device block is written again only once its copy
down is done (a fence). Copies up are made before the forward pass that reads them: from a host slot once
its copy down is done, from a disk file once the thread has written everything it was given. A disk file
that fails its check is deleted and its load reported as failed on every rank, so the request recomputes
the block.

A hybrid model's state snapshot rows (each linear-attention layer's convolution and recurrent rows) go
down the same way beside their block, into a host state row and into the block's file, and come up into
a device snapshot row with a hit that resumes there. A snapshot goes down as its device row is about to
be written again, so that copy is waited for at once (on CUDA by the device, not the host); only its
write to disk is left to the offload thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nanovllm.common.logging import get_logger
from nanovllm.worker.runner.kv_disk import DiskTier, TierFaults
from nanovllm.worker.step import KVLoad, KVStore, KVTransfers, StateStore

log = get_logger(__name__)


@dataclass
class TierTimes:
    """One tier's engine-thread seconds each way since start, and its faults."""

    seconds_down: float = 0.0
    seconds_up: float = 0.0
    faults: TierFaults = field(default_factory=lambda: TierFaults("host"))


class KVOffload:
    """Host slots and disk files under one device KV cache of shape (2, layers, blocks, block_size, heads,
    dim): `host_slots` blocks of host memory (pinned when the device is a GPU), and `disk` when it is
    writable. A hybrid model's `states` (its state tensors, each indexed by row first) have
    `host_state_rows` rows of host memory beside the slots."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        host_slots: int,
        disk: DiskTier | None,
        states: list[torch.Tensor] | None = None,
        host_state_rows: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        block_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        self.block_nbytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        on_gpu = kv_cache.device.type == "cuda"
        self._pin = on_gpu
        self.host_slots = host_slots
        self.host = (
            torch.empty((host_slots, *block_shape), dtype=kv_cache.dtype, pin_memory=on_gpu)
            if host_slots
            else None
        )
        self.states = states or []
        self.state_nbytes = sum(t[0].numel() * t.element_size() for t in self.states)
        self.host_state_rows = host_state_rows if self.states else 0
        self.host_states = [
            torch.empty((self.host_state_rows, *t.shape[1:]), dtype=t.dtype, pin_memory=on_gpu)
            for t in self.states
        ]
        self.disk = disk if disk is not None and disk.writable else None
        self.stats = {
            "host": TierTimes(),
            "disk": TierTimes(faults=disk.faults if disk else TierFaults("disk")),
        }
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._stream = torch.cuda.Stream(kv_cache.device) if on_gpu else None
        self._copying: dict[int, Future | torch.cuda.Event] = {}  # device block -> its copy down
        self._busy: dict[int, Future] = {}  # host slot -> the offload task still reading or writing it
        self._busy_states: dict[int, Future] = {}  # host state row -> the disk write still reading it
        self._unwritten: set[int] = set()  # hashes whose last write to disk failed on this rank
        self._unreported: list[int] = []  # ... not yet handed back by `run` or `drain`

    def run(self, transfers: KVTransfers) -> tuple[list[KVLoad], list[int]]:
        """Make a step's copies in their order (KVTransfers); returns the loads that failed on this rank
        and the hashes whose write to disk failed since the last call."""
        for store in transfers.stores:
            self._store(store)
        for state_store in transfers.state_stores:
            self._store_state(state_store)
        for block_hash in transfers.disk_drops:
            self._unwritten.discard(block_hash)
            if self.disk is not None:
                self._thread.submit(self.disk.remove, block_hash)
        for block_id in transfers.fences:
            self._fence(block_id)
        read: dict[int, bytes | None] = {}  # a block two requests load in one step is read once
        failed = [load for load in transfers.loads if not self._load(load, read)]
        return failed, self._take_failed_writes()

    def forget(self, failed: list[KVLoad], here: set[int]) -> None:
        """Loads that failed on some rank (those in `here`, by id, on this one): this rank's files of them
        go too, as they are no longer indexed, and a failure elsewhere counts as a fault here (rank 0's
        metrics are the worker's)."""
        for load in failed:
            if self.disk is None or id(load) in here:
                continue
            self.stats["disk"].faults.record("other_rank", block_hash=f"{load.block_hash:016x}")
            self._thread.submit(self.disk.remove, load.block_hash)

    def _store(self, store: KVStore) -> None:
        started = time.perf_counter()
        staging = None
        if store.host_slot >= 0:
            if store.host_slot in self._busy:  # the slot's last block is still being written to disk
                self._busy.pop(store.host_slot).result()
            assert self.host is not None  # a host slot: the host tier
            staging = self.host[store.host_slot]
        to_disk = store.to_disk and self.disk is not None
        if to_disk:
            self._unwritten.discard(store.block_hash)
        task = self._copy_down(store.block_id, store.block_hash, staging, to_disk)
        if store.host_slot >= 0:
            self._busy[store.host_slot] = task
        tier = "host" if store.host_slot >= 0 else "disk"
        self.stats[tier].seconds_down += time.perf_counter() - started

    def _copy_down(
        self, block_id: int, block_hash: int, staging: torch.Tensor | None, to_disk: bool
    ) -> Future:
        source = self.kv_cache[:, :, block_id]
        disk = self.disk if to_disk else None
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

    def _store_state(self, store: StateStore) -> None:
        """Copy a snapshot row down (waited for: the row is written again from this step on) into its
        host state row, or a buffer of its own, and with `to_disk` on into its block's file."""
        started = time.perf_counter()
        rows = [t[store.row] for t in self.states]
        if store.host_row >= 0:
            if store.host_row in self._busy_states:  # its last snapshot is still being written to disk
                self._busy_states.pop(store.host_row).result()
            staging = [h[store.host_row] for h in self.host_states]
        else:
            staging = [torch.empty_like(row, device="cpu", pin_memory=self._pin) for row in rows]
        disk = self.disk if store.to_disk else None
        if store.to_disk and disk is not None:
            self._unwritten.discard(store.block_hash)
        done = None
        if self._stream is not None:  # CUDA: the copy on the offload stream; the device waits for it
            device = self.kv_cache.device
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for target, row in zip(staging, rows):
                    target.copy_(row, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            torch.cuda.current_stream(device).wait_event(done)
        else:
            for target, row in zip(staging, rows):
                target.copy_(row)
        if disk is not None:

            def task() -> None:
                if done is not None:
                    done.synchronize()
                disk.add_state(store.block_hash, staging)

            future = self._thread.submit(task)
            if store.host_row >= 0:
                self._busy_states[store.host_row] = future
        tier = "host" if store.host_row >= 0 else "disk"
        self.stats[tier].seconds_down += time.perf_counter() - started

    def _fence(self, block_id: int) -> None:
        """Block `block_id` is about to be written again: its copy down must be done first."""
        copying = self._copying.pop(block_id, None)
        if copying is None:
            return
        if isinstance(copying, Future):
            copying.result()
        else:  # CUDA: the device waits, the host does not
            torch.cuda.current_stream(self.kv_cache.device).wait_event(copying)

    def _load(self, load: KVLoad, read: dict[int, bytes | None]) -> bool:
        """Copy a block up into its device block; False when this rank cannot (its disk file failed its
        check, or was never written). `read`: the disk files read so far in this step, by hash."""
        started = time.perf_counter()
        target = self.kv_cache[:, :, load.block_id]
        if load.host_slot >= 0:
            tier = "host"
            if load.host_slot in self._busy:
                self._busy.pop(load.host_slot).result()
            assert self.host is not None  # a host slot: the host tier
            target.copy_(self.host[load.host_slot], non_blocking=True)
            if load.state_row >= 0:  # its snapshot's host copy was made when it went down
                for state, host in zip(self.states, self.host_states):
                    state[load.state_row].copy_(host[load.host_state_row], non_blocking=True)
        else:
            tier = "disk"
            if self.disk is None:
                return False
            if load.block_hash not in read:
                self._drain()  # a read must not race its write
                # A block whose write failed (logged then) is not there.
                unwritten = load.block_hash in self._unwritten
                read[load.block_hash] = None if unwritten else self.disk.read(load.block_hash)
            payload = read[load.block_hash]
            if payload is None:
                return False
            if load.state_row >= 0 and len(payload) != self.block_nbytes + self.state_nbytes:
                # The scheduler's index said the file holds a snapshot: a write that replaced it failed.
                self.stats["disk"].faults.record("no_state", block_hash=f"{load.block_hash:016x}")
                return False
            kv = payload[: self.block_nbytes]
            target.copy_(torch.frombuffer(bytearray(kv), dtype=target.dtype).view(target.shape))
            if load.state_row >= 0:
                offset = self.block_nbytes
                for state in self.states:
                    row = state[load.state_row]
                    end = offset + row.numel() * row.element_size()
                    row.copy_(
                        torch.frombuffer(bytearray(payload[offset:end]), dtype=row.dtype).view(row.shape)
                    )
                    offset = end
        self.stats[tier].seconds_up += time.perf_counter() - started
        return True

    def _drain(self) -> None:
        self._thread.submit(lambda: None).result()
        self._collect_failed_writes()

    def _collect_failed_writes(self) -> None:
        while self.disk is not None and self.disk.failed_writes:
            block_hash = self.disk.failed_writes.popleft()
            self._unwritten.add(block_hash)
            self._unreported.append(block_hash)

    def _take_failed_writes(self) -> list[int]:
        self._collect_failed_writes()
        failed, self._unreported = self._unreported, []
        return failed

    def drain(self) -> list[int]:
        """Wait until the offload thread has done what it was given; the hashes whose write to disk failed
        since the last call."""
        self._drain()
        return self._take_failed_writes()

    def close(self) -> None:
        """Finish the copies and writes under way (a disk tier's files are then complete)."""
        self._thread.shutdown(wait=True)
