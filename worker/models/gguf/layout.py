"""llama.cpp's layout against Hugging Face's: tensor names, the rotary row order of q/k projections, and
the configuration read from GGUF metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.common.errors import ConfigError, UnsupportedModelError

# llama.cpp tensor name (within blk.N) -> Hugging Face name (within model.layers.N), Llama layout.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


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


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face (Llama) name of a llama.cpp tensor name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no counterpart in a Llama model (rope scaling factors, experts "
        f"and other extras are not supported)"
    )


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
    """config.json for a LlamaForCausalLM, from a GGUF file's metadata and tensor names."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; nanovllm converts 'llama' GGUF files"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks llama.{key}")
        return value

    if int(get("expert_count", 0)) > 0:
        raise UnsupportedModelError("mixture-of-experts GGUF models are not supported")
    rope_scaling = metadata.get("llama.rope.scaling.type", "none")
    if rope_scaling not in ("none", ""):
        raise UnsupportedModelError(f"GGUF rope scaling {rope_scaling!r} is not supported (only none)")

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
    vocab_size = int(metadata.get("llama.vocab_size", len(tokens)))
    if not vocab_size:
        raise UnsupportedModelError("GGUF metadata gives neither llama.vocab_size nor a vocabulary")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(get("feed_forward_length")),
        "vocab_size": vocab_size,
        "rms_norm_eps": _as_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _as_float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


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
