"""A model's description as nanovllm runs it: the architecture's spec (ARCHITECTURES), its mixture of
experts and RoPE scaling, read once from a Hugging Face config.json (ModelConfig). The engine's own knobs
are worker/config.py's EngineConfig."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanovllm.common.errors import ConfigError, UnsupportedModelError


@dataclass(frozen=True)
class ArchitectureSpec:
    """What distinguishes the supported decoder families from one another."""

    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    qkv_bias: bool  # Qwen2: bias on q, k, v projections
    o_bias: bool = False


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "Qwen3ForCausalLM": ArchitectureSpec(qk_norm=True, qkv_bias=False),
    "Qwen2ForCausalLM": ArchitectureSpec(qk_norm=False, qkv_bias=True),
    "LlamaForCausalLM": ArchitectureSpec(qk_norm=False, qkv_bias=False),
    "Qwen3MoeForCausalLM": ArchitectureSpec(qk_norm=True, qkv_bias=False),
    "Qwen3_5ForCausalLM": ArchitectureSpec(qk_norm=True, qkv_bias=False),
    "Qwen3_5MoeForCausalLM": ArchitectureSpec(qk_norm=True, qkv_bias=False),
    "Qwen3Model": ArchitectureSpec(qk_norm=True, qkv_bias=False),
}
# Checkpoints of the decoder without its output head (Qwen3-Embedding's layout: transformers' base model,
# tensors named without the `model.` prefix): served for pooling requests (embeddings) only.
HEADLESS_ARCHITECTURES = ("Qwen3Model",)
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")

# Published multimodal checkpoints whose language model is one of the above: their `text_config` and the
# language model's weights, with the vision tower (`vision_config`, VisionSpec) where the config has one
# (worker/models/qwen3_5_vision.py); without it served text-only (worker/models/loader.py skips the rest).
TEXT_ONLY = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}

# The layer kinds of a hybrid model's `layer_types`.
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"

# Every field a Qwen3.5-family text config may carry, read here or known to leave the arithmetic alone:
# transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig, the published checkpoints' own (Qwen3.6 and 3.8
# declare the same architecture and grow it by fields), and the generic ones every config has. A field
# outside it is refused at start by name: this engine is checked against transformers, and a field that
# neither reads may change what the model computes (a per-layer `layer_scale`, say).
_HYBRID_FIELDS = frozenset(
    (
        # the shapes and the layers
        "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "vocab_size", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "attention_bias", "layer_types",
        "full_attention_interval", "attn_output_gate", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "mrope_section",
        "mrope_interleaved",
        # Qwen3.5-MoE's experts
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
        # the recurrent state's dtype (see HybridSpec.from_hf_dict), the MTP head (not loaded)
        "mamba_ssm_dtype", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
        # training, generation and bookkeeping: nothing a forward pass reads
        "attention_dropout", "initializer_range", "router_aux_loss_coef", "output_router_logits", "use_cache",
        "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "transformers_version",
        "_name_or_path", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
        "output_attentions", "output_hidden_states", "problem_type", "return_dict", "use_sliding_window",
        "sliding_window", "max_window_layers",
        # how the checkpoint's weights were quantized before it shipped (CheckpointQuantization)
        "quantization_config",
    )
)  # fmt: skip


@dataclass(frozen=True)
class HybridSpec:
    """A hybrid model (transformers' Qwen3_5ForCausalLM): `layer_types` mixes Gated DeltaNet layers
    (linear attention: a causal depthwise convolution over the projected q/k/v, then the gated delta rule
    over a recurrent state of [value heads, key dim, value dim] per request) with full-attention layers
    whose output is gated per channel (`sigmoid` of a second half of q_proj) and whose RoPE turns only
    the first `rotary_dim` dimensions of each head. Every RMSNorm outside the linear layers is
    zero-centred: its weight is stored as w and applied as (1 + w)."""

    layer_types: tuple[str, ...]
    num_key_heads: int  # linear attention's
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int
    rotary_dim: int  # full attention's rotated dimensions per head
    # Multimodal RoPE: of the rotary_dim / 2 frequencies, index i turns by the height position where
    # i % 3 == 1 and i < 3 * mrope_section[1], by the width position where i % 3 == 2 and
    # i < 3 * mrope_section[2], by the temporal one elsewhere (interleaved, as transformers' Qwen3.5). A
    # text token's three positions are equal: plain RoPE.
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION]

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v of the linear attention."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], head_dim: int, rope: dict[str, Any]) -> HybridSpec:
        unknown_fields = sorted(set(cfg) - _HYBRID_FIELDS)
        if unknown_fields:
            raise UnsupportedModelError(
                f"config field(s) {unknown_fields} unknown to this engine's Qwen3.5 loader: transformers' "
                "Qwen3.5, the reference it is checked against, reads none of them, and a field neither reads "
                "may change what the model computes"
            )
        # The recurrent state is kept in float32 (as transformers' reference computes it), which is what
        # the published checkpoints ask for.
        if cfg.get("mamba_ssm_dtype", "float32") != "float32":
            raise UnsupportedModelError(
                f"mamba_ssm_dtype={cfg['mamba_ssm_dtype']!r}: the recurrent state is kept in float32 only"
            )
        layers = cfg["num_hidden_layers"]
        kinds = cfg.get("layer_types")
        if kinds is None:  # transformers' default: every `full_attention_interval`-th layer is full
            interval = int(cfg.get("full_attention_interval", 4))
            kinds = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
        unknown = sorted(set(kinds) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if len(kinds) != layers or unknown:
            raise UnsupportedModelError(
                f"layer_types must name {layers} layers, each {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}; "
                f"got {len(kinds)}" + (f" with {unknown}" if unknown else "")
            )
        if FULL_ATTENTION not in kinds:  # the KV cache's blocks are what the scheduler hands out
            raise UnsupportedModelError(
                f"layer_types names no {FULL_ATTENTION!r} layer among its {layers}: this engine needs at least one"
            )
        if cfg.get("attn_output_gate", True) is not True:
            raise UnsupportedModelError("attn_output_gate=false is not supported (Qwen3.5 gates every head)")
        key_heads, value_heads = cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32)
        if value_heads % key_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads={value_heads} must be a multiple of linear_num_key_heads={key_heads}"
            )
        factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        rotary_dim = int(head_dim * factor)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor={factor} turns {rotary_dim} of head_dim={head_dim} dimensions; "
                "it must turn an even number, at least 2"
            )
        return cls(
            tuple(kinds),
            key_heads,
            value_heads,
            int(cfg.get("linear_key_head_dim", 128)),
            int(cfg.get("linear_value_head_dim", 128)),
            int(cfg.get("linear_conv_kernel_dim", 4)),
            rotary_dim,
            _mrope_section(rope.get("mrope_section", cfg.get("mrope_section", (11, 11, 10)))),
        )


def _mrope_section(section: Any) -> tuple[int, int, int]:
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise UnsupportedModelError(
            f"mrope_section must list 3 sizes (temporal, height, width); got {section!r}"
        )
    return int(section[0]), int(section[1]), int(section[2])


# Every field of a Qwen3.5 vision_config: transformers' Qwen3_5VisionConfig and the generic ones. A field
# outside it is refused at start by name, as _HYBRID_FIELDS' are.
_VISION_FIELDS = frozenset(
    (
        "depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
        "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings",
        "rope_parameters", "model_type", "initializer_range", "dtype", "torch_dtype", "deepstack_visual_indexes",
        "transformers_version", "_name_or_path", "architectures", "output_attentions", "output_hidden_states",
        "return_dict", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "problem_type",
    )
)  # fmt: skip


@dataclass(frozen=True)
class VisionSpec:
    """A Qwen3.5 checkpoint's vision tower (transformers' Qwen3_5VisionModel) and the placeholder token
    its image features replace in the prompt."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], top: dict[str, Any]) -> VisionSpec:
        unknown = sorted(set(cfg) - _VISION_FIELDS)
        if unknown:
            raise UnsupportedModelError(
                f"vision_config field(s) {unknown} unknown to this engine's Qwen3.5 tower"
            )
        if cfg.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise UnsupportedModelError(
                f"vision_config.hidden_act={cfg['hidden_act']!r}: the tower's MLP runs gelu_pytorch_tanh only"
            )
        if cfg.get("deepstack_visual_indexes"):
            raise UnsupportedModelError(
                "vision_config.deepstack_visual_indexes (Qwen3-VL's) is not supported"
            )
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"vision_config rope_type {rope['rope_type']!r}: only axial")
        hidden, heads = int(cfg.get("hidden_size", 1152)), int(cfg.get("num_heads", 16))
        if hidden % heads or (hidden // heads) % 4:
            raise UnsupportedModelError(
                f"vision_config hidden_size={hidden} over num_heads={heads}: a head's size must be a multiple of 4"
            )
        side = math.isqrt(int(cfg.get("num_position_embeddings", 2304)))
        if side * side != int(cfg.get("num_position_embeddings", 2304)):
            raise UnsupportedModelError("vision_config.num_position_embeddings must be a square (a grid)")
        return cls(
            depth=int(cfg.get("depth", 27)),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 4304)),
            num_heads=heads,
            in_channels=int(cfg.get("in_channels", 3)),
            patch_size=int(cfg.get("patch_size", 16)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            spatial_merge_size=int(cfg.get("spatial_merge_size", 2)),
            out_hidden_size=int(cfg.get("out_hidden_size", 3584)),
            num_position_embeddings=side * side,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=int(top.get("image_token_id", 248056)),
            vision_start_token_id=int(top.get("vision_start_token_id", 248053)),
        )


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP (transformers' Qwen3MoeForCausalLM): in each layer of `sparse_layers` a
    router picks `top_k` of `num_experts` SwiGLU experts per token (its softmax in float32, the top-k
    weights renormalised to sum to 1 when `norm_topk_prob`); the other layers keep a dense MLP. Qwen3.5-MoE
    adds a shared expert every token runs (`shared_expert_intermediate_size`), its output scaled by a
    sigmoid gate of the token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    sparse_layers: frozenset[int]
    shared_expert_intermediate_size: int = 0  # 0: none

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], hybrid: bool = False) -> MoeSpec:
        """`hybrid`: Qwen3.5-MoE's, whose every layer is sparse, with a shared expert, and whose router
        always renormalises its top-k weights."""
        if hybrid:
            cfg = {**cfg, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
        unsupported = ("n_shared_experts", "first_k_dense_replace")
        for name in unsupported if hybrid else ("shared_expert_intermediate_size", *unsupported):
            if cfg.get(name):
                raise UnsupportedModelError(f"mixture-of-experts with {name}={cfg[name]} is not supported")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        top_k, step = cfg.get("num_experts_per_tok"), cfg.get("decoder_sparse_step", 1)
        if not isinstance(experts, int) or experts < 1:
            raise UnsupportedModelError(
                f"a mixture-of-experts config needs num_experts >= 1, got {experts!r}"
            )
        if not isinstance(top_k, int) or not 1 <= top_k <= experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok must be in [1, num_experts={experts}], got {top_k!r}"
            )
        if not isinstance(step, int) or step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {step!r}")
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = frozenset(
            i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
        )
        return cls(
            experts,
            top_k,
            int(cfg["moe_intermediate_size"]),
            bool(cfg.get("norm_topk_prob", False)),
            layers,
            int(cfg.get("shared_expert_intermediate_size") or 0),
        )


