"""Executes a SchedulerOutput: builds the step's input tensors, runs the model, samples new tokens."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import psutil
import torch
from nanovllm.common.config import EngineConfig, parse_memory_size
from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger
from nanovllm.kernels.attention import AttentionMetadata
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.loader import load_safetensors
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.sampler import Sampler, SamplerOutput, SamplingRow
from nanovllm.worker.scheduler import SchedulerOutput

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU: this class of CPU has no native bf16, so bf16 matmuls are emulated and slower."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass
class ModelRunnerOutput:
    """New tokens for the scheduled sequences that reached the end of their known tokens, in order."""

    sampled_seq_ids: list[int]
    sampler_output: SamplerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext | None = None) -> None:
        self.config = config
        self.tp = tp or TPContext()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.kvcache_block_size
        cfg = config.hf_config
        with _default_dtype(self.dtype), self.device:
            self.model = DecoderForCausalLM(cfg, self.tp)
        load_safetensors(self.model, config.model)
        self.model.eval()
        self.num_blocks = self._allocate_kv_cache()
        generator = torch.Generator(self.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)

    def _kv_bytes_per_block(self) -> int:
        cfg = self.config.hf_config
        kv_heads = cfg.num_key_value_heads // self.tp.size
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * kv_heads * cfg.head_dim * element

    def _kv_cache_budget(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return int(total * self.config.gpu_memory_utilization) - used
        available = psutil.virtual_memory().available
        budget = parse_memory_size(self.config.kv_cache_memory, available)
        if budget > available:
            raise ConfigError(
                f"kv_cache_memory={self.config.kv_cache_memory} asks for {budget / 2**30:.2f} GiB but only "
                f"{available / 2**30:.2f} GiB of RAM is available"
            )
        return budget

    def _allocate_kv_cache(self) -> int:
        cfg = self.config.hf_config
        per_block = self._kv_bytes_per_block()
        num_blocks = self._kv_cache_budget() // per_block
        needed = -(-self.config.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"KV cache holds {num_blocks} blocks of {self.block_size} tokens ({per_block} bytes each), "
                f"fewer than the {needed} blocks one sequence of max_model_len={self.config.max_model_len} "
                f"needs; raise kv_cache_memory or lower max_model_len"
            )
        kv_heads = cfg.num_key_value_heads // self.tp.size
        shape = (2, cfg.num_hidden_layers, num_blocks, self.block_size, kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        log.info(
            "kv_cache_allocated",
            num_blocks=num_blocks,
            block_size=self.block_size,
            gib=round(num_blocks * per_block / 2**30, 3),
        )
        return num_blocks

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, rows: list[SamplingRow]) -> ModelRunnerOutput:
        """Run one step. `rows` gives sampling state for the sequences whose chunk `samples`, in order."""
        input_ids, positions, meta, sample_index = self._prepare(sched)
        hidden = self.model(input_ids, positions, meta)
        sampled = [s.seq.seq_id for s in sched.scheduled if s.samples]
        if not sampled:
            return ModelRunnerOutput([], SamplerOutput([], []))
        logits = self.model.compute_logits(hidden.index_select(0, sample_index)).float()
        return ModelRunnerOutput(sampled, self.sampler(logits, rows))

    @torch.inference_mode()
    def logits_for(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token (teacher forcing); used to compare with a reference model."""
        input_ids, positions, meta, _ = self._prepare(sched)
        return self.model.compute_logits(self.model(input_ids, positions, meta)).float()

    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        for item in sched.scheduled:
            seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                sample_index.append(len(input_ids) - 1)
        dev = self.device
        as_long = {"dtype": torch.long, "device": dev}
        nd = sched.num_decodes
        decode_tables = decode_mask = None
        if nd:
            decode_tables, context = self._block_tables(sched.scheduled[:nd])
            context_lens = torch.tensor([s.start + 1 for s in sched.scheduled[:nd]], **as_long)
            decode_mask = (torch.arange(context, device=dev) < context_lens[:, None])[:, None, None, :]
        prefill_tables = prefill_mask = token_index = None
        prefills = sched.scheduled[nd:]
        max_q = max((s.num_new_tokens for s in prefills), default=0)
        if prefills:
            prefill_tables, context = self._block_tables(prefills)
            starts = torch.tensor([s.start for s in prefills], **as_long)
            q_lens = torch.tensor([s.num_new_tokens for s in prefills], **as_long)
            q_pos = starts[:, None] + torch.arange(max_q, device=dev)  # [P, max_q]
            k_pos = torch.arange(context, device=dev)
            prefill_mask = (k_pos <= q_pos[:, :, None]) & (k_pos < (starts + q_lens)[:, None, None])
            prefill_mask = prefill_mask[:, None]
            rows = torch.arange(max_q, device=dev) < q_lens[:, None]
            token_index = rows.flatten().nonzero().squeeze(1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, **as_long),
            num_decode_tokens=nd,
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            prefill_block_tables=prefill_tables,
            prefill_mask=prefill_mask,
            prefill_token_index=token_index,
            max_query_len=max_q,
        )
        return (
            torch.tensor(input_ids, **as_long),
            torch.tensor(positions, **as_long),
            meta,
            torch.tensor(sample_index, **as_long),
        )

    def _block_tables(self, items: list) -> tuple[torch.Tensor, int]:
        """Block tables padded to the longest, and the padded context length in tokens."""
        width = max(-(-(s.start + s.num_new_tokens) // self.block_size) for s in items)
        tables = [
            s.seq.block_table[:width] + [0] * (width - min(width, len(s.seq.block_table))) for s in items
        ]
        return torch.tensor(tables, dtype=torch.long, device=self.device), width * self.block_size
