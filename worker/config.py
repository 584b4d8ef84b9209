"""The engine's configuration (EngineConfig: every knob, each a flag) around the model's description
(worker/model_config.py). Everything flows from these dataclasses, never from globals."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger
from nanovllm.common.options import option
from nanovllm.worker.model_config import ModelConfig

log = get_logger(__name__)

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class MemorySize:
    """A memory setting resolved once: a number of bytes, or a fraction (0, 1] of what is available when it
    is applied (free RAM, or a GPU's budget). `text` is the setting as given, for messages."""

    text: str
    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: str | float, name: str) -> MemorySize:
        """Read "2GiB", "512MB", a byte count, or a fraction; errors name the setting `name`."""
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a size or a fraction, got {value!r}")
        if isinstance(value, float) and 0.0 < value <= 1.0:
            return cls(str(value), fraction=value)
        if isinstance(value, (int, float)):
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
            return cls(str(value), nbytes=int(value))
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(f"{name} {value!r} is not a size like '2GiB', '512MB' or a byte count")
        number = float(match.group(1))
        if match.group(2) == "" and 0.0 < number <= 1.0 and "." in match.group(1):
            return cls(value, fraction=number)
        size = int(number * _SIZE_UNITS[match.group(2).lower()])
        if size <= 0:
            raise ConfigError(f"{name} must be positive, got {value!r}")
        return cls(value, nbytes=size)

    def of(self, available_bytes: int) -> int:
        """The bytes this setting names where `available_bytes` are available."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None  # one or the other
        return int(self.fraction * available_bytes)


def parse_memory_size(value: str | float, available_bytes: int, name: str = "kv_cache_memory") -> int:
    """Turn "2GiB", "512MB", a byte count, or a fraction (0, 1] of `available_bytes` into bytes; errors
    name the setting `name`."""
    return MemorySize.parse(value, name).of(available_bytes)


DEFAULT_CPU_KV_CACHE = MemorySize("2GiB", nbytes=2 * 2**30)
ATTENTION_BACKENDS = ("auto", "torch", "cpu_kernel", "triton", "flash_attn")
DETERMINISTIC_BACKENDS = ("auto", "cpu_kernel", "triton")  # those with batch-invariant kernels
SPECULATIVE_METHODS = ("none", "ngram", "draft", "mtp")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
MAX_SPECULATIVE_TOKENS = 16
MAX_MTP_TOKENS = 4  # a multi-token-prediction head proposes 1 to 4 tokens in the published setups


@dataclass
class EngineConfig:
    """Everything the engine needs to know; mirrors nano-vllm's `LLM(...)` keyword arguments."""

    model: str = option(
        help="Hugging Face model directory (config.json + safetensors) or a .gguf file; default: the "
        "embedded SmolLM2-135M-Instruct (GGUF; its configuration and tokenizer converted once into "
        "~/.cache/nanovllm/gguf)"
    )
    max_model_len: int = option(4096, help="longest prompt + output, in tokens")
    max_num_seqs: int = option(256, help="most requests in one batch")
    max_num_batched_tokens: int = option(
        8192, help="most tokens in one step (chunked prefill splits longer prompts)"
    )
    kvcache_block_size: int = option(16, flag="--block-size", help="tokens per KV-cache block")
    kv_cache_memory: str | int | float | None = option(
        None,
        help="KV cache size: bytes, 2GiB, or a fraction of free RAM (CPU) or of what "
        "--gpu-memory-utilization leaves after weights and activations (CUDA); default 2GiB on CPU, all of "
        "that share on CUDA",
    )
    kv_cache_dtype: str = option(
        "auto",
        help="what the KV cache holds: auto (the model's dtype), fp8 or fp8_e4m3 (e4m3: 3 mantissa bits), "
        "fp8_e5m2 (2 bits, a wider range): twice the tokens in the same memory and half the bytes read "
        "by decode attention, with per-head scales calibrated at start (docs/architecture.md#fp8-kv-cache)",
    )
    kv_host_memory: str | int | float | None = option(
        None,
        help="a second prefix-cache tier in host memory (pinned on CUDA): bytes, 4GiB, or a fraction of free "
        "RAM; cached blocks freed on the device are copied there and copied back up on a hit; on a CPU the "
        "device cache is RAM already, so there --kv-disk-path is the tier that adds capacity "
        "(docs/kv-offload.md)",
    )
    kv_disk_path: str | None = option(
        None,
        help="a prefix-cache tier on local disk: a directory for one file per block, kept across restarts "
        "with the same model and config (files are checked; a bad one is deleted and recomputed)",
    )
    kv_disk_bytes: str | int = option(
        "16GiB", help="the most bytes the --kv-disk-path tier may hold (least recently used out first)"
    )
    gpu_memory_utilization: float = option(0.9, help="on CUDA, share of GPU memory the engine may use")
    device: str = option("auto", help="auto, cpu or cuda")
    dtype: str = option(
        "auto",
        help="auto (bf16 on CUDA and on CPUs with native bf16, else float32), float32, bfloat16 or float16",
    )
    enforce_eager: bool = option(
        False,
        help="run decode steps eagerly too: no CUDA graphs (they are captured on CUDA only, for decode-only "
        "steps; a CPU always runs eagerly)",
    )
    async_scheduling: str = option(
        "auto",
        help="on: schedule and prepare step N+1 while the device runs step N, feeding N's picks to N+1 on "
        "the device (the outputs are the synchronous engine's); off: one step at a time; auto: on on CUDA "
        "with one rank and no speculation, off on a CPU, where the host computes the step itself",
    )
    tensor_parallel_size: int = option(1, help="ranks to shard the model over")
    enable_prefix_caching: bool = option(
        True, flag="--no-prefix-caching", negate=True, help="turn off reuse of cached prompt prefixes"
    )
    state_memory_fraction: float = option(
        0.5,
        help="a hybrid model's (Qwen3.5): the largest share of the KV cache budget its requests' state "
        "slots take: one for each of max_num_seqs requests, fewer where they would take more (a request "
        "then waits for a free slot)",
    )
    state_cache_fraction: float = option(
        0.25,
        help="a hybrid model's (Qwen3.5): the share of the KV cache budget, past its requests' state slots, "
        "kept for snapshots of the linear-attention state at block boundaries, which prefix-cache hits resume from (0: no prefix "
        "cache for hybrid models); also the share of --kv-host-memory kept for the snapshots that go down with "
        "their blocks",
    )
    state_snapshot_interval: int = option(
        512,
        help="a hybrid model's: tokens between the state snapshots taken inside a prompt (a multiple of "
        "--block-size), so requests sharing a long prefix hit it; shorter shared prefixes get one where "
        "prompts sharing them branch (docs/models.md), and every request leaves one at its last block "
        "boundary when it finishes, so a conversation's next turn hits all of it",
    )
    attention_backend: str = option(
        "auto",
        help="auto (the fastest the device runs), torch, cpu_kernel, triton (CUDA) or flash_attn (CUDA)",
    )
    keep_freed_memory: bool = option(
        True,
        flag="--return-freed-memory",
        negate=True,
        help="on a CPU, glibc gives large freed blocks back to the OS at once (its default), so the next "
        "step's tensors fault in fresh pages; by default the process keeps them for reuse and stays at "
        "its peak resident memory (worker/runner/host_memory.py)",
    )
    huge_pages: bool = option(
        True,
        flag="--no-huge-pages",
        negate=True,
        help="on a CPU, the weights, KV cache and recurrent states live on 2 MiB pages (transparent huge "
        "pages, where the kernel allows them), so a step reading its weights walks 512 times fewer page "
        "tables; off keeps them on the allocator's pages (worker/runner/huge_pages.py)",
    )
    seed: int = option(0, help="seed for requests that set none")
    deterministic: bool | None = option(
        None,
        help="batch-invariant kernels in every dtype: a request's tokens and logprobs are bit-identical "
        "whatever else is in its batch, however its prompt is chunked, whether its prefix came from the "
        "cache, and when it is speculated, preempted or resumed on another worker (needs the C++ kernels "
        "on a CPU, Triton on CUDA); auto: on for float weights on a CPU with the C++ kernels, where they "
        "cost nothing measurable, off for quantized and GGUF weights (their prompts stay off PyTorch's "
        "GEMM: up to 48% slower) and on CUDA (44% slower); the start log's deterministic_selected line "
        "says which and why (docs/architecture.md#deterministic-inference)",
    )
    num_threads: int | None = option(
        None,
        help="CPU threads of the model's ops, shared by the tensor-parallel ranks; default: the CPUs this "
        "process may use (its affinity mask, capped by its cgroup CPU limit), split with the other "
        "nanovllm processes on the same CPUs (worker/runner/cpu_share.py)",
    )
    speculative_method: str = option(
        "none",
        help="none; ngram: propose the tokens that followed the sequence's last few tokens where they "
        "occurred earlier in it; draft: propose what --speculative-model decodes greedily; mtp: propose what "
        "the checkpoint's multi-token-prediction head (Qwen3.5's mtp.* weights) predicts, run once per "
        "proposal. Proposals are verified in one forward pass; the output tokens do not change",
    )
    num_speculative_tokens: int = option(
        4, help=f"tokens proposed per step, 1 to {MAX_SPECULATIVE_TOKENS} (mtp: 1 to {MAX_MTP_TOKENS})"
    )
    speculative_draft_vocab: int = option(
        0,
        help="mtp: the head proposes among the first N token ids only (0: the whole vocabulary), so each "
        "proposal reads N rows of the output head instead of all (the head is a third of Qwen3.5-0.8B's "
        "weights); byte-level BPE vocabularies number their commonest tokens first. The output tokens do not "
        "change; a token past N is never proposed",
    )
    speculative_max_batch: int = option(
        4,
        help="decoding requests above which a step does not speculate (the batch keeps the GPU/CPU busy); "
        "the default measured on a CPU (docs/performance.md)",
    )
    speculative_model: str | None = option(
        None,
        help="the draft model of --speculative-method draft: a Hugging Face directory or .gguf file with "
        "the model's vocabulary, run by the same worker with its own KV cache",
    )
    grammar_compile_timeout_s: float = option(
        10.0,
        help="seconds a structured-output constraint may take to compile (on its own thread) before its "
        "request fails with INVALID_ARGUMENT",
    )
    quantization: str = option(
        "auto",
        help="weights of the linear layers: none (the model's dtype), int8 (per output channel), int4 "
        "(groups of --quantization-group-size input features with a scale and a min); auto: a GGUF's "
        "Q8_0/Q4_0/Q4_1 tensors as they ship, an AWQ or GPTQ checkpoint's int4 repacked, none for any other "
        "Hugging Face directory (a block-FP8 checkpoint held as FP8 where the Triton kernels run, else dequantized "
        "to the dtype) (docs/quantization.md)",
    )
    quantization_group_size: int = option(
        32, help="input features per int4 scale: a multiple of 32 that divides every layer's input features"
    )
    exact_quantized_matmuls: bool = option(
        False,
        help="int8, int4 and GGUF weights on a CPU: x kept in the model's dtype and each weight dequantized "
        "exactly, so results equal the dequantized model's bit for bit; by default each row of x is quantized "
        "to int8 in blocks of 32 and meets the weights in integer dot products (AVX2 or AVX512-VNNI, as "
        "llama.cpp does; 1.2-2.7x faster at a few rows) where that rounding adds little to the error already "
        "there: 16-bit x, or a model whose projections are 4-bit; float32 x with 8-bit weights stays exact "
        "(the start log's weights_quantized line says which; docs/quantization.md)",
    )
    lora_adapters: list[str] = option(
        flag="--lora",
        default_factory=list,
        help="a LoRA adapter served from the start, NAME=PATH (a PEFT directory: adapter_config.json and "
        "adapter_model.safetensors); requests select it by NAME; repeat for several (docs/lora.md)",
    )
    max_loras: int | None = option(
        None,
        help="LoRA adapters the running requests may use at once (slots in the model; the least recently "
        "used idle one is replaced when another is needed); 0: LoRA off; default 4 with --lora, else 0",
    )
    max_lora_rank: int = option(
        16, help="the largest LoRA rank (r) an adapter may have; slots are sized for it"
    )
    encoder_cache_tokens: int = option(
        16384,
        help="a vision model's image tokens kept from the tower by image content, so an image seen again "
        "skips it (least recently used dropped first; the latest image is always kept)",
    )
    gguf_file: str | None = field(default=None, repr=False)  # the .gguf `model` was converted from, if any
    draft_gguf_file: str | None = field(default=None, repr=False)  # the .gguf of speculative_model, if any
    # None only until __post_init__ reads the model's config: typed as what every EngineConfig then has.
    model_config: ModelConfig = field(default=None, repr=False)  # type: ignore[assignment]
    draft_model_config: ModelConfig | None = field(default=None, repr=False)  # speculative_model's shape
    # The memory settings above, read once (__post_init__): None where unset.
    kv_cache_size: MemorySize | None = field(init=False, repr=False, default=None)
    kv_host_size: MemorySize | None = field(init=False, repr=False, default=None)
    kv_disk_capacity: int = field(init=False, repr=False, default=0)  # bytes
    # Why `deterministic` is what it is (__post_init__; the worker logs it at start).
    deterministic_reason: str = field(init=False, repr=False, default="asked for")

    def __post_init__(self) -> None:
        positive = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(
                f"num_threads must be >= 1 (or None for the usable CPUs), got {self.num_threads}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"dtype {self.dtype!r} is not supported on device {self.device!r}: "
                f"use auto, float32, bfloat16 or float16"
            )
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}")
        if self.async_scheduling == "on" and (
            self.tensor_parallel_size > 1 or self.speculative_method != "none"
        ):
            raise ConfigError(
                f"async_scheduling=on needs tensor_parallel_size=1 and speculative_method=none, got "
                f"{self.tensor_parallel_size} and {self.speculative_method!r}: proposals and other ranks need "
                "each step's tokens on the host before the next step"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        self._check_kv_cache_dtype()
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                f"{self.speculative_method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization_group_size < 32 or self.quantization_group_size % 32:
            raise ConfigError(
                f"quantization_group_size must be a positive multiple of 32, got {self.quantization_group_size}"
            )
        self._check_lora()
        if self.kv_cache_memory is not None:
            self.kv_cache_size = MemorySize.parse(self.kv_cache_memory, "kv_cache_memory")
        self._check_kv_tiers()
        if self.speculative_max_batch < 1:
            raise ConfigError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.model_config is None:
            self.model_config = ModelConfig.from_pretrained_dir(self.model)  # type: ignore[unreachable]  # see its field
        # after the model's config: a checkpoint quantized before it shipped has quantized weights by default
        if self.deterministic is None:
            self.deterministic, self.deterministic_reason = self._deterministic_by_default()
        if self.deterministic and self.attention_backend not in DETERMINISTIC_BACKENDS:
            raise ConfigError(
                f"deterministic needs attention_backend {', '.join(DETERMINISTIC_BACKENDS)}, got "
                f"{self.attention_backend!r}: its kernels sum a position's attention in an order that depends "
                "on the batch"
            )
        self._check_draft()
        self._check_mtp()
        if self.model_config.hybrid is not None:
            self._check_hybrid()
        # Positions beyond the model's trained range are meaningless; clamp (as nano-vllm does) so the
        # 4096 default works for small models. `LLM.config.max_model_len` holds the effective value.
        self.max_model_len = min(self.max_model_len, self.model_config.max_position_embeddings)

    def _check_hybrid(self) -> None:
        """What a hybrid model (linear-attention layers with a per-request state) does not run with yet,
        refused by name: `deterministic` without the C++ CPU kernels (its prompt chunks run token by token
        on them, or Triton's), speculation."""
        refused = {
            # its batch-invariant path runs the linear layers' prompt chunks on the decode arithmetic (C++ or Triton)
            "deterministic (needs the C++ CPU kernels or Triton's for a hybrid model)": bool(
                self.deterministic
            )
            and not (self._runs_cpu_kernels() or self._runs_triton_kernels()),
            "speculative_method (mtp only)": self.speculative_method not in ("none", "mtp"),
        }
        named = [name for name, on in refused.items() if on]
        if named:
            raise ConfigError(
                f"{', '.join(named)}: not supported with {self.model_config.architecture} (a hybrid model's "
                "linear-attention state) yet"
            )
        if not 0.0 < self.state_memory_fraction < 1.0:
            raise ConfigError(f"state_memory_fraction must be in (0, 1), got {self.state_memory_fraction}")
        if not 0.0 <= self.state_cache_fraction < 1.0:
            raise ConfigError(f"state_cache_fraction must be in [0, 1), got {self.state_cache_fraction}")
        block = self.kvcache_block_size
        if self.state_snapshot_interval < block or self.state_snapshot_interval % block:
            raise ConfigError(
                f"state_snapshot_interval must be a positive multiple of the block size {block}, got "
                f"{self.state_snapshot_interval}"
            )
        if self.enable_prefix_caching and self.state_cache_fraction == 0:
            log.info("prefix_caching_off", reason="state_cache_fraction=0 keeps no linear-attention state")
            self.enable_prefix_caching = False

    def _check_kv_cache_dtype(self) -> None:
        from nanovllm.kernels.fp8_kv import KV_CACHE_DTYPES

        choices = ("auto", *KV_CACHE_DTYPES)
        if self.kv_cache_dtype not in choices:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(choices)}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flash_attn":
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype} needs an attention backend that reads an FP8 cache "
                "(auto, torch, cpu_kernel, triton): flash-attn 2 reads only 16-bit caches"
            )

    def _runs_cpu_kernels(self) -> bool:
        """Whether this engine runs on a CPU's C++ kernels (which have a batch-invariant mode throughout)."""
        if self.attention_backend not in ("auto", "cpu_kernel"):
            return False
        from nanovllm.kernels.cpu_kernels import load_cpu_kernels
        from nanovllm.worker.device import resolve_device

        return resolve_device(self.device).type == "cpu" and load_cpu_kernels() is not None

    def _runs_triton_kernels(self) -> bool:
        """Whether this engine runs on the Triton kernels: asked for, or auto on CUDA."""
        from nanovllm.worker.device import resolve_device

        cuda = resolve_device(self.device).type == "cuda"
        return self.attention_backend == "triton" or (self.attention_backend == "auto" and cuda)

    def _deterministic_by_default(self) -> tuple[bool, str]:
        """deterministic=None (auto), and why: on where bench/deterministic.py measured the batch-invariant
        kernels no slower than the default ones (docs/architecture.md#deterministic-inference)."""
        if not self._runs_cpu_kernels():
            return False, (
                "auto: off without a CPU's C++ kernels (on CUDA the batch-invariant kernels cost 44% of the "
                "throughput)"
            )
        if self.weight_format != "none":
            return False, (
                f"auto: off for {self.weight_format} weights, whose batch-invariant kernel keeps prompts off "
                "PyTorch's GEMM (measured at 0.52-0.83x of the throughput with 16-bit activations, 0.91-1.00x "
                "in float32); --deterministic turns it on"
            )
        return True, "auto: on a CPU's C++ kernels, where the batch-invariant ones measured no slower"

    @property
    def weight_format(self) -> str:
        """What the linear layers hold: none, int8, int4, gguf (a GGUF file's tensors as they ship), or awq /
        gptq (such a checkpoint's int4 layers repacked as they load; a block-FP8 checkpoint's are
        dequantized: none)."""
        if self.quantization != "auto":
            return self.quantization
        if self.gguf_file is not None:
            return "gguf"
        shipped = self.model_config.quantization
        return shipped.method if shipped is not None and shipped.method in ("awq", "gptq") else "none"

    def _check_lora(self) -> None:
        for entry in self.lora_adapters:
            name, _, path = entry.partition("=")
            if not name.strip() or not path.strip():
                raise ConfigError(f"lora_adapters entries are NAME=PATH, got {entry!r}")
        if self.max_loras is None:
            self.max_loras = 4 if self.lora_adapters else 0
        if self.max_loras < 0 or (self.lora_adapters and self.max_loras == 0):
            raise ConfigError(
                f"max_loras must be >= 1 with --lora adapters (>= 0 without), got {self.max_loras}"
            )
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.encoder_cache_tokens < 0:
            raise ConfigError(f"encoder_cache_tokens must be >= 0, got {self.encoder_cache_tokens}")

    @property
    def kv_tiers(self) -> bool:
        """Whether the prefix cache has a tier below the device (host memory or disk)."""
        return self.kv_host_memory is not None or self.kv_disk_path is not None

    def _check_kv_tiers(self) -> None:
        if not self.kv_tiers:
            return
        if not self.enable_prefix_caching:
            raise ConfigError("kv_host_memory and kv_disk_path are tiers of the prefix cache: turn it on")
        disk = MemorySize.parse(self.kv_disk_bytes, "kv_disk_bytes")
        if disk.nbytes is None:
            raise ConfigError(
                f"kv_disk_bytes takes a size like '16GiB', got the fraction {self.kv_disk_bytes!r}"
            )
        self.kv_disk_capacity = disk.nbytes
        if self.kv_host_memory is not None:
            self.kv_host_size = MemorySize.parse(self.kv_host_memory, "kv_host_memory")

    def _check_mtp(self) -> None:
        """speculative_method=mtp needs a hybrid Qwen3.5 model (whose checkpoints carry the head; the runner
        checks its weights as it loads them), 1 to MAX_MTP_TOKENS proposals."""
        if self.speculative_method != "mtp":
            if self.speculative_draft_vocab:
                raise ConfigError(
                    f"speculative_draft_vocab is used only with speculative_method=mtp, got "
                    f"speculative_method={self.speculative_method!r}"
                )
            return
        if self.model_config.hybrid is None:
            raise ConfigError(
                f"speculative_method=mtp needs a model with a multi-token-prediction head (Qwen3.5, 3.6, 3.8: "
                f"mtp.* weights), got {self.model_config.architecture}"
            )
        if self.num_speculative_tokens > MAX_MTP_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, {MAX_MTP_TOKENS}] with speculative_method=mtp, got "
                f"{self.num_speculative_tokens}"
            )
        if not 0 <= self.speculative_draft_vocab <= self.model_config.vocab_size:
            raise ConfigError(
                f"speculative_draft_vocab must be in [0, {self.model_config.vocab_size}] (the model's vocabulary; "
                f"0: all of it), got {self.speculative_draft_vocab}"
            )

    def _check_draft(self) -> None:
        """speculative_model goes with speculative_method=draft, with the model's vocabulary."""
        if self.speculative_method != "draft":
            if self.speculative_model is not None:
                raise ConfigError(
                    f"speculative_model is used only with speculative_method=draft, got "
                    f"speculative_method={self.speculative_method!r}"
                )
            return
        if self.speculative_model is None:
            raise ConfigError("speculative_method=draft needs speculative_model (a draft model directory)")
        if self.draft_model_config is None:
            self.draft_model_config = ModelConfig.from_pretrained_dir(self.speculative_model)
        check_same_vocabulary(self.model, self.model_config, self.speculative_model, self.draft_model_config)