# A checkpoint's quant_method and what this engine does with it (worker/models/quantized_checkpoint.py).
CHECKPOINT_QUANTIZATIONS = ("fp8", "awq", "gptq")
FP8_BLOCK = 128  # the edge of a block-FP8 checkpoint's square blocks, the only one Qwen publishes


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint's weights were quantized before it shipped (config.json's `quantization_config`):
    block FP8 (`fp8`: float8_e4m3fn weights, a float32 `weight_scale_inv` per 128 x 128 block, w = byte x
    scale), or 4-bit integers in groups of `group_size` input features with a float16 scale and a 4-bit zero
    each, w = s (q - z): AWQ's GEMM packing (`awq`) or GPTQ's (`gptq`, where a checkpoint_format of "gptq"
    stores z - 1). `not_converted`: the modules the config lists as kept unquantized."""

    method: str
    group_size: int  # fp8: the block's edge; awq, gptq: input features per scale and zero
    not_converted: tuple[str, ...] = ()
    # gptq: added to each stored zero (1 for checkpoint_format "gptq", 0 for "gptq_v2"); its desc_act is read
    # from each layer's g_idx (worker/models/quantized_checkpoint.py)
    zero_offset: int = 0

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> CheckpointQuantization:
        """A ConfigError naming the field for anything this engine does not load as it ships."""
        method = cfg.get("quant_method")
        if method not in CHECKPOINT_QUANTIZATIONS:
            raise ConfigError(
                f"quantization_config.quant_method {method!r} is not supported: this engine loads "
                f"{', '.join(CHECKPOINT_QUANTIZATIONS)} checkpoints as they ship"
            )
        listed = cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or []
        if not isinstance(listed, list) or not all(isinstance(m, str) for m in listed):
            raise ConfigError(
                f"quantization_config.modules_to_not_convert must list module names, got {listed!r}"
            )
        if method == "fp8":
            return cls._fp8(cfg, tuple(listed))
        bits, group = cfg.get("bits", cfg.get("w_bit")), cfg.get("group_size", cfg.get("q_group_size"))
        if bits != 4:
            raise ConfigError(
                f"quantization_config.bits={bits!r} ({method}): only 4-bit {method} checkpoints are loaded"
            )
        if not isinstance(group, int) or group < 32 or group % 32:
            raise ConfigError(
                f"quantization_config.group_size={group!r} ({method}): groups must be a positive multiple of "
                "32 input features (this engine's int4 blocks)"
            )
        if method == "awq":
            version = str(cfg.get("version", "gemm")).lower()
            if version != "gemm":
                raise ConfigError(
                    f"quantization_config.version={cfg.get('version')!r} (awq): only AWQ's GEMM packing is loaded"
                )
            if cfg.get("zero_point", True) is not True:
                raise ConfigError(
                    "quantization_config.zero_point=false (awq): only AWQ with zero points is loaded"
                )
            return cls("awq", group, tuple(listed))
        checkpoint_format = cfg.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ConfigError(
                f"quantization_config.checkpoint_format={checkpoint_format!r} (gptq): only gptq and gptq_v2 "
                "are loaded"
            )
        if cfg.get("is_marlin_format"):
            raise ConfigError(
                "quantization_config.is_marlin_format=true (gptq): Marlin's packing is not loaded"
            )
        offset = 1 if checkpoint_format == "gptq" else 0
        return cls("gptq", group, tuple(listed), offset)

    @classmethod
    def _fp8(cls, cfg: dict[str, Any], listed: tuple[str, ...]) -> CheckpointQuantization:
        if cfg.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quantization_config.fmt={cfg['fmt']!r} (fp8): only e4m3 weights are loaded")
        if cfg.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"quantization_config.activation_scheme={cfg['activation_scheme']!r} (fp8): only dynamic is "
                "loaded (the weights are dequantized; static activation scales would go unused)"
            )
        block = cfg.get("weight_block_size")
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise ConfigError(
                f"quantization_config.weight_block_size={block!r} (fp8): only blocks of "
                f"[{FP8_BLOCK}, {FP8_BLOCK}] are loaded"
            )
        return cls("fp8", FP8_BLOCK, listed)

    def converts(self, module: str) -> bool:
        """Whether the config quantizes `module` (a checkpoint's module name): False where
        modules_to_not_convert names it, or a module it is part of, or a part of it by dotted names
        ("lm_head", "model.layers.0.mlp.gate", "in_proj_a")."""
        dotted = f".{module}."
        return not any(f".{entry.strip('.')}." in dotted for entry in self.not_converted)


# RoPE scaling types and the rope_parameters fields each reads (besides rope_type and rope_theta).
ROPE_SCALING_FIELDS = {
    "linear": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past its training length (transformers' rope_parameters): "linear"
    divides every frequency by `factor`; "yarn" (arXiv 2309.00071) blends interpolated and original
    frequencies per dimension and scales cos and sin by an attention factor. Unset fields take
    transformers' defaults (worker/layers/rotary.py)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf_dict(cls, rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling | None:
        """None for plain RoPE; an UnsupportedModelError naming an unknown type or field."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in ("default", None):
            return None
        if rope_type not in ROPE_SCALING_FIELDS:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported (supported: default, {', '.join(ROPE_SCALING_FIELDS)})"
            )
        known = ROPE_SCALING_FIELDS[rope_type] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        unknown = sorted(set(rope) - known)
        if unknown or rope.get("partial_rotary_factor", 1.0) != 1.0:
            what = unknown or [f"partial_rotary_factor={rope['partial_rotary_factor']}"]
            raise UnsupportedModelError(f"rope type {rope_type!r} with {', '.join(what)} is not supported")
        original = rope.get("original_max_position_embeddings")
        if rope_type == "yarn" and original is None:
            raise UnsupportedModelError("rope type 'yarn' needs original_max_position_embeddings")
        factor = rope.get("factor")
        if factor is None and rope_type == "yarn":  # as transformers: the stretch the config asks for
            assert original is not None  # checked above
            factor = max_position_embeddings / original
        if factor is None or factor <= 0:
            raise UnsupportedModelError(f"rope type {rope_type!r} needs a positive factor, got {factor!r}")
        optional = {name: rope.get(name) for name in ROPE_SCALING_FIELDS[rope_type] - {"factor", "truncate"}}
        return cls(rope_type, float(factor), truncate=bool(rope.get("truncate", True)), **optional)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, independent of the file format it came from."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    spec: ArchitectureSpec
    rope_scaling: RopeScaling | None = None
    moe: MoeSpec | None = None
    hybrid: HybridSpec | None = None
    vision: VisionSpec | None = None  # a multimodal checkpoint's vision tower
    quantization: CheckpointQuantization | None = None  # quantized before it shipped
    has_head: bool = True  # False: a base model without its output head (HEADLESS_ARCHITECTURES)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a paged KV cache: all of them but a hybrid model's linear-attention layers."""
        if self.hybrid is None:
            return self.num_hidden_layers
        return self.num_hidden_layers - len(self.hybrid.linear_layers)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        architectures = cfg.get("architectures") or []
        # a multimodal checkpoint's sits beside its text_config
        quantization = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get(
            "quantization_config"
        )
        if quantization is not None and not isinstance(quantization, dict):
            raise ConfigError(f"quantization_config must be an object, got {quantization!r}")
        text_only = next((TEXT_ONLY[a] for a in architectures if a in TEXT_ONLY), None)
        vision = None
        if text_only is not None:
            if isinstance(cfg.get("vision_config"), dict):
                vision = VisionSpec.from_hf_dict(cfg["vision_config"], cfg)
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise UnsupportedModelError(f"{architectures} without a text_config is not supported")
            cfg = {
                **text,
                "architectures": [text_only],
                "eos_token_id": cfg.get("eos_token_id", text.get("eos_token_id")),
            }
            cfg["tie_word_embeddings"] = cfg.get(
                "tie_word_embeddings", text.get("tie_word_embeddings", False)
            )
        arch = next((a for a in architectures if a in ARCHITECTURES), text_only)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures {architectures} not supported; nanovllm implements {sorted(ARCHITECTURES)}"
            )
        base = ARCHITECTURES[arch]
        attention_bias = bool(cfg.get("attention_bias", False))
        spec = ArchitectureSpec(
            qk_norm=base.qk_norm, qkv_bias=base.qkv_bias or attention_bias, o_bias=attention_bias
        )
        if cfg.get("use_sliding_window") or cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"sliding-window attention (use_sliding_window={cfg.get('use_sliding_window')}) and activations "
                f"other than silu (hidden_act={cfg.get('hidden_act')!r}) are not supported"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        max_position = int(cfg.get("max_position_embeddings", 32768))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        hybrid = None
        if arch in HYBRID_ARCHITECTURES:
            hybrid = HybridSpec.from_hf_dict(cfg, head_dim, rope)
            # Multimodal RoPE (mrope) turns text positions as plain RoPE: every axis holds the position.
            rope = {
                k: v
                for k, v in rope.items()
                if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
            }
        rope_scaling = RopeScaling.from_hf_dict(rope, max_position)
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            # Qwen3.5-MoE has no dense MLP and no intermediate_size: its experts' size stands in.
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            spec=spec,
            rope_scaling=rope_scaling,
            moe=MoeSpec.from_hf_dict(cfg, hybrid=hybrid is not None)
            if arch.endswith("MoeForCausalLM")
            else None,
            hybrid=hybrid,
            vision=vision,
            quantization=None if quantization is None else CheckpointQuantization.from_hf_dict(quantization),
            has_head=arch not in HEADLESS_ARCHITECTURES,
        )

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shape (biases and norms ignored): sizes memory checks."""
        attention = (
            self.hidden_size * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        )
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = (
            self.vocab_size * self.hidden_size * (2 if self.has_head and not self.tie_word_embeddings else 1)
        )
        total = self.num_hidden_layers * (attention + mlp) + embeddings
        if self.hybrid is not None:  # the gate half of q_proj; the linear layers instead of attention
            h = self.hybrid
            value_dim = h.num_value_heads * h.value_head_dim
            linear = self.hidden_size * (h.conv_dim + 2 * value_dim + 2 * h.num_value_heads)
            total += self.num_attention_layers * self.hidden_size * self.num_attention_heads * self.head_dim
            total += len(h.linear_layers) * (linear - attention)
        if self.moe is not None:  # sparse layers: the router and every expert instead of the dense MLP
            experts = self.moe.num_experts * (3 * self.moe.intermediate_size + 1) * self.hidden_size
            experts += (3 * self.moe.shared_expert_intermediate_size + 1) * self.hidden_size
            total += len(self.moe.sparse_layers) * (experts - mlp)
        return total

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{config_path} not found: expected a Hugging Face model directory")
        cfg = json.loads(config_path.read_text())
        # generate() stops on generation_config's EOS ids (Qwen3 chat models list two there); honour both.
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
            base = cfg.get("eos_token_id")
            base = base if isinstance(base, list) else ([] if base is None else [base])
            cfg = {**cfg, "eos_token_id": list(dict.fromkeys(base + extra))}
        return cls.from_hf_dict(cfg)
