"""Attention backends and the choice among them.

  torch       the PyTorch reference (kernels/attention.py), any device;
  cpu_kernel  the C++ decode kernel (kernels/csrc) on a CPU, PyTorch for the rest;
  triton      Triton kernels for every op, reading K/V in place through the block tables; on a CUDA GPU,
              or on a CPU when the kernels were defined under Triton's interpreter (tests);
  flash_attn  flash-attn's variable-length and paged-KV kernels on a CUDA GPU, when it is installed.

"auto" picks the fastest the device can run: on CUDA flash_attn, else triton, else torch; on a CPU
cpu_kernel, else torch. A backend asked for by name that cannot run is a ConfigError naming why.

Batch-invariant (EngineConfig.deterministic): every query, of a prompt, a chunk or a decode step, runs
through one kernel with one reduction order over its keys, so its result depends only on its own sequence.
On a CPU that is the C++ decode kernel, one row per prompt token (tasks are (token, kv head) and each
reduces its whole context in one pass); on CUDA the Triton prefill kernel, a decode step's queries as
one-token chunks (its tiles of keys start at position 0 in fixed sizes, and a tile masked out for a query
leaves its sums unchanged). Only cpu_kernel and triton have such a mode.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from nanovllm.common.errors import ConfigError
from nanovllm.kernels.attention import AttentionBackend, ChunkBatch, DecodeBatch
from nanovllm.kernels.cpu_kernels import SUPPORTED_DTYPES, load_cpu_kernels
from nanovllm.kernels.fp8_kv import KVScales, is_fp8

# flash-attn reads a paged cache only in blocks of a multiple of this many tokens.
FLASH_ATTN_BLOCK_MULTIPLE = 256


class CpuKernelAttention(AttentionBackend):
    name = "cpu_kernel"

    def __init__(self, kernels, batch_invariant: bool = False) -> None:
        self.kernels = kernels
        self.batch_invariant = batch_invariant

    def store(self, key, value, k_cache, v_cache, slot_mapping, kv_scales: KVScales | None = None) -> None:
        self.kernels.store_kv_(key, value, k_cache, v_cache, slot_mapping, *_scale_pair(kv_scales))

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        return self.kernels.paged_decode_attention(
            query, k_cache, v_cache, batch.block_tables, batch.context_lens, scale, *_scale_pair(kv_scales)
        )

    def fresh(
        self, query, key, value, k_cache, v_cache, batch: ChunkBatch, scale: float, kv_scales=None
    ) -> torch.Tensor:
        if self.batch_invariant:  # the prompt's K/V is in the cache already
            return self.decode(query, k_cache, v_cache, batch.per_token, scale, kv_scales)
        return super().fresh(query, key, value, k_cache, v_cache, batch, scale, kv_scales)

    def cached(
        self, query, k_cache, v_cache, batch: ChunkBatch, scale: float, kv_scales=None
    ) -> torch.Tensor:
        if self.batch_invariant:
            return self.decode(query, k_cache, v_cache, batch.per_token, scale, kv_scales)
        return super().cached(query, k_cache, v_cache, batch, scale, kv_scales)


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, num_sms: int, batch_invariant: bool = False) -> None:
        from nanovllm.kernels import triton_attention

        self.ops = triton_attention
        self.num_sms = num_sms
        self.batch_invariant = batch_invariant

    def store(self, key, value, k_cache, v_cache, slot_mapping, kv_scales: KVScales | None = None) -> None:
        self.ops.store_kvcache(key, value, k_cache, v_cache, slot_mapping, scales=kv_scales)

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        if self.batch_invariant:
            return self.cached(query, k_cache, v_cache, batch.one_token_chunks, scale, kv_scales)
        splits = self.ops.decode_num_splits(
            query.shape[0], k_cache.shape[2], batch.block_tables.shape[1] * batch.block_size, self.num_sms
        )
        return self.ops.paged_decode_attention(
            query, k_cache, v_cache, batch.block_tables, batch.context_lens, scale, splits, scales=kv_scales
        )

    def fresh(
        self, query, key, value, k_cache, v_cache, batch: ChunkBatch, scale: float, kv_scales=None
    ) -> torch.Tensor:
        # the prompt's K/V is in the cache already
        return self.cached(query, k_cache, v_cache, batch, scale, kv_scales)

    def cached(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ChunkBatch,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        return self.ops.paged_prefill_attention(
            query, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.start_positions,
            batch.max_query_len, scale, scales=kv_scales,
        )  # fmt: skip


class FlashAttention(AttentionBackend):
    """flash-attn 2 (>= 2.6: paged KV in the variable-length kernel). Causal masks align to the end of
    the keys, which is where a chunk's queries sit in its context."""

    name = "flash_attn"

    def __init__(self) -> None:
        import flash_attn

        self.fa = flash_attn

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        kv_scales: KVScales | None = None,  # always None: flash_attn is refused with an FP8 cache
    ) -> torch.Tensor:
        out = self.fa.flash_attn_with_kvcache(
            query.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=batch.context_lens.int(), block_table=batch.block_tables.int(),
            softmax_scale=scale, causal=True,
        )  # fmt: skip
        return out.squeeze(1)

    def fresh(
        self, query, key, value, k_cache, v_cache, batch: ChunkBatch, scale: float, kv_scales=None
    ) -> torch.Tensor:
        cu = batch.query_start_loc.int()
        return self.fa.flash_attn_varlen_func(
            query,
            key,
            value,
            cu,
            cu,
            batch.max_query_len,
            batch.max_query_len,
            softmax_scale=scale,
            causal=True,
        )

    def cached(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ChunkBatch,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        ends = batch.start_positions + batch.query_lens
        cu_k = torch.nn.functional.pad(ends.cumsum(0), (1, 0)).int()
        return self.fa.flash_attn_varlen_func(
            query, k_cache, v_cache, batch.query_start_loc.int(), cu_k, batch.max_query_len,
            batch.block_tables.shape[1] * batch.block_size, softmax_scale=scale, causal=True,
            block_table=batch.block_tables.int(),
        )  # fmt: skip


def _scale_pair(kv_scales: KVScales | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if kv_scales is None else (kv_scales.key, kv_scales.value)


@dataclass
class BackendChoice:
    backend: AttentionBackend
    reason: str


def triton_unavailable(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on `device`, or None when they can (a tiny store kernel is run to
    prove the toolchain: Triton compiles with the system's C compiler and the GPU's ptxas)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from nanovllm.kernels import triton_attention

    if device.type == "cpu" and not triton_attention.interpreted():
        return "Triton kernels run on a CPU only under the interpreter (TRITON_INTERPRET=1, for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton kernels do not run on {device.type}"
    try:
        key = torch.zeros(1, 1, 16, device=device)
        cache = torch.zeros(1, 1, 1, 16, device=device)
        triton_attention.store_kvcache(
            key, key, cache, cache.clone(), torch.zeros(1, dtype=torch.long, device=device)
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, old GPU...: whatever Triton raised is the reason
        return f"a test Triton kernel failed to compile or run: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def _flash_attn_unavailable(device: torch.device, block_size: int) -> str | None:
    if device.type != "cuda":
        return f"flash-attn runs only on CUDA GPUs, not {device.type}"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed (pip install flash-attn)"
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (
            f"flash-attn needs kvcache_block_size a multiple of {FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}"
        )
    return None


def _cpu_kernels_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"the C++ kernels run only on a CPU, not {device.type}"
    if dtype not in SUPPORTED_DTYPES:
        return f"the C++ kernels do not support {dtype}"
    if load_cpu_kernels() is None:
        return "the C++ CPU kernels failed to build (see the cpu_kernels_unavailable log line)"
    return None


def select_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    batch_invariant: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
) -> BackendChoice:
    """The backend `name` on `device`, or for "auto" the fastest one available, with why. `name` is one of
    ATTENTION_BACKENDS: EngineConfig refuses any other (and, batch-invariant, any but auto, cpu_kernel and
    triton; with an FP8 cache, flash_attn). Batch-invariant with none of those able to run is a
    ConfigError naming why."""
    fp8 = kv_cache_dtype is not None and is_fp8(kv_cache_dtype)

    def build(candidate: str) -> AttentionBackend:
        if candidate == "cpu_kernel":
            return CpuKernelAttention(load_cpu_kernels(), batch_invariant)
        if candidate == "triton":
            sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            )
            return TritonAttention(sms, batch_invariant)
        if candidate == "flash_attn":
            return FlashAttention()
        return AttentionBackend()

    checks = {
        "torch": lambda: None,  # runs anywhere
        "cpu_kernel": lambda: _cpu_kernels_unavailable(device, dtype),
        "triton": lambda: triton_unavailable(device),
        "flash_attn": lambda: (
            "flash-attn 2 reads only 16-bit KV caches, this one is FP8"
            if fp8
            else _flash_attn_unavailable(device, block_size)
        ),
    }
    if name != "auto":
        why_not = checks[name]()
        if why_not is not None:
            raise ConfigError(f"attention_backend={name!r} cannot run on {device}: {why_not}")
        return BackendChoice(build(name), "asked for")
    order: tuple[str, ...]
    if batch_invariant:
        order = ("triton",) if device.type == "cuda" else ("cpu_kernel",)
    else:
        order = ("flash_attn", "triton") if device.type == "cuda" else ("cpu_kernel",)
    skipped = []
    for candidate in order:
        why_not = checks[candidate]()
        if why_not is None:
            return BackendChoice(build(candidate), "auto: the fastest available on " + device.type)
        skipped.append(f"not {candidate}: {why_not}")
    if batch_invariant:
        raise ConfigError(
            f"deterministic needs batch-invariant attention kernels on {device}: {'; '.join(skipped)}"
        )
    return BackendChoice(AttentionBackend(), "auto: " + "; ".join(skipped))
