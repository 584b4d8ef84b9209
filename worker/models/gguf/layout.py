"""llama.cpp's layout against Hugging Face's: tensor names, the rotary row order of Llama's q/k projections,
and the configuration read from GGUF metadata, for the architectures served here (`GGUF_ARCHITECTURES`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.common.errors import ConfigError, UnsupportedModelError

# GGUF general.architecture -> (Hugging Face architecture, model_type). llama.cpp's converter permutes q/k
# rows for "llama" only (see unpermute_rotary_rows); Qwen2 and Qwen3 keep Hugging Face's order.
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}

# llama.cpp tensor name (within blk.N) -> Hugging Face name (within model.layers.N).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts layer's router
}
# A mixture-of-experts layer keeps each projection's experts in one 3-D tensor [experts, out, in] (GGUF
# lists it {in, out, experts}); Hugging Face has one 2-D tensor per expert.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_reader(gguf_path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _as_float(value: Any) -> float:
    """GGUF stores floats as float32; the shortest decimal that rounds to it is the value the writer
    meant (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_tensor_names(gguf_name: str, shape: tuple[int, ...]) -> list[str]:
    """The Hugging Face name of a llama.cpp tensor of torch shape `shape`, or for a 3-D expert tensor the
    names of its experts' tensors in expert order (split along its first dimension)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias") and stem in _GLOBAL_TENSORS:
        return [f"{_GLOBAL_TENSORS[stem]}.{suffix}"]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is not None:
        layer, part, suffix = match.groups()
        if part in _LAYER_TENSORS:
            return [f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{suffix}"]
        if part in _EXPERT_TENSORS and len(shape) == 3:
            projection = _EXPERT_TENSORS[part]
            return [f"model.layers.{layer}.mlp.experts.{e}.{projection}.{suffix}" for e in range(shape[0])]
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no counterpart in the Llama, Qwen2, Qwen3 or Qwen3-MoE layout "
        f"(rope scaling factors, shared experts and other extras are not supported)"
    )


def rotary_rows_heads(gguf_name: str, architecture: str, heads: int, kv_heads: int) -> int | None:
    """The head count to un-permute a tensor's rows with (a Llama q or k projection), or None."""
    if architecture != "LlamaForCausalLM":
        return None
    if ".attn_q." in gguf_name:
        return heads
    return kv_heads if ".attn_k." in gguf_name else None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation.

    Hugging Face Llama rotates the two halves of each head ([x0..x31 | x32..x63] pairs (i, i+32)); llama.cpp
    rotates adjacent pairs (x0, x1), so its converter reorders each head's rows from [half0, half1] to
    interleaved [h0[0], h1[0], h0[1], h1[1], ...]. This reverses it, as transformers does when it loads a
    GGUF (modeling_gguf_pytorch_utils.LlamaTensorProcessor._reverse_permute_weights).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise UnsupportedModelError(f"{rows} q/k rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_config(metadata: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """config.json for the file's architecture (GGUF_ARCHITECTURES), from its metadata and tensor names."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; nanovllm serves {', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    experts = int(get("expert_count", 0))
    if experts and arch != "qwen3moe":
        raise UnsupportedModelError(
            f"mixture-of-experts GGUF models of architecture {arch!r} are not supported"
        )
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rotary_dim} of {head_dim}) are not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab_size = int(metadata.get(f"{arch}.vocab_size", len(tokens)))
    if not vocab_size:
        raise UnsupportedModelError(f"GGUF metadata gives neither {arch}.vocab_size nor a vocabulary")
    architecture, model_type = GGUF_ARCHITECTURES[arch]
    layers = int(get("block_count"))
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(get("feed_forward_length", 0)),
        "vocab_size": vocab_size,
        "rms_norm_eps": _as_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _as_float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config |= {"attention_bias": "blk.0.attn_q.bias" in tensor_names, "mlp_bias": False}
    rope = _rope_parameters(arch, metadata)
    if rope is not None:
        config["rope_parameters"] = {**rope, "rope_theta": config["rope_theta"]}
    if experts:
        config |= _experts(arch, metadata, tensor_names, layers, experts)
    elif not config["intermediate_size"]:
        raise UnsupportedModelError(f"GGUF metadata lacks {arch}.feed_forward_length")
    for key in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def _rope_parameters(arch: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """transformers' rope_parameters for the file's RoPE scaling (none, linear, yarn), as llama.cpp's
    converter writes it: the type, the factor and, for yarn, the training context."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(
            f"GGUF rope scaling {kind!r} is not supported (none, linear and yarn are)"
        )
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if factor is None:
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} needs {arch}.rope.scaling.factor")
    rope: dict[str, Any] = {"rope_type": kind, "factor": _as_float(factor)}
    if kind == "yarn":
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise UnsupportedModelError(
                f"GGUF rope scaling 'yarn' needs {arch}.rope.scaling.original_context_length"
            )
        rope["original_max_position_embeddings"] = int(original)
    return rope


def _experts(
    arch: str, metadata: dict[str, Any], tensor_names: list[str], layers: int, experts: int
) -> dict[str, Any]:
    """Qwen3-MoE's config fields. llama.cpp's qwen3moe routes every layer through experts and renormalises
    the chosen experts' weights (transformers sets norm_topk_prob for these files too); a file with shared
    experts or a dense layer is refused."""
    shared = int(metadata.get(f"{arch}.expert_shared_count", 0))
    if shared:
        raise UnsupportedModelError(
            f"GGUF {arch}.expert_shared_count={shared}: shared experts are not supported"
        )
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensor_names]
    if dense:
        raise UnsupportedModelError(
            f"GGUF {arch} layers {dense[:5]} have no experts; llama.cpp's {arch} routes every layer"
        )
    width = metadata.get(f"{arch}.expert_feed_forward_length")
    used = metadata.get(f"{arch}.expert_used_count")
    if width is None or used is None:
        raise UnsupportedModelError(
            f"GGUF metadata lacks {arch}.expert_feed_forward_length or {arch}.expert_used_count"
        )
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(width),
        "norm_topk_prob": bool(metadata.get(f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: generation stops on EOS and on llama.cpp's end-of-turn tokens."""
    stop = [
        int(metadata[f"tokenizer.ggml.{key}_token_id"])
        for key in ("eos", "eot", "eom")
        if metadata.get(f"tokenizer.ggml.{key}_token_id") is not None
    ]
    config: dict[str, Any] = {}
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    if stop:
        stop = list(dict.fromkeys(stop))
        config["eos_token_id"] = stop[0] if len(stop) == 1 else stop
    if metadata.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(metadata["tokenizer.ggml.padding_token_id"])
    return config
