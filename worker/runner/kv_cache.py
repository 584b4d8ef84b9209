"""How big the paged KV cache is: bytes per block, the memory budget on a GPU or in RAM, and the number
of blocks that budget holds. Plain arithmetic on sizes the runner measures; the runner allocates."""

from __future__ import annotations

from nanovllm.common.errors import ConfigError
from nanovllm.worker.config import DEFAULT_CPU_KV_CACHE, EngineConfig
from nanovllm.worker.model_config import ModelConfig

GIB = 2**30


def kv_bytes_per_block(model: ModelConfig, block_size: int, kv_heads: int, element_size: int) -> int:
    """Bytes of one block of keys and values across every layer, for a rank holding `kv_heads` heads."""
    return 2 * model.num_attention_layers * block_size * kv_heads * model.head_dim * element_size


def gpu_kv_cache_budget(total: int, utilization: float, weights: int, activation_peak: int) -> int:
    """Bytes left for the KV cache on a GPU of `total` bytes: this engine may use `utilization` of it, less
    its own weights and activation peak. Memory other engines or processes hold is not subtracted: sharing
    a GPU is done by giving each engine its share through `utilization`."""
    allowed = int(total * utilization)
    budget = allowed - weights - activation_peak
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} allows "
            f"{allowed / GIB:.2f} of {total / GIB:.2f} GiB, and the weights take {weights / GIB:.2f} GiB and "
            f"the activation peak {activation_peak / GIB:.2f} GiB; raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens or max_num_seqs, or use more tensor-parallel ranks"
        )
    return budget


def gpu_kv_cache_bytes(
    config: EngineConfig, device_name: str, total: int, weights: int, activation_peak: int
) -> int:
    """The KV cache's bytes on one GPU: `kv_cache_memory` when set (it must fit the budget), else all of
    the budget that gpu_memory_utilization leaves."""
    budget = gpu_kv_cache_budget(total, config.gpu_memory_utilization, weights, activation_peak)
    if config.kv_cache_size is None:
        return budget
    size = config.kv_cache_size.of(budget)
    if size > budget:
        raise ConfigError(
            f"kv_cache_memory={config.kv_cache_memory} asks for {size / GIB:.2f} GiB but "
            f"gpu_memory_utilization={config.gpu_memory_utilization} leaves {budget / GIB:.2f} "
            f"GiB for the KV cache on {device_name}"
        )
    return size


def cpu_kv_cache_bytes(config: EngineConfig, available: int, num_ranks: int) -> int:
    """One rank's KV cache bytes in RAM: `kv_cache_memory` (default 2 GiB, or a fraction of the available
    RAM) split between the ranks, which share this machine's memory."""
    requested = config.kv_cache_size or DEFAULT_CPU_KV_CACHE
    budget = requested.of(available)
    if budget > available:
        raise ConfigError(
            f"kv_cache_memory={requested.text} asks for {budget / GIB:.2f} GiB but only "
            f"{available / GIB:.2f} GiB of RAM is available"
        )
    return budget // num_ranks


def check_num_blocks(config: EngineConfig, num_blocks: int, per_block: int) -> None:
    """A cache that cannot hold one sequence of max_model_len is a configuration error."""
    block_size = config.kvcache_block_size
    needed = -(-config.max_model_len // block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"KV cache holds {num_blocks} blocks of {block_size} tokens ({per_block} bytes each), "
            f"fewer than the {needed} blocks one sequence of max_model_len={config.max_model_len} "
            f"needs; raise kv_cache_memory or lower max_model_len"
        )
