"""Freed host memory kept in the process for reuse, so that a CPU engine's large tensors do not fault in
fresh pages every step.

glibc serves a block above its mmap threshold (128 KiB, raised as such blocks are freed, to 32 MiB at
most) with a new mapping and unmaps it when freed, and trims free memory at the heap's top back to the
OS. A CPU engine allocates the same large tensors every step: a batch's float32 logits (64 rows of
Qwen3's 151,936 = 39 MB), prefill's MLP activations (8,192 tokens x 6,144 x 2 bytes = 100 MB). Each is
then new memory, which the kernel zero-fills a page at a time as it is first touched: several times
slower than reusing memory, and W64 faulted a quarter of the pages with reuse
(docs/performance.md#measurements-behind-choices-in-the-code).

So the mmap threshold goes to 1 GiB (the KV cache, allocated once, still gets its own mapping), trimming
stops below 1 GiB of free top, and every thread allocates from the main arena: another thread's arena
grows in heaps of 64 MiB and maps anything larger afresh, and the worker's engine steps on its own thread.
Threads keep the arena they already have, so the worker does this before it starts any. The price: the
process keeps the memory of its peak instead of returning it (`EngineConfig.keep_freed_memory` off keeps
glibc's defaults).
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_KEEP_BELOW = 1 << 30


def keep_freed_memory() -> bool:
    """Apply the settings above; False where the C library is not glibc (musl, macOS: nothing changes)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    settings = ((_M_MMAP_THRESHOLD, _KEEP_BELOW), (_M_TRIM_THRESHOLD, _KEEP_BELOW), (_M_ARENA_MAX, 1))
    return all(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 for param, value in settings)


def return_freed_memory() -> None:
    """Give the memory freed so far back to the OS once (glibc's malloc_trim): after a release that no step
    will reuse, such as the weights' old memory once they move onto huge pages (worker/runner/huge_pages.py),
    which the settings above would otherwise keep, up to 1 GiB of it."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))
