"""Small random Hugging Face checkpoints built at test time (no hub access here), with a real tokenizer.

Weights are scaled up so that logits are far from ties: greedy comparisons against transformers then test
the implementation, not floating-point luck.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.chat_templates import QWEN3

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
}


def build_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=chat_template
    )


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
) -> Path:
    """Save a random `arch` model ("qwen3", "qwen3_moe", "llama", "qwen2") into out_dir, with a tokenizer unless
    tokenizer=False (as a converted or custom model may come: it takes prompt token ids only); `rope`:
    transformers' rope_parameters (a RoPE scaling); `overrides`: more config fields."""
    config_cls, extra = _CONFIGS[arch]
    extra = {**extra, **(overrides or {})}
    config = config_cls(
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
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
        if not tie:
            model.lm_head.weight.mul_(4.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        # Qwen3 models get Qwen3's own template (thinking switch, tools); the others plain ChatML.
        build_tokenizer(QWEN3 if arch == "qwen3" else CHAT_TEMPLATE).save_pretrained(out_dir)
    return out_dir


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
