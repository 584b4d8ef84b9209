"""Which model class runs a checkpoint's architecture."""

from __future__ import annotations

from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from nanovllm.worker.models.qwen3_5_vision import Qwen3_5ForConditionalGeneration


def causal_lm_class(cfg: ModelConfig) -> type[DecoderForCausalLM]:
    """Qwen3.5's hybrid model where the config has linear-attention layers (with its vision tower where
    the config has one), the Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE) otherwise."""
    if cfg.hybrid is None:
        return DecoderForCausalLM
    return Qwen3_5ForConditionalGeneration if cfg.vision is not None else Qwen3_5ForCausalLM
