"""llama.cpp's layout against Hugging Face's: tensor names, the rotary row order of Llama's q/k projections,
and the configuration read from GGUF metadata, for the architectures served here (`GGUF_ARCHITECTURES`;
what is Qwen3.5's alone is in qwen35.py).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.common.errors import ConfigError, UnsupportedModelError
from nanovllm.worker.models.gguf.qwen35 import HYBRID_GGUF_ARCHITECTURES, hybrid_config

# GGUF general.architecture -> (Hugging Face architecture, model_type). llama.cpp's converter permutes q/k
# rows for "llama" only (see unpermute_rotary_rows); Qwen2 and Qwen3 keep Hugging Face's order.
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
_MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe")

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
    # Qwen3.5's: its second norm, the linear layers' projections, convolution and gated norm, and the
    # shared expert with its gate
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Layer tensors whose Hugging Face names end otherwise (llama.cpp's name, suffix included if any).
_RENAMED_TENSORS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
# A mixture-of-experts layer keeps each projection's experts in one 3-D tensor [experts, out, in] (GGUF
# lists it {in, out, experts}); Hugging Face has one 2-D tensor per expert.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# The converter's --fuse-gate-up-exps writes each expert's gate and up as one [experts, 2 * out, in] tensor,
# gate rows first.
_FUSED_EXPERT_TENSOR = "ffn_gate_up_exps"
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")
_ANY_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")  # a block's tensor of another form (nextn.eh_proj.weight)


def open_reader(gguf_path: Path) -> Any:
    """The file's GGUFReader, built once per version of the file (path, size, mtime) in this process:
    building one parses every metadata field in Python (seconds for SmolLM2's 49,152-token vocabulary and
    its merges: docs/performance.md#the-test-suite), and a conversion reads the file twice (metadata, then
    the weights), a load up to three times (the MTP block, the quant plan, the tensors). The last file's
    reader is kept."""
    try:
        path = Path(gguf_path).resolve()
        stat = path.stat()
        return _reader(path, stat.st_size, stat.st_mtime_ns)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc


@functools.lru_cache(maxsize=1)
def _reader(path: Path, size: int, mtime_ns: int) -> Any:
    """`size` and `mtime_ns` only key the cache: a rewritten file gets a reader of its own."""
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        """GGUFReader over the file's mapping as a plain ndarray instead of an np.memmap: the parse slices
        the file about 1.2 million times for SmolLM2's vocabulary and merges, and every slice of a memmap
        builds a memmap (its __array_finalize__ ran in a Python loop), so the parse took 6.0 s and takes 2.1 s
        this way (docs/performance.md#measurements-behind-choices-in-the-code). The mapping stays the same
        read-only one: the ndarray's base holds it."""

        # A plain ndarray where the base declares a memmap, on purpose (above).
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._plain_data = np.asarray(mapped)

    return PlainArrayReader(str(path))


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _as_float(value: Any) -> float:
    """GGUF stores floats as float32; the shortest decimal that rounds to it is the value the writer
    meant (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def tensor_part(gguf_name: str) -> tuple[int | None, str]:
    """(its block, its name within the block) of a llama.cpp tensor name without the suffix ("attn_q"),
    or (None, its stem) for a tensor outside the blocks ("output_norm")."""
    match = _LAYER_NAME.fullmatch(gguf_name) or _ANY_BLOCK.match(gguf_name)
    if match is not None:
        return int(match[1]), match[2]
    return None, gguf_name.rpartition(".")[0]


def hf_tensor_names(gguf_name: str, shape: tuple[int, ...]) -> list[str]:
    """The Hugging Face name of a llama.cpp tensor of torch shape `shape`, or for a 3-D expert tensor the
    names of its experts' tensors in expert order (split along its first dimension; a fused gate and up
    tensor gives each expert's gate, then its up)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias") and stem in _GLOBAL_TENSORS:
        return [f"{_GLOBAL_TENSORS[stem]}.{suffix}"]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is not None:
        layer, part, suffix = match.groups()
        renamed = _RENAMED_TENSORS.get(part if suffix is None else f"{part}.{suffix}")
        if renamed is not None:
            return [f"model.layers.{layer}.{renamed}"]
        if suffix is not None and part in _LAYER_TENSORS:
            return [f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{suffix}"]
        experts = f"model.layers.{layer}.mlp.experts"
        if suffix is not None and part in _EXPERT_TENSORS and len(shape) == 3:
            projection = _EXPERT_TENSORS[part]
            return [f"{experts}.{e}.{projection}.{suffix}" for e in range(shape[0])]
        if suffix is not None and part == _FUSED_EXPERT_TENSOR and len(shape) == 3:
            return [f"{experts}.{e}.{p}_proj.{suffix}" for e in range(shape[0]) for p in ("gate", "up")]
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no counterpart in the Llama, Qwen2, Qwen3, Qwen3-MoE or Qwen3.5 "
        f"layout (rope scaling factors and other extras are not supported)"
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
    if experts and arch not in _MOE_ARCHITECTURES:
        raise UnsupportedModelError(
            f"mixture-of-experts GGUF models of architecture {arch!r} are not supported"
        )
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    hybrid = arch in HYBRID_GGUF_ARCHITECTURES
    if rotary_dim != head_dim and not hybrid:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rotary_dim} of {head_dim}) are not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab_size = int(metadata.get(f"{arch}.vocab_size", len(tokens)))
    if not vocab_size:
        raise UnsupportedModelError(f"GGUF metadata gives neither {arch}.vocab_size nor a vocabulary")
    architecture, model_type = GGUF_ARCHITECTURES[arch]
    blocks = int(get("block_count"))
    # Multi-token prediction blocks follow the layers (Qwen3.5's: not served, see qwen35.py).
    layers = blocks - int(get("nextn_predict_layers", 0))
    if layers < 1:
        raise UnsupportedModelError(
            f"GGUF {arch}.nextn_predict_layers leaves no layer of {arch}.block_count={blocks}"
        )
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
    if hybrid:  # RoPE turns the first rotary_dim dimensions of each head
        factor = rotary_dim / head_dim
        if int(head_dim * factor) != rotary_dim:
            raise UnsupportedModelError(
                f"GGUF {arch}.rope.dimension_count={rotary_dim} of {head_dim} is not a fraction this engine "
                "can express"
            )
        rope = {"rope_type": "default", **(rope or {}), "partial_rotary_factor": factor}
        config |= hybrid_config(arch, get, layers)
    if rope is not None:
        config["rope_parameters"] = {**rope, "rope_theta": config["rope_theta"]}
    if experts:
        config |= _experts(arch, metadata, tensor_names, layers, experts)
        if hybrid:  # Qwen3.5-MoE has no dense MLP: no intermediate_size
            del config["intermediate_size"]
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
    """Qwen3-MoE's and Qwen3.5-MoE's config fields. llama.cpp routes every layer of both through experts
    and renormalises the chosen experts' weights (transformers sets norm_topk_prob for qwen3moe files
    too); Qwen3.5-MoE's layers add a shared expert of `expert_shared_feed_forward_length` features. A
    qwen3moe file with shared experts, or either with a dense layer, is refused."""
    shared = int(metadata.get(f"{arch}.expert_shared_count", 0))
    if shared and arch != "qwen35moe":
        raise UnsupportedModelError(
            f"GGUF {arch}.expert_shared_count={shared}: shared experts are not supported"
        )
    names = set(tensor_names)
    dense = [
        i
        for i in range(layers)
        if not {f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.{_FUSED_EXPERT_TENSOR}.weight"} & names
    ]
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
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(width),
        "norm_topk_prob": bool(metadata.get(f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen35moe":
        shared_width = metadata.get(f"{arch}.expert_shared_feed_forward_length")
        if shared_width is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.expert_shared_feed_forward_length")
        fields["shared_expert_intermediate_size"] = int(shared_width)
    return fields


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
