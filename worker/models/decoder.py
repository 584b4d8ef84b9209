"""Llama-family decoder (Llama, Qwen2, Qwen3): one implementation, with an ArchitectureSpec for the
differences (Qwen3's per-head q/k RMSNorm, Qwen2's qkv bias)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from nanovllm.common.config import ModelConfig
from nanovllm.kernels.attention import AttentionMetadata
from nanovllm.worker.layers.attention import Attention
from nanovllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.worker.layers.norm import RMSNorm
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.rotary import RotaryEmbedding
from torch import nn


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.spec.qkv_bias, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, cfg.spec.o_bias, tp)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.spec.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.spec.qk_norm else None
        self.split = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], False, tp)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, tp, rotary)
        self.mlp = DecoderMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # One rotary table shared by all layers: it only depends on head_dim and theta.
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm.add_and_norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    # Checkpoint tensors that are fused into one parameter here: name -> (fused name, shard id).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
