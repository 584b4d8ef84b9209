"""The identity of a full KV-cache block: a hash chaining the previous block's hash with the block's own
token ids (and, for a block that holds an image's placeholder tokens, the image's content hash and place:
`block_key`), so equal hashes mean equal prefixes. The worker's block manager keys its prefix cache by it and
reports the hashes it stores and evicts; the router hashes a prompt the same way to count, for each
worker, how many of its tokens that worker has cached."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash


def signed64(value: int) -> int:
    """An unsigned 64-bit hash as the signed integer of the same bits (fits an int64 array)."""
    return value - (1 << 64) if value >= 1 << 63 else value


class ImageSpan(Protocol):
    """An image's run of placeholder tokens in a prompt, [offset, end), and its content hash."""

    @property
    def offset(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def content_hash(self) -> int: ...


@dataclass(frozen=True)
class PromptImage:
    """An ImageSpan as the router knows it (the worker's is worker/sequence.py ImageInput)."""

    offset: int
    end: int
    content_hash: int


def block_key(token_ids: Sequence[int], begin: int, end: int, images: Sequence[ImageSpan] = ()) -> list[int]:
    """What the hash of the block of tokens [begin, end) covers: its token ids, and for each image whose
    tokens it holds the image's content hash and where the image begins relative to the block
    (placeholder ids are the same for every image: without the hash, two images of one size would share
    cached blocks)."""
    key = list(token_ids[begin:end])
    for image in images:
        if image.offset < end and image.end > begin:
            key += [signed64(image.content_hash), image.offset - begin]
    return key


def hash_block(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    h = xxhash.xxh3_64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())  # 64-bit ids, little-endian on every host we run
    return h.intdigest()


def prefix_hashes(
    token_ids: Sequence[int],
    block_size: int,
    limit: int | None = None,
    salt: int | None = None,
    images: Sequence[ImageSpan] = (),
) -> list[int]:
    """The hashes of the full blocks of `token_ids`, first block first (at most `limit` of them); `salt`
    starts the chain (a LoRA adapter's cache salt: its blocks never match another's); `images` are the
    prompt's (block_key)."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    hashes: list[int] = []
    prev = salt
    for i in range(count):
        prev = hash_block(prev, block_key(token_ids, i * block_size, (i + 1) * block_size, images))
        hashes.append(prev)
    return hashes


@dataclass
class HashChanges:
    """How a set of block hashes changed since it was last reported, as two disjoint sets: a hash stored
    then evicted in between (or the reverse) cancels out, so applying `evicted` and `stored` in either
    order to the previous set gives the current one."""

    stored: set[int] = field(default_factory=set)
    evicted: set[int] = field(default_factory=set)

    def store(self, block_hash: int) -> None:
        if block_hash in self.evicted:
            self.evicted.discard(block_hash)
        else:
            self.stored.add(block_hash)

    def evict(self, block_hash: int) -> None:
        if block_hash in self.stored:
            self.stored.discard(block_hash)
        else:
            self.evicted.add(block_hash)

    def __bool__(self) -> bool:
        return bool(self.stored or self.evicted)