def check_same_vocabulary(model: str, config: ModelConfig, draft: str, draft_config: ModelConfig) -> None:
    """A draft proposes token ids that the model verifies: both must give every id the same token. Compared
    by size, and token by token where both directories ship a tokenizer.json."""
    if draft_config.vocab_size != config.vocab_size:
        raise ConfigError(
            f"speculative_model {draft} has a vocabulary of {draft_config.vocab_size} tokens and the model "
            f"{model} one of {config.vocab_size}: a draft model must share the model's vocabulary"
        )
    ours, theirs = (_tokenizer_vocabulary(Path(path)) for path in (model, draft))
    if ours is None or theirs is None or ours == theirs:
        return
    token_id = min(i for i in ours.keys() | theirs.keys() if ours.get(i) != theirs.get(i))
    raise ConfigError(
        f"speculative_model {draft} and the model {model} have vocabularies of {config.vocab_size} tokens "
        f"that differ: token id {token_id} is {theirs.get(token_id)!r} in the draft's tokenizer.json and "
        f"{ours.get(token_id)!r} in the model's; a draft model must share the model's vocabulary"
    )


def _tokenizer_vocabulary(model_dir: Path) -> dict[int, str] | None:
    """id -> token of the directory's tokenizer.json (added tokens included), or None without one."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocabulary = {i: token for token, i in (data.get("model", {}).get("vocab") or {}).items()}
    vocabulary.update({t["id"]: t["content"] for t in data.get("added_tokens", [])})
    return vocabulary
