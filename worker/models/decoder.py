"""Llama-family decoder (Llama, Qwen2, Qwen3): one implementation, with an ArchitectureSpec for the
differences (Qwen3's per-head q/k RMSNorm, Qwen2's qkv bias)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.attention import AttentionBackend, AttentionMetadata, DecodeBatch
from nanovllm.worker.layers.attention import Attention
from nanovllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.worker.layers.kernels import PYTORCH, LayerKernels
from nanovllm.worker.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanovllm.worker.layers.lora import LoRAContext, LoRAWeights
from nanovllm.worker.layers.moe import SparseMoeBlock
from nanovllm.worker.layers.norm import HeadRMSNorm, RMSNorm
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import QuantPlan
from nanovllm.worker.layers.rotary import RotaryEmbedding, apply_rotary
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.decode_layers import build_decode_layers


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None, prefix: str) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            d,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.spec.qkv_bias,
            tp,
            quant,
            f"{prefix}.qkv_proj",
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, cfg.spec.o_bias, tp, quant, f"{prefix}.o_proj"
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)
        self.qk_norm = (
            HeadRMSNorm(self.num_heads, self.num_kv_heads, d, cfg.rms_norm_eps) if cfg.spec.qk_norm else None
        )
        self.head_dim = d
        self.qk_size = (self.num_heads + self.num_kv_heads) * d
        self.eps = cfg.rms_norm_eps
        self.kernels = PYTORCH  # see DecoderForCausalLM.bind_kernels

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        attn = self.attn
        if self.kernels.triton is not None and attn.k_cache.numel():
            # q/k norm, RoPE and the K/V store in one kernel; the attention reads this step's K/V from
            # the cache like the rest.
            q = self.kernels.triton.qk_norm_rope_store(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                self.qk_norm.weight if self.qk_norm is not None else None, self.eps, *rope,
                attn.k_cache, attn.v_cache, meta.slot_mapping, scales=attn.kv_scales,
            )  # fmt: skip
            return self.o_proj(attn.attend_cached(q, meta))
        tokens, d = qkv.shape[0], self.head_dim
        qk = qkv[:, : self.qk_size].view(tokens, -1, d)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        rotate = apply_rotary if self.kernels.cpu is None else self.kernels.cpu.rotary
        q, k = rotate(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size :].view(tokens, self.num_kv_heads, d)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None, prefix: str) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], False, tp, quant, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, tp, quant, f"{prefix}.down_proj")
        self.kernels = PYTORCH  # see DecoderForCausalLM.bind_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = self.kernels.triton or self.kernels.cpu
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None, prefix: str, index: int
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, tp, quant, f"{prefix}.self_attn")
        self.mlp: DecoderMLP | SparseMoeBlock
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg, tp, quant, f"{prefix}.mlp")
        else:
            self.mlp = DecoderMLP(cfg, tp, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.mix(rope, x, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual

    def mix(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The token mixer: attention here (a hybrid model's layers may mix otherwise)."""
        return self.self_attn(rope, x, meta)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp, quant, "model.embed_tokens"
        )
        # Built inside the runner's default-dtype context: that dtype is the model's.
        dtype = torch.get_default_dtype()
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, dtype, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, quant, f"model.layers.{i}", i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The layers as one C++ call for decode-only steps (worker/models/decode_layers.py), set by
        # DecoderForCausalLM.bind_kernels on the CPU kernels.
        self.decode_layers: Any = None  # a kernels.DecodeLayers (C++), or None
        self.lora: LoRAContext | None = None  # DecoderForCausalLM.enable_lora

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        splice: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`splice`: (rows, embeddings) that replace those rows' token embeddings (an image's tokens)."""
        x, residual = self.embed_tokens(input_ids), None
        if splice is not None:
            x.index_copy_(0, splice[0], splice[1].to(x.dtype))
        rope = self.rotary.lookup(positions)  # once per step, shared by every layer
        if self.decode_layers is not None and meta.decode is not None and self.runs_in_one_call(meta):
            x, residual = self.decode_in_one_call(x, rope, meta, meta.decode)
        else:
            for layer in self.layers:
                x, residual = layer(rope, x, residual, meta)
        assert residual is not None  # a model has layers
        x, _ = self.norm.add_and_norm(x, residual)
        return x

    def runs_in_one_call(self, meta: AttentionMetadata) -> bool:
        """Whether `decode_layers` can run the step: decodes only, without adapters (the C++ layers know
        none)."""
        return meta.fresh is None and meta.cached is None and (self.lora is None or self.lora.batch is None)

    def decode_in_one_call(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        decode: DecodeBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step's layers on `decode_layers`: (the last layer's output, the residual)."""
        return self.decode_layers.forward(
            x, *rope, meta.slot_mapping, decode.block_tables, decode.context_lens
        )


