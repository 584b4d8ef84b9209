"""The prefix cache's disk tier: one file per KV block, named by its block hash, under a directory named
by the model's digest, size-capped, least recently used out first.

A file is a header (magic, the model digest, the block hash, the payload's length and xxh3 checksum) and
the payload: the block's bytes and, for a hybrid model's block that ends at a state snapshot, the
snapshot's bytes after them (each linear-attention layer's convolution row, then its recurrent row), which
the length and checksum cover as they cover the block's. It is written to a temporary name and renamed, so a
crash leaves either the whole file or none; a file that is short, long, or fails its checksum is deleted
and never served. A snapshot joins a file written before it (`add_state`) by writing the file again.
Files written by a worker with the same model, config and KV layout (the same digest) are found again
after a restart, their snapshots with them.

Which hashes the tier holds is the scheduler's to know (worker/core/kv_tiers.py): this module finds the
files a previous run left, and reads, writes and deletes them for the runner (worker/runner/kv_offload.py),
whose offload thread reports a failed write back through `failed_writes`. With tensor parallelism each
rank has its own directory (the digest names the rank) holding its share of each block.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import struct
from pathlib import Path

import torch
import xxhash

from nanovllm.common.logging import get_logger
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.layers.parallel import TPContext

log = get_logger(__name__)

_MAGIC = b"NVKVBLK1"
_HEADER = struct.Struct("<8s16sQQQ")  # magic, model digest, block hash, payload bytes, xxh3_64 of payload
_SUFFIX = ".kv"


def model_digest(
    config: EngineConfig,
    kv_block_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    tp: TPContext,
    kv_scales: list[float],
    state_rows: list[tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> bytes:
    """16 bytes naming everything a block's KV depends on: the model's configuration and weight files,
    the weight format, the dtype, the KV cache's dtype and an FP8 cache's scales, the block's layout, the kernels' rounding (the device type and
    --deterministic's batch-invariant kernels), and the tensor-parallel rank whose share of the heads it
    is; for a hybrid model, the layout of a state snapshot's rows (`state_rows`: each one's shape and
    dtype, in the file's order). A weight file is named by its name, size and first and last MiB (hashing
    every byte of a large model at each start would cost a minute)."""
    h = hashlib.sha256()
    cfg = config.model_config
    facts = {
        "config": repr(cfg),
        "weight_format": config.weight_format,
        "group_size": config.quantization_group_size,
        "dtype": str(dtype),
        "kv_cache_dtype": config.kv_cache_dtype,
        "kv_scales": kv_scales,
        "block_shape": list(kv_block_shape),
        "device": device.type,
        "deterministic": config.deterministic,
        "tensor_parallel": [tp.rank, tp.size],
    }
    if state_rows:  # only then: the files of a model without state keep their directory
        facts["state_rows"] = [[list(shape), str(dtype)] for shape, dtype in state_rows]
    h.update(json.dumps(facts, sort_keys=True).encode())
    model = Path(config.gguf_file or config.model)
    files = [model] if model.is_file() else sorted(model.glob("*.safetensors")) + [model / "config.json"]
    for path in files:
        if not path.is_file():
            continue
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(2**20))
            f.seek(max(size - 2**20, 0))
            h.update(f.read(2**20))
    return h.digest()[:16]


class TierFaults:
    """Counts a tier's faults by kind and logs each kind once: a full disk would otherwise log every
    block it cannot write."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.counts: collections.Counter[str] = collections.Counter()

    def record(self, kind: str, **detail: object) -> None:
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            log.warning("kv_tier_fault", tier=self.tier, kind=kind, **detail)


