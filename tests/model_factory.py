"""Small random Hugging Face checkpoints built at test time (no hub access here), with a real tokenizer.

Weights are scaled up so that logits are far from ties: greedy comparisons against transformers then test
the implementation, not floating-point luck.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.chat_templates import QWEN3, QWEN3_5

VOCAB = 512
EOS_ID = 1

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests while others decode.",
    "Prefix caching reuses blocks whose tokens hash the same.",
    "Ünïcödé text: naïve café, 東京, Ελληνικά, emoji 🙂🚀 too.",
    "Numbers 0123456789 and punctuation !?,;:()[]{}<>/\\|@#$%^&*",
] * 20

# ChatML, as Qwen and SmolLM2 use it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CONFIGS = {
    "qwen3": (Qwen3Config, {"head_dim": 16}),
    # 8 experts of 32 intermediate features, 2 per token, in every layer (overrides change any of it)
    "qwen3_moe": (
        Qwen3MoeConfig,
        {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "llama": (LlamaConfig, {"head_dim": 16}),
    "qwen2": (Qwen2Config, {}),
    # Qwen3.5's hybrid: 2 key and 4 value heads of 16 in the linear layers, 3 linear to 1 full by default
    "qwen3_5": (
        Qwen3_5TextConfig,
        {
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),
}
# Qwen3.5-MoE: the hybrid's layers, 8 experts of 32 features (2 per token) and a shared expert of 48
_CONFIGS["qwen3_5_moe"] = (
    Qwen3_5MoeTextConfig,
    {
        **_CONFIGS["qwen3_5"][1],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
)


# A vision model's special tokens (ids 2-5 of its tokenizer), as Qwen's tokenizers name them.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 2, 3, 4, 5


def build_tokenizer(
    chat_template: str = CHAT_TEMPLATE, vision: bool = False, words: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """`words`: trained on often enough to be one token each (a reranker's "yes" and "no")."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<eos>", *(VISION_TOKENS if vision else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS + list(words) * 50, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=chat_template
    )