class DecoderForCausalLM(nn.Module):
    model_class: ClassVar[type[DecoderModel]] = DecoderModel  # the layers between the embedding and the head
    # Whether some layers keep a per-request state beside the KV cache (then the class declares its shapes,
    # `state_layout`, and lists those layers, `linear_attention_layers`: worker/models/qwen3_5.py).
    is_hybrid: ClassVar[bool] = False
    # Checkpoint tensors that are fused into one parameter here: name -> (fused name, shard id).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "q_norm": ("qk_norm", "q"),
        "k_norm": ("qk_norm", "k"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None = None) -> None:
        """`quant` says which layers hold packed weights (worker/layers/quantization.py); None: all float."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = self.model_class(cfg, tp, quant)
        # A base model's checkpoint (Qwen3-Embedding's layout) has no head: it serves pooling requests only.
        self.lm_head: ParallelLMHead | None = None
        if cfg.has_head:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, quant, "lm_head")
            if cfg.tie_word_embeddings:
                del self.lm_head.weight  # the head is the embedding, float parameter or PackedWeight
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        splice: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, splice)

    def compute_logits(self, hidden: torch.Tensor, vocab: int = 0) -> torch.Tensor:
        """The logits of the whole vocabulary, or of its first `vocab` token ids."""
        return self._head()(hidden, vocab)

    def token_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Each row's logit of its token (float32 [rows]): only those rows of the head are multiplied."""
        return self._head().token_logits(hidden, token_ids)

    def _head(self) -> ParallelLMHead:
        if self.lm_head is None:
            raise RuntimeError(
                f"{self.config.architecture} has no output head: it computes hidden states (embeddings) only"
            )
        return self.lm_head

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint's tensor under this model's name: a base model's (Qwen3-Embedding's layout) are
        named without the `model.` prefix, whatever its config's architectures say."""
        if not name.startswith(("model.", "lm_head.")):
            return "model." + name
        return name

    # The projections a LoRA adapter may adapt: its module name -> (this model's projection, shard id).
    lora_targets: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("self_attn.qkv_proj", "q"),
        "k_proj": ("self_attn.qkv_proj", "k"),
        "v_proj": ("self_attn.qkv_proj", "v"),
        "o_proj": ("self_attn.o_proj", None),
        "gate_proj": ("mlp.gate_up_proj", 0),
        "up_proj": ("mlp.gate_up_proj", 1),
        "down_proj": ("mlp.down_proj", None),
    }

    def enable_lora(self, num_slots: int, max_rank: int) -> LoRAContext:
        """Give every projection LoRA can adapt room for `num_slots` adapters of rank <= `max_rank`
        (worker/layers/lora.py)."""
        context = LoRAContext(num_slots, max_rank)
        for projection in self.lora_projections():
            projection.lora = LoRAWeights(context, projection.weight.shape[1], projection.lora_parts())
        self.model.lora = context
        return context

    def lora_projections(self) -> list[ParallelLinear]:
        """The projections of `lora_targets`: attention's and a dense MLP's (a mixture-of-experts layer's
        experts are not adapted)."""
        projections: list[ParallelLinear] = []
        for layer in cast("list[DecoderLayer]", self.model.layers):  # a ModuleList's items are bare Modules
            projections += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if isinstance(layer.mlp, DecoderMLP):
                projections += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        return projections

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in cast("list[DecoderLayer]", self.model.layers)]

    def bind_kernels(self, attention: AttentionBackend, kernels: LayerKernels) -> None:
        """Run every attention layer on `attention` (batch-invariant when kernels.deterministic), and every
        layer with a variant on `kernels` (worker/layers/kernels.py): RMSNorm, RoPE, the SwiGLU gate, the
        projections and a packed embedding's rows on the C++ CPU kernels, or on PyTorch; with the Triton layer kernels, RMSNorm, SwiGLU and
        q/k norm + RoPE + KV store fused."""
        for attn in self.attention_layers():
            attn.backend = attention
        kernel_users = (
            RMSNorm,
            DecoderAttention,
            DecoderMLP,
            SparseMoeBlock,
            ParallelLinear,
            VocabParallelEmbedding,
        )
        for module in self.modules():
            if isinstance(module, kernel_users):
                module.kernels = kernels
            if isinstance(module, HeadRMSNorm):  # on Triton, fused into qk_norm_rope_store
                module.kernels = dataclasses.replace(kernels, triton=None)
        # Decode steps as one C++ call: the module path's kernels in its order; not across tensor-parallel
        # ranks, whose all-reduces sit between the kernels.
        cpu = kernels.cpu
        self.model.decode_layers = (
            build_decode_layers(self.model, cpu, kernels) if cpu is not None and self.tp.size == 1 else None
        )