class DiskTier:
    def __init__(
        self, root: str, capacity_bytes: int, digest: bytes, block_nbytes: int, state_nbytes: int = 0
    ) -> None:
        """`state_nbytes`: a hybrid model's state snapshot's bytes (0: a block never holds one)."""
        self.directory = Path(root) / digest.hex()
        self.digest = digest
        self.block_nbytes = block_nbytes
        self.state_nbytes = state_nbytes
        self.file_bytes = _HEADER.size + block_nbytes  # without a snapshot (with one: state_nbytes more)
        self.capacity = capacity_bytes  # the bytes of its files
        self.faults = TierFaults("disk")
        self.failed_writes: collections.deque[int] = collections.deque()  # appended by the offload thread
        self.writable = self._prepare()
        # The hashes of the files a previous run left, least recently written first, and whether each
        # holds a state snapshot.
        self.found: list[tuple[int, bool]] = self._scan() if self.writable else []

    def _payload_sizes(self) -> tuple[int, ...]:
        """A payload's possible lengths: the block's, and with a snapshot after it."""
        if self.state_nbytes:
            return (self.block_nbytes, self.block_nbytes + self.state_nbytes)
        return (self.block_nbytes,)

    def _prepare(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self.faults.record("unwritable", path=str(self.directory), error=str(exc))
            return False
        return True

    def _scan(self) -> list[tuple[int, bool]]:
        """The files a previous run left, oldest first, the oldest deleted beyond the capacity; a file of the
        wrong size, or a temporary one a crash left, is deleted."""
        for leftover in self.directory.glob("*.tmp"):
            leftover.unlink(missing_ok=True)
        sizes = [_HEADER.size + n for n in self._payload_sizes()]
        found = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            try:
                block_hash = int(path.stem, 16)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if stat.st_size not in sizes:
                self.faults.record("bad_size", path=str(path), size=stat.st_size, expected=sizes)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        found.sort()
        held = sum(size for _, _, size in found)
        excess = 0
        while held > self.capacity:
            held -= found[excess][2]
            self.remove(found[excess][1])
            excess += 1
        if len(found) > excess:
            log.info("kv_disk_tier_found", directory=str(self.directory), blocks=len(found) - excess)
        return [(block_hash, size > self.file_bytes) for _, block_hash, size in found[excess:]]

    def path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}{_SUFFIX}"

    def remove(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def write(self, block_hash: int, block: torch.Tensor) -> None:
        """Write one block (a contiguous CPU tensor); on the offload thread."""
        self._write(block_hash, _bytes(block))

    def add_state(self, block_hash: int, state: list[torch.Tensor]) -> None:
        """Write the file of `block_hash` again with a state snapshot (its rows, contiguous CPU tensors)
        after the block; on the offload thread, after the block's own write. A file that is gone or fails
        its check counts as a failed write (the tier no longer holds the block)."""
        payload = self.read(block_hash)
        if payload is None:
            self.failed_writes.append(block_hash)
            return
        if len(payload) == self.block_nbytes:  # one written by another run may hold one already
            self._write(block_hash, payload + b"".join(_bytes(row) for row in state))

    def _write(self, block_hash: int, payload: bytes) -> None:
        header = _HEADER.pack(
            _MAGIC, self.digest, block_hash, len(payload), xxhash.xxh3_64_intdigest(payload)
        )
        target = self.path(block_hash)
        temporary = target.with_suffix(".tmp")
        try:
            with temporary.open("wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temporary, target)
        except OSError as exc:
            kind = "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "write"
            self.faults.record(kind, path=str(target), error=str(exc))
            temporary.unlink(missing_ok=True)
            self.failed_writes.append(block_hash)

    def read(self, block_hash: int) -> bytes | None:
        """The file's payload (the block's bytes, and a state snapshot's after them if it holds one), or None
        (the file deleted and the fault counted) when the file is not exactly what `write` or `add_state`
        wrote for this model and hash."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError as exc:
            self.faults.record("read", path=str(path), error=str(exc))
            return None
        problem = self._check(data, block_hash)
        if problem is not None:
            self.faults.record("corrupt", path=str(path), problem=problem)
            self.remove(block_hash)
            return None
        return data[_HEADER.size :]

    def _check(self, data: bytes, block_hash: int) -> str | None:
        sizes = self._payload_sizes()
        if len(data) - _HEADER.size not in sizes:
            return f"{len(data)} bytes, expected {' or '.join(str(_HEADER.size + n) for n in sizes)}"
        magic, digest, stored_hash, length, checksum = _HEADER.unpack_from(data)
        if magic != _MAGIC or digest != self.digest or stored_hash != block_hash:
            return "header does not name this model and block"
        if length != len(data) - _HEADER.size or xxhash.xxh3_64_intdigest(data[_HEADER.size :]) != checksum:
            return "checksum mismatch"
        return None


def _bytes(tensor: torch.Tensor) -> bytes:
    """A contiguous CPU tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
