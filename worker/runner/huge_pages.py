"""A CPU engine's weights, KV cache and recurrent states on 2 MiB pages (Linux's transparent huge pages).

A decode step reads every weight once, front to back. On 4 KiB pages that takes a page-table walk every
4 KiB (about 140,000 a step for 0.57 GB of weights), and in a virtual machine each walk goes through the
guest's tables and the host's; on 2 MiB pages there are 512 times fewer. PyTorch's CPU allocator asks for
huge pages only when THP_MEM_ALLOC_ENABLE is set before its first allocation, which an engine running in
its caller's process cannot count on, so the engine places the tensors it keeps for its lifetime itself:
once the weights are loaded (and repacked for the kernels), they move into one anonymous mapping advised
MADV_HUGEPAGE, in the order the model's modules list them; the KV cache and the states are allocated in
such mappings from the start (docs/performance.md#weights-kv-cache-and-states-on-huge-pages).

Where the kernel's transparent huge pages are off (`never`) or absent, nothing changes.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from nanovllm.worker.layers.quantization import PackedWeight

HUGE_PAGE = 2 << 20
# The least a mapping of huge pages is made for: below it a tensor's reads stay within about what the TLB
# covers on 4 KiB pages (3,072 entries, 12 MiB, on Zen 4), and each huge page costs its first fault 1-5 ms
# where the kernel must compact memory for it (docs/performance.md#weights-kv-cache-and-states-on-huge-pages).
# Read at each call, so that a test can lower it.
MIN_BYTES = 16 << 20
_ALIGNMENT = 64  # each tensor in a mapping starts on a cache line
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel gives an anonymous mapping huge pages when advised to (its mode `always` or
    `madvise`, not `never`)."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor: of MIN_BYTES or more in a mapping of its own on huge pages, its pages faulted in
    now (as torch.zeros would) so that the memory is taken at start, not by a later step; smaller, from
    torch.zeros."""
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    if nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    return _mapping(nbytes).view(dtype).view(shape).zero_()


def move_weights(model: nn.Module) -> int:
    """Copy every CPU parameter and packed weight plane of `model` into one mapping on huge pages, in the
    order model.modules() reaches them, each then taking its old tensor's place (a parameter keeps its
    identity, so every module holding it reads the new memory; the old memory is freed as each moves).
    Call it before anything keeps a tensor of its own to the weights (the C++ kernels' bindings). Returns
    the bytes moved: none where they come to less than MIN_BYTES."""
    places: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
    seen: set[int] = set()

    def add(tensor: torch.Tensor | None, put: Callable[[torch.Tensor], None]) -> None:
        if tensor is None or id(tensor) in seen or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return
        seen.add(id(tensor))
        places.append((tensor, put))

    for module in model.modules():
        for param in module.parameters(recurse=False):
            add(param, partial(setattr, param, "data"))
        if isinstance(module, PackedWeight):
            for name in ("qweight", "scales", "mins"):
                add(getattr(module, name), partial(setattr, module, name))
    offsets, end = [], 0
    for tensor, _ in places:
        offsets.append(end)
        end += _aligned(tensor.numel() * tensor.element_size())
    if end < MIN_BYTES:
        return 0
    memory = _mapping(end)
    while places:  # each dropped from the list as it moves, so that its old memory goes once it is replaced
        tensor, put = places.pop()
        start, size = offsets.pop(), tensor.numel() * tensor.element_size()
        put(memory[start : start + size].view(tensor.dtype).view(tensor.shape).copy_(tensor))
    return end


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def _mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory starting on a 2 MiB boundary in an anonymous mapping advised for huge
    pages, as a uint8 tensor (which keeps the mapping alive)."""
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # a huge page more: room to start on a boundary
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # refused (a sandbox's filter): the mapping serves on small pages
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]
