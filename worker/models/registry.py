"""Which model class runs a checkpoint's architecture."""

from __future__ import annotations

from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM


def causal_lm_class(cfg: ModelConfig) -> type[DecoderForCausalLM]:
    """Qwen3.5's hybrid model where the config has linear-attention layers, the Llama-family decoder
    (Llama, Qwen2, Qwen3, Qwen3-MoE) otherwise."""
    return Qwen3_5ForCausalLM if cfg.hybrid is not None else DecoderForCausalLM