def _scale_up(model: torch.nn.Module, hybrid: bool, tie: bool) -> None:
    """Weights scaled so that logits are far from ties (see the module's docstring)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and hybrid and "linear_attn" not in name and "visual" not in name:
                param.uniform_(-0.2, 0.2)  # zero-centred: applied as 1 + w
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                fan_in = param[0].numel() if "patch_embed" in name else param.shape[-1]  # a Conv3d's
                param.normal_(0.0, 1.0 / fan_in**0.5)
        if not tie:
            model.lm_head.weight.mul_(4.0)
        for name, param in model.named_parameters():
            # Linear attention's q/k/v into the delta rule at about unit scale: at the plain init they are
            # ~0.06 and the heads' outputs ~0.015 rms, which the gated norm divides rounding by (a 1e-6
            # change of the embeddings moved the logits by 2.7e-4, 17x a Qwen3 model's; 4.9e-5 after this).
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                param.mul_(4.0)


def build_vision_model(
    out_dir: Path,
    *,
    arch: str = "qwen3_5",
    num_layers: int = 4,
    seed: int = 0,
    min_pixels: int = 32 * 32,
    max_pixels: int = 128 * 128,
) -> Path:
    """Save a random Qwen3_5ForConditionalGeneration (arch "qwen3_5") or Qwen3_5MoeForConditionalGeneration
    ("qwen3_5_moe") into out_dir: the hybrid text model of build_model's shapes (its full attention
    turning 12 of 16 dimensions with multimodal RoPE sections of 2, 2 and 2 frequencies, so every axis
    turns some), a 2-block tower of width 32 over 16-pixel patches with a 4x4 position table, a tokenizer
    with the vision tokens, and transformers' image processor's preprocessor_config.json (images resized
    into [min_pixels, max_pixels])."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config, Qwen3_5MoeConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, extra = _CONFIGS[arch]
    text = {
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024, "eos_token_id": EOS_ID, "pad_token_id": 0,
        "rms_norm_eps": 1e-6, **extra,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "mrope_section": [2, 2, 2], "mrope_interleaved": True,
        },
    }  # fmt: skip
    if arch == "qwen3_5":
        text["intermediate_size"] = 128
    vision = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
    }  # fmt: skip
    top = {"qwen3_5": Qwen3_5Config, "qwen3_5_moe": Qwen3_5MoeConfig}[arch]
    config = top(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _scale_up(model, hybrid=True, tie=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    build_tokenizer(QWEN3_5, vision=True).save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    ).save_pretrained(out_dir)  # fmt: skip
    return out_dir


def build_model(
    arch: str,
    out_dir: Path,
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = False,
    seed: int = 0,
    max_position: int = 1024,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    rope: dict | None = None,
    overrides: dict | None = None,
    mtp: bool = False,
) -> Path:
    """Save a random `arch` model ("qwen3", "qwen3_moe", "llama", "qwen2") into out_dir, with a tokenizer unless
    tokenizer=False (as a converted or custom model may come: it takes prompt token ids only); `rope`:
    transformers' rope_parameters (a RoPE scaling); `overrides`: config fields, these above included; `mtp`
    (Qwen3.5 and Qwen3.5-MoE): a random multi-token-prediction head in the published layout
    (_add_mtp_head), which transformers does not read."""
    config_cls, extra = _CONFIGS[arch]
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=tie,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        **({"rope_parameters": rope} if rope else {}),
    )
    if arch == "qwen3_5_moe":  # every layer sparse: no dense MLP size
        del fields["intermediate_size"]
    config = config_cls(**{**fields, **extra, **(overrides or {})})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_up(model, hybrid=arch.startswith("qwen3_5"), tie=tie)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if mtp:
        _add_mtp_head(model, out_dir)
    if tokenizer:
        # Qwen3 and Qwen3.5 models get their family's template (thinking switch, tools); the others plain
        # ChatML.
        template = {"qwen3": QWEN3, "qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5}.get(arch, CHAT_TEMPLATE)
        build_tokenizer(template).save_pretrained(out_dir)
    return out_dir


def _add_mtp_head(model, out_dir: Path) -> None:
    """Add `mtp.*` tensors to a saved single-file Qwen3.5 checkpoint, as the published ones hold them: fc
    [hidden, 2 hidden], pre_fc_norm_embedding, pre_fc_norm_hidden and norm (zero-centred), and one
    full-attention decoder layer mtp.layers.0.* (experts in the MoE), drawn as the model's own weights are
    (seeded by the model's weights), and `mtp_num_hidden_layers: 1` in config.json."""
    from safetensors.torch import load_file, save_file

    config = model.config
    full = config.layer_types.index("full_attention")
    generator = torch.Generator().manual_seed(int(model.lm_head.weight.float().sum().abs() * 1e3) % 2**31)
    state = model.state_dict()
    hidden = config.hidden_size
    head = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    prefix = f"model.layers.{full}."
    head |= {
        "mtp.layers.0." + name.removeprefix(prefix): tuple(value.shape)
        for name, value in state.items()
        if name.startswith(prefix)
    }
    tensors = {}
    for name, shape in head.items():
        if "norm" in name:
            value = torch.rand(shape, generator=generator) * 0.4 - 0.2  # applied as 1 + w
        else:
            value = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        tensors[name] = value.contiguous()
    path = out_dir / "model.safetensors"
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(saved, indent=2))


