"""Randomly initialised checkpoints with the shapes of real small models, for benchmarking offline.

There is no model hub here, but throughput depends only on a model's shapes, not on its trained
weights: a random model of the right shape costs the same FLOPs and memory traffic per token. The
benchmark generates with ignore_eos, so what the weights predict never changes the workload.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import WordLevel
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

DEFAULT_CACHE = Path.home() / ".cache" / "nanovllm" / "bench-models"

# Shapes copied from the published configs of the models they are named after.
SHAPES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "smollm2-135m": (
        LlamaConfig,
        {
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    ),
    "qwen3-0.6b": (
        Qwen3Config,
        {
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 3072,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
    ),
}
# The larger Qwen3 dense models differ from 0.6B in these fields only.
for _name, _sizes in {
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144},
    "qwen3-4b": {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "intermediate_size": 9728,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
}.items():
    SHAPES[_name] = (Qwen3Config, {**SHAPES["qwen3-0.6b"][1], **_sizes})
# A model whose steps cost a CPU almost nothing, so that bench.serving on a CPU shows what the router, the
# worker's service and the clients cost per token at a GPU's token rate.
SHAPES["tiny"] = (
    LlamaConfig,
    {
        **SHAPES["smollm2-135m"][1],
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 128,
        "vocab_size": 2048,
    },
)
# Qwen3-30B-A3B: 128 experts, 8 chosen per token; 48 layers in the published model (benchmarks on a CPU
# take fewer: `layers`). intermediate_size is the unused dense MLP's; every layer here is sparse.
SHAPES["qwen3-30b-a3b"] = (
    Qwen3MoeConfig,
    {
        **SHAPES["qwen3-0.6b"][1],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
)

# Qwen3.5-0.8B (the model card's figures: 24 layers, 3 Gated DeltaNet to 1 gated attention, hidden 1024,
# 8 query and 2 KV heads of 256, FFN 3584, vocabulary 248,320; linear layers of 16 heads of 128). The BOS/EOS
# ids are placeholders: the benchmarks ignore EOS.
SHAPES["qwen3.5-0.8b"] = (
    Qwen3_5TextConfig,
    {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 3584,
        "vocab_size": 248320,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 248044,
        "eos_token_id": 248044,
    },
)
# Qwen3.5-2B: the 0.8B's layout at hidden 2048 and FFN 6144 (24 layers, 8 query and 2 KV heads of 256, linear
# layers of 16 heads of 128, tied embeddings), as this project reads the model card; the benchmarks need its
# bytes a token and its step's shape, not its exact widths.
SHAPES["qwen3.5-2b"] = (
    Qwen3_5TextConfig,
    {**SHAPES["qwen3.5-0.8b"][1], "hidden_size": 2048, "intermediate_size": 6144},
)
# Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults are its shape (40 layers, hidden 2048, 256
# experts of 512 with 8 chosen and a shared expert of 512; linear layers of 16 key and 32 value heads).
# Benchmarks on a CPU take fewer layers (`layers`).
SHAPES["qwen3.5-35b-a3b"] = (
    Qwen3_5MoeTextConfig,
    {"tie_word_embeddings": False, "bos_token_id": 248044, "eos_token_id": 248044},
)


def build_config(shape: str, layers: int | None = None) -> PretrainedConfig:
    """The transformers config for a named shape, with `layers` decoder layers if given; raises ValueError
    on an unknown name."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(SHAPES)}")
    config_cls, kwargs = SHAPES[shape]
    return config_cls(**{**kwargs, **({"num_hidden_layers": layers} if layers else {})})


def build_random_model(shape: str, out_dir: Path | None = None, layers: int | None = None) -> Path:
    """Save a seeded random fp32 model of `shape` (with `layers` decoder layers if given) to out_dir
    (safetensors) and return the directory.

    A directory that already holds config.json is reused as is, so repeated benchmark runs do not pay
    for initialising and writing hundreds of MB of weights again.
    """
    name = f"{shape}-{layers}-layers" if layers else shape
    out_dir = Path(out_dir) if out_dir is not None else DEFAULT_CACHE / name
    if (out_dir / "config.json").is_file():
        return out_dir
    config = build_config(shape, layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Write weights before config.json's presence can mark an interrupted build as complete.
    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp_dir)  # transformers 5 always writes safetensors
    for item in tmp_dir.iterdir():
        if item.name != "config.json":
            item.replace(out_dir / item.name)
    (tmp_dir / "config.json").replace(out_dir / "config.json")
    tmp_dir.rmdir()
    return out_dir


def build_serving_model(shape: str, out_dir: Path | None = None) -> Path:
    """build_random_model's checkpoint plus a tokenizer, which a router needs to stream text.

    Token id i decodes to " w<i>" through the byte-level decoder of GPT-2-style tokenizers (SmolLM2's,
    Qwen's), and BOS/EOS are special tokens, so the router detokenizes as it would for the real model.
    The weights are linked from build_random_model's directory, which stays without a tokenizer: there,
    LLM.generate (bench/throughput.py) decodes no text.
    """
    weights_dir = build_random_model(shape)
    out_dir = Path(out_dir) if out_dir is not None else DEFAULT_CACHE / f"{shape}-tokenizer"
    if (out_dir / "tokenizer.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in weights_dir.iterdir():
        if not (out_dir / item.name).exists():
            (out_dir / item.name).symlink_to(item.resolve())
    config = build_config(shape)
    special = {i: f"<|special_{i}|>" for i in {config.bos_token_id, config.eos_token_id}}
    vocab = {special.get(i, f"\u0120w{i}"): i for i in range(config.vocab_size)}  # \u0120: byte-level space
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=special[config.eos_token_id]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in special.values()])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=special[config.bos_token_id],
        eos_token=special[config.eos_token_id],
    ).save_pretrained(out_dir)
    return out_dir


FP8_BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest


def write_block_fp8(model_dir: Path, out_dir: Path | None = None) -> Path:
    """`model_dir`'s checkpoint in Qwen's published block-FP8 layout (config.json's quantization_config:
    fp8, e4m3, dynamic, [128, 128]): every decoder-layer matrix but the norms and the MoE router as
    float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (its largest magnitude / 448), the
    embedding and head as they were. Reused when out_dir holds one already."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out_dir = Path(out_dir) if out_dir is not None else model_dir.with_name(model_dir.name + "-fp8")
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                weight = f.get_tensor(name)
                quantized = ".layers." in name and weight.dim() == 2 and "norm" not in name
                if not quantized or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    tensors[name] = weight
                    continue
                rows, columns = weight.shape
                blocks = (-(-rows // FP8_BLOCK), -(-columns // FP8_BLOCK))
                padded = torch.zeros(blocks[0] * FP8_BLOCK, blocks[1] * FP8_BLOCK)
                padded[:rows, :columns] = weight
                tiles = padded.view(blocks[0], FP8_BLOCK, blocks[1], FP8_BLOCK)
                scales = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
                scaled = tiles / scales[:, None, :, None]
                tensors[name] = scaled.view_as(padded)[:rows, :columns].to(torch.float8_e4m3fn).contiguous()
                tensors[f"{name}_scale_inv"] = scales
        save_file(tensors, out_dir / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }  # fmt: skip
    for item in model_dir.iterdir():  # the index of a sharded checkpoint, a tokenizer
        if item.name != "config.json" and item.suffix != ".safetensors":
            (out_dir / item.name).write_bytes(item.read_bytes())
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))  # last: marks the copy complete
    return out_dir