ALL_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out_dir: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A random PEFT adapter for `model_dir`, strong enough to change its greedy tokens: A and B drawn
    with twice the base weights' spread (standard deviation 2 / sqrt(fan-in)), lora_alpha = rank / 2 so
    the scale is not 1."""
    from peft import LoraConfig, get_peft_model  # only the LoRA tests pay for importing PEFT

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=rank // 2, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 2.0 / param.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


# Hugging Face tensor name (within model.layers.N) -> llama.cpp's (within blk.N), as its converter writes
# Qwen2/Qwen3/Qwen3-MoE files (no q/k row permutation: that is Llama's alone).
_GGUF_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
# Qwen3.5's, where they differ or add to those (gguf's MODEL_TENSORS[MODEL_ARCH.QWEN35 / QWEN35MOE]).
_GGUF_QWEN35_TENSORS = {
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.out_proj": "ssm_out",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# ... and the two whose names end otherwise than .weight in one layout or the other.
_GGUF_QWEN35_RENAMED = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}
_GGUF_ARCH = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
}
# Tensors llama.cpp's converter keeps in float32 whatever the file's type (besides 1-D ones and norms).
_GGUF_FLOAT_TENSORS = (".ffn_gate_inp.", ".ffn_gate_inp_shexp.", ".ssm_conv1d.")


def write_gguf(
    model_dir: Path,
    path: Path,
    quant: str = "F32",
    pre: str = "gpt-2",
    *,
    fuse_gate_up: bool = False,
    mtp: bool = False,
) -> Path:
    """Write a build_model checkpoint (qwen2, qwen3, qwen3_moe, qwen3_5 or qwen3_5_moe) as llama.cpp's
    converter would: its metadata, its byte-level BPE vocabulary, each projection in `quant` (F32, Q8_0,
    Q4_1, ...; F16 where a row does not divide into the type's blocks; norms, biases, routers and the
    convolution stay F32 as llama.cpp keeps them) and each layer's experts stacked into one 3-D tensor per
    projection (ffn_{gate,up,down}_exps, [experts, out, in]; with `fuse_gate_up` gate and up in one,
    ffn_gate_up_exps, as the converter's --fuse-gate-up-exps writes them). Qwen3.5's tensors change as the
    converter changes them (_as_llama_cpp_converts); `mtp` appends a multi-token prediction block as the
    converter writes a checkpoint's: its own `mtp.*` head renamed (mtp.layers.0 as block N, fc and its
    norms as blk.N.nextn.*), or for a checkpoint without one a copy of its last full-attention layer and
    random nextn tensors. `pre`: the pre-tokenizer the file names."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    arch = _GGUF_ARCH[config["model_type"]]
    hybrid = arch in ("qwen35", "qwen35moe")
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers + (1 if mtp else 0))
    if "intermediate_size" in config:  # Qwen3.5-MoE has none
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if hybrid:
        _qwen35_metadata(writer, config, head_dim, mtp)
    elif mtp:
        raise ValueError("llama.cpp's converter writes a multi-token prediction block for Qwen3.5 only")
    if arch in ("qwen3moe", "qwen35moe"):
        if arch == "qwen3moe" and not config["norm_topk_prob"]:
            raise ValueError("llama.cpp's qwen3moe always renormalises the chosen experts' weights")
        writer.add_expert_count(config.get("num_experts", config.get("num_local_experts")))
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if arch == "qwen35moe":
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    kinds = [3 if token in special else 1 for token in tokens]  # control or normal
    padding = range(len(tokens), config["vocab_size"])  # the converter pads to the embedding's rows, unused
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([*tokens, *(f"[PAD{i}]" for i in padding)])
    writer.add_token_types([*kinds, *(5 for _ in padding)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        writer.add_chat_template(template)

    layer_names = {**_GGUF_LAYER_TENSORS, **(_GGUF_QWEN35_TENSORS if hybrid else {})}
    weights = load_file(str(model_dir / "model.safetensors"))
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    expert_layers: set[int] = set()
    tensors: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if name.startswith("mtp."):  # the checkpoint's own head, renamed as the converter renames it
            name = _CONVERTED_MTP.get(name, name.replace("mtp.layers.0.", f"model.layers.{layers}.", 1))
            if not mtp:
                raise ValueError(f"{model_dir} has a multi-token prediction head: write it with mtp=True")
        if hybrid:
            value = _as_llama_cpp_converts(name, value, config)
        if name.startswith("nextn."):
            tensors[f"blk.{layers}.{name}"] = value
            continue
        stem, _, suffix = name.rpartition(".")
        parts = name.split(".")
        within = ".".join(parts[3:])  # the name within model.layers.N
        if stem in ("model.embed_tokens", "model.norm", "lm_head"):
            gguf_stem = {
                "model.embed_tokens": "token_embd",
                "model.norm": "output_norm",
                "lm_head": "output",
            }[stem]
            tensors[f"{gguf_stem}.{suffix}"] = value
        elif hybrid and within in _GGUF_QWEN35_RENAMED:
            tensors[f"blk.{parts[2]}.{_GGUF_QWEN35_RENAMED[within]}"] = value
        elif parts[3:5] == ["mlp", "experts"] and len(parts) == 6:  # stacked: [E, out, in] (gate rows first)
            if parts[5] == "down_proj":
                tensors[f"blk.{parts[2]}.ffn_down_exps.weight"] = value
            else:
                half = value.shape[1] // 2
                tensors[f"blk.{parts[2]}.ffn_gate_exps.weight"] = value[:, :half]
                tensors[f"blk.{parts[2]}.ffn_up_exps.weight"] = value[:, half:]
            expert_layers.add(int(parts[2]))
        elif parts[3:5] == ["mlp", "experts"]:  # model.layers.N.mlp.experts.E.<projection>.weight
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = value
            expert_layers.add(int(parts[2]))
        else:
            tensors[f"blk.{parts[2]}.{layer_names[within.rpartition('.')[0]]}.{suffix}"] = value
    for (layer, projection), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        tensors[f"blk.{layer}.ffn_{projection.removesuffix('_proj')}_exps.weight"] = stacked
    if fuse_gate_up:
        for layer in sorted(expert_layers):
            gate = tensors.pop(f"blk.{layer}.ffn_gate_exps.weight")
            up = tensors.pop(f"blk.{layer}.ffn_up_exps.weight")
            tensors[f"blk.{layer}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    if mtp and not any(name.startswith(f"blk.{layers}.nextn.") for name in tensors):
        tensors |= _mtp_block(tensors, config)
    for name, value in sorted(tensors.items()):
        value = np.ascontiguousarray(value, dtype=np.float32)
        if (
            quant == "F32"
            or value.ndim == 1
            or name.endswith("_norm.weight")
            or any(part in name for part in _GGUF_FLOAT_TENSORS)
        ):
            writer.add_tensor(name, value)
            continue
        qtype = gguf.GGMLQuantizationType[quant]
        try:
            data = gguf.quants.quantize(value, qtype)
        except gguf.QuantError:  # as the converter: rows that do not divide into blocks go F16
            writer.add_tensor(name, value.astype(np.float16))
            continue
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _qwen35_metadata(writer, config: dict, head_dim: int, mtp: bool) -> None:
    """Qwen3.5's keys as llama.cpp's converter writes them: the linear layers' shape as ssm.*, the layer
    kinds as full_attention_interval (4 unless the config says otherwise: the converter does not read
    layer_types, so a config whose layer_types break the pattern would make a wrong file), the rotated
    dimensions and the multimodal RoPE sections (the converter's default when the config has none)."""
    layers = config["num_hidden_layers"]
    interval = config.get("full_attention_interval", 4)
    pattern = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if config.get("layer_types", pattern) != pattern:
        raise ValueError(
            f"layer_types {config['layer_types']} are not every {interval}th layer full attention"
        )
    writer.add_full_attention_interval(interval)
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    writer.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    if mtp:
        writer.add_nextn_predict_layers(1)


def _as_llama_cpp_converts(name: str, value, config: dict):
    """A Qwen3.5 checkpoint tensor (numpy, float32) as llama.cpp's converter writes it: with more value
    heads than key heads, the value heads from grouped by key head to tiled order (the value rows of
    in_proj_qkv and the convolution, the rows of in_proj_z, in_proj_b and in_proj_a, A_log's and dt_bias's
    entries, out_proj's columns); A_log as -exp(A_log); the convolution [C, 1, K] squeezed to [C, K]; each
    zero-centred norm (all but the linear layers' own) as 1 + w."""
    import numpy as np

    keys, values = config["linear_num_key_heads"], config["linear_num_value_heads"]

    def tiled(x, width):  # rows [key head, its value heads, width] -> [value head, key head, width]
        return x.reshape(keys, values // keys, width, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)

    if "conv1d" in name:
        value = value.squeeze()
    if keys != values and ".linear_attn." in name:
        dv, qk = config["linear_value_head_dim"], 2 * keys * config["linear_key_head_dim"]
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            value = np.concatenate([value[:qk], tiled(value[qk:], dv)])
        elif name.endswith("in_proj_z.weight"):
            value = tiled(value, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            value = tiled(value, 1)
        elif name.endswith("out_proj.weight"):
            value = tiled(value.T, dv).T
    if name.endswith("A_log"):
        return (-torch.exp(torch.from_numpy(np.array(value)))).numpy()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return value + np.float32(1)
    return value


# The head's own tensors as llama.cpp's converter names them (its norms get 1 + w as every norm.weight does).
_CONVERTED_MTP = {
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}


def _mtp_block(tensors: dict, config: dict) -> dict:
    """A multi-token prediction block after the layers, as the converter writes one: a full-attention
    layer (here a copy of the last one) with the nextn tensors (random)."""
    import numpy as np

    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    kinds = config.get("layer_types") or []
    last = max(i for i in range(layers) if kinds[i] == "full_attention")
    block = {
        name.replace(f"blk.{last}.", f"blk.{layers}.", 1): value
        for name, value in tensors.items()
        if name.startswith(f"blk.{last}.")
    }
    rng = np.random.default_rng(0)
    block[f"blk.{layers}.nextn.eh_proj.weight"] = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        block[f"blk.{layers}.nextn.{norm}.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(
            np.float32
        )
    return block


# --------------------------------------------------------------------------- checkpoints quantized as published

FP8_MAX = 448.0  # float8_e4m3fn's largest


def _quantized_projection(name: str, weight: torch.Tensor, listed: list[str]) -> bool:
    """A decoder layer's projection (an expert's, a shared expert's, a linear attention's included) that
    the published checkpoints quantize: every matrix under model.layers but the norms, the MoE router and
    shared-expert gate, and the modules the config lists."""
    module = name.removesuffix(".weight")
    return (
        ".layers." in name
        and name.endswith(".weight")
        and weight.dim() == 2
        and "norm" not in name
        and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
        and not any(module == entry or module.endswith("." + entry) for entry in listed)
    )


def _rewrite(model_dir: Path, out_dir: Path, tensors: dict, quantization: dict | None) -> Path:
    """`model_dir`'s tokenizer and config (with `quantization` as its quantization_config, or none) beside
    `tensors` in out_dir."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            (out_dir / item.name).write_bytes(item.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")
    return out_dir


def write_block_fp8(
    model_dir: Path, out_dir: Path, listed: tuple[str, ...] = (), block: int = 128
) -> tuple[Path, Path]:
    """`model_dir` as Qwen's block-FP8 checkpoints ship (`out_dir / "fp8"`): each quantized projection's
    weight in float8_e4m3fn with a float32 `weight_scale_inv` per `block` x `block` block (its largest
    magnitude / 448; the edge blocks partial), everything else as it was; `listed`: the config's
    modules_to_not_convert. Also the same checkpoint dequantized, byte x scale in float32
    (`out_dir / "dequantized"`): transformers' reference for it."""
    from safetensors.torch import load_file

    quantized, dequantized = {}, {}
    for name, weight in load_file(model_dir / "model.safetensors").items():
        if not _quantized_projection(name, weight, list(listed)):
            quantized[name] = dequantized[name] = weight
            continue
        rows, columns = weight.shape
        scales = torch.empty(-(-rows // block), -(-columns // block))
        bytes_ = torch.empty(rows, columns, dtype=torch.float8_e4m3fn)
        values = torch.empty(rows, columns)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                part = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
                scale = part.abs().max() / FP8_MAX
                scales[i, j] = scale
                stored = (part / scale).to(torch.float8_e4m3fn)
                bytes_[i * block : (i + 1) * block, j * block : (j + 1) * block] = stored
                values[i * block : (i + 1) * block, j * block : (j + 1) * block] = stored.float() * scale
        quantized[name], quantized[f"{name}_scale_inv"] = bytes_, scales
        dequantized[name] = values
    config = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [block, block],
        **({"modules_to_not_convert": list(listed)} if listed else {}),
    }
    fp8 = _rewrite(model_dir, out_dir / "fp8", quantized, config)
    return fp8, _rewrite(model_dir, out_dir / "dequantized", dequantized, None)


def _int4_levels(
    weight: torch.Tensor, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] rounded to 4-bit levels q [N, K] with a float16 scale s and an integer zero z [N, K / group]
    per group of input features: w ~ s (q - z); symmetric: z = 8 (GPTQ's sym=true)."""
    rows, columns = weight.shape
    w = weight.view(rows, columns // group, group)
    if symmetric:
        scales = (w.abs().amax(dim=2) / 7.5).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        low, high = w.amin(dim=2).clamp(max=0), w.amax(dim=2).clamp(min=0)
        scales = ((high - low) / 15).half()
        zeros = (-low / scales.float()).round().clamp(0, 15).to(torch.int32)
    levels = (w / scales.float().unsqueeze(2) + zeros.unsqueeze(2)).round().clamp(0, 15).to(torch.int32)
    return levels.view(rows, columns), scales, zeros


def _pack8(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, C] 4-bit values -> [R, C / 8] int32, value 8 c + order[i] in nibble i."""
    rows, columns = values.shape
    grouped = values.view(rows, columns // 8, 8)
    packed = torch.zeros(rows, columns // 8, dtype=torch.int64)
    for nibble, index in enumerate(order):
        packed |= grouped[:, :, index].long() << (4 * nibble)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the int32 of those bits


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble i holds column 8 c + AWQ_ORDER[i]


def write_int4(
    model_dir: Path,
    out_dir: Path,
    method: str,
    group: int = 128,
    symmetric: bool = False,
    act_order: bool = False,
) -> tuple[Path, Path, Path]:
    """`model_dir` as Qwen's AWQ (GEMM packing: qweight int32 [K, N / 8] in AWQ's nibble order, qzeros
    [K / group, N / 8] likewise, scales float16 [K / group, N]) or GPTQ-Int4 checkpoints ship (qweight
    int32 [K / 8, N], features in nibble order; qzeros [K / group, N / 8] storing z - 1, the "gptq"
    checkpoint format; scales; g_idx [K]), every decoder projection quantized (`out_dir / method`);
    `act_order`: GPTQ's desc_act, each feature's group from a shuffled g_idx; `symmetric`: z = 8 (GPTQ's
    sym=true, as Qwen's GPTQ-Int4 checkpoints). Also the same checkpoint dequantized, s (q - z) in float32
    (`out_dir / "dequantized"`), and as this engine's int4 planes hold it, s q + m with the min m = -s z
    rounded to float16, summed in float32 (`out_dir / "as_int4"`)."""
    from safetensors.torch import load_file

    if method == "gptq" and not symmetric:
        raise ValueError("asymmetric GPTQ stores z - 1, which a zero of 0 wraps: write symmetric GPTQ only")

    quantized, dequantized, as_int4 = {}, {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, weight in load_file(model_dir / "model.safetensors").items():
        if not _quantized_projection(name, weight, []):
            quantized[name] = dequantized[name] = as_int4[name] = weight
            continue
        columns = weight.shape[1]
        g_idx = torch.arange(columns) // group
        if act_order:
            g_idx = g_idx[torch.randperm(columns, generator=generator)]
        order = torch.argsort(g_idx, stable=True)  # features group by group
        levels, scales, zeros = _int4_levels(weight[:, order], group, symmetric)
        levels = levels[:, torch.argsort(order)]  # back to the features' own order
        dequantized[name] = (levels - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
        mins = (-(scales.float() * zeros)).half().float()
        as_int4[name] = levels.float() * scales.float()[:, g_idx] + mins[:, g_idx]
        module = name.removesuffix(".weight")
        if method == "awq":
            quantized[f"{module}.qweight"] = _pack8(levels.t().contiguous(), AWQ_ORDER)
            quantized[f"{module}.qzeros"] = _pack8(zeros.t().contiguous(), AWQ_ORDER)
        else:
            quantized[f"{module}.qweight"] = _pack8(levels, list(range(8))).t().contiguous()
            quantized[f"{module}.qzeros"] = _pack8(((zeros - 1) & 0xF).t().contiguous(), list(range(8)))
            quantized[f"{module}.g_idx"] = g_idx.int()
        quantized[f"{module}.scales"] = scales.t().contiguous()
    if method == "awq":
        config = {"bits": 4, "group_size": group, "modules_to_not_convert": None, "quant_method": "awq",
                  "version": "gemm", "zero_point": True}  # fmt: skip
    else:
        config = {"bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
                  "quant_method": "gptq", "checkpoint_format": "gptq", "damp_percent": 0.01}  # fmt: skip
    packed = _rewrite(model_dir, out_dir / method, quantized, config)
    exact = _rewrite(model_dir, out_dir / "dequantized", dequantized, None)
    return packed, exact, _rewrite(model_dir, out_dir / "as_int4", as_int4, None)


def edit_quantized(
    model_dir: Path, out_dir: Path, config: dict | None = None, drop: str | None = None
) -> Path:
    """A copy of a quantized checkpoint with quantization_config fields changed (`config`), or the tensor
    `drop` left out."""
    from safetensors.torch import load_file

    tensors = load_file(model_dir / "model.safetensors")
    tensors.pop(drop or "", None)
    quantization = {
        **json.loads((model_dir / "config.json").read_text())["quantization_config"],
        **(config or {}),
    }
    return _rewrite(model_dir, out_dir, tensors, quantization)
