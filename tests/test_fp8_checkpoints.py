"""Block-FP8 checkpoints (Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE) loaded as Qwen publishes them: random
checkpoints written in that layout (tests/model_factory.py: float8_e4m3fn weights, a float32
weight_scale_inv per 128 x 128 block) with a float32 copy of the same weights dequantized (byte x scale);
transformers on that copy is the reference. The engine holds the very weights the copy holds, so in
float32 the greedy tokens are equal and the logits within 1e-4 (the bound every dense float model here
meets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM
from nanovllm.common.errors import ConfigError
from tests.helpers import (
    assert_within_float32_rounding,
    compare_tp,
    float32_references,
    hf_logits,
    teacher_forced_logits,
)
from tests.model_factory import build_model, edit_quantized, write_block_fp8
from tests.quantized_checkpoints import (
    ENGINE,
    assert_transformers_tokens,
    checkpoint_prompts,
    loaded_with_start_log,
)
from tests.top5 import assert_close, random_prompts, run_case

# Widths that split into several 128 x 128 blocks, the edge ones partial (k/v 64 rows, the MLP's 320).
FP8_SHAPE = {
    "hidden": 256,
    "heads": 4,
    "kv_heads": 2,
    "overrides": {"head_dim": 32, "intermediate_size": 320},
}
# Qwen3.5's published FP8 configs keep the linear attention's small projections (a value head a row) out.
QWEN3_5_LISTED = ("lm_head", "model.embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
FP8_MODELS = {
    "qwen3": ("qwen3", {}, ()),
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 192}, ()),
    "qwen3_5": ("qwen3_5", {}, QWEN3_5_LISTED),
    "qwen3_5_moe": ("qwen3_5_moe", {"moe_intermediate_size": 192, "shared_expert_intermediate_size": 320,
                                    "intermediate_size": None}, QWEN3_5_LISTED),
}  # fmt: skip


def _assert_transformers_logits(llm: LLM, reference: Path, hybrid: bool) -> None:
    """Every position of the prompts, fed 7 tokens a step, within 1e-4 of transformers' logits; a hybrid
    model's within what float32 rounding allows where its gated norms amplify it
    (tests/helpers.py assert_within_float32_rounding: its float64 references for the shorter prompt only)."""
    prompts = checkpoint_prompts()[1:2] if hybrid else checkpoint_prompts()[1:]
    for index, (ours, prompt) in enumerate(zip(teacher_forced_logits(llm, prompts, 7), prompts)):
        if hybrid:
            assert_within_float32_rounding(
                ours.cpu(), *float32_references(reference, prompt), f"prompt {index}"
            )
        else:
            assert (ours.cpu() - hf_logits(reference, prompt)).abs().max() <= 1e-4, f"prompt {index}"


@pytest.fixture(scope="module", params=sorted(FP8_MODELS))
def fp8_model(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    arch, overrides, listed = FP8_MODELS[request.param]
    root = tmp_path_factory.mktemp(f"fp8_{request.param}")
    merged = {**FP8_SHAPE["overrides"], **overrides}
    shape = {**FP8_SHAPE, "overrides": {k: v for k, v in merged.items() if v is not None}}
    base = build_model(
        arch, root / "base", num_layers=4 if arch.startswith("qwen3_5") else 2, seed=5, **shape
    )
    return (request.param, *write_block_fp8(base, root, listed))


def test_block_fp8_gives_transformers_tokens_on_the_dequantized_weights(fp8_model) -> None:
    """Every projection (MoE experts and Qwen3.5's shared expert and linear attention included) read as
    byte x scale; the start log says the format, how many weights were quantized and which matrices
    stayed as they shipped."""
    name, fp8, dequantized = fp8_model
    llm, line = loaded_with_start_log(model=str(fp8))
    assert_transformers_tokens(llm, dequantized)
    _assert_transformers_logits(llm, dequantized, hybrid=name.startswith("qwen3_5"))
    scaled = [n for n in load_file(fp8 / "model.safetensors") if n.endswith("_scale_inv")]
    assert (
        line["format"] == "fp8" and line["block"] == [128, 128] and line["quantized_weights"] == len(scaled)
    )
    assert {"lm_head", "model.embed_tokens"} <= line["unquantized"].keys(), line
    if name.startswith("qwen3_5"):
        assert line["unquantized"]["model.layers.*.linear_attn.in_proj_a"] == 3, line
        assert (
            sum(n.endswith(("in_proj_qkv.weight_scale_inv", "out_proj.weight_scale_inv")) for n in scaled)
            == 6
        )
    if name.endswith("moe"):
        assert any(n.endswith("experts.7.down_proj.weight_scale_inv") for n in scaled)
        assert line["unquantized"]["model.layers.*.mlp.gate"] >= 2, line  # the router, as published


@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8_qwen3")
    return write_block_fp8(build_model("qwen3", root / "base", seed=5, **FP8_SHAPE), root)


def test_block_fp8_in_bfloat16_meets_the_top5_rule(qwen3_fp8) -> None:
    """tests/test_dtypes.py's rule against transformers in bf16 on the dequantized weights."""
    fp8, dequantized = qwen3_fp8
    prompts = random_prompts()
    name, outcomes = run_case(
        "qwen3 fp8", fp8, "bfloat16", "auto", prompts, 24, "16MiB", reference=dequantized
    )
    assert_close(name, "bfloat16", outcomes, min_exact=len(prompts) // 2)


def test_block_fp8_two_ranks_equal_one(qwen3_fp8) -> None:
    """Each rank reads only its slice's bytes and blocks: down_proj's 320 input features split at 160,
    inside a block."""
    compare_tp(qwen3_fp8[0])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"weight_block_size": [64, 64]}, "weight_block_size=[64, 64]"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme='static'"),
        ({"modules_to_not_convert": ["mlp.down_proj"]}, "lists model.layers.0.mlp.down_proj"),
    ],
)
def test_a_block_fp8_config_it_cannot_load_fails_at_start_naming_it(
    qwen3_fp8, tmp_path, change, words
) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        LLM(str(edit_quantized(qwen3_fp8[0], tmp_path / "edited", config=change)), **ENGINE)


def test_a_missing_scale_fails_at_start_naming_it(qwen3_fp8, tmp_path) -> None:
    missing = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    with pytest.raises(ConfigError, match=rf"{missing} is missing"):
        LLM(str(edit_quantized(qwen3_fp8[0], tmp_path / "edited", drop=missing)), **ENGINE)


@pytest.mark.parametrize("fp8_model", ["qwen3_5_moe"], indirect=True)
def test_the_published_multimodal_layout_loads_text_only(fp8_model, tmp_path) -> None:
    """Qwen3.5's published checkpoints: quantization_config beside text_config, the language model's
    tensors under model.language_model. (modules_to_not_convert naming them so), a vision tower's tensor in
    16 bits and an FP8 MTP head beside it, neither served nor counted in the start log. (No vision_config:
    with one the tower is served, tests/test_qwen3_5_vision.py.)"""
    _, fp8, dequantized = fp8_model
    out = tmp_path / "published"
    text = json.loads((fp8 / "config.json").read_text())
    quantization = text.pop("quantization_config")
    quantization["modules_to_not_convert"] = ["lm_head", "model.visual"] + [
        entry if entry.startswith("linear_attn") else entry.replace("model.", "model.language_model.", 1)
        for entry in quantization["modules_to_not_convert"]
        if entry != "lm_head"
    ]
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {**text, "architectures": None},
        "tie_word_embeddings": text["tie_word_embeddings"],
        "quantization_config": quantization,
    }
    tensors = {
        (n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
        for n, t in load_file(fp8 / "model.safetensors").items()
    }
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    tensors["mtp.fc.weight"] = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    tensors["mtp.fc.weight_scale_inv"] = torch.ones(2, 2)
    out.mkdir()
    for item in fp8.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            (out / item.name).write_bytes(item.read_bytes())
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
    llm, line = loaded_with_start_log(model=str(out))
    assert_transformers_tokens(llm, dequantized)
    assert line["quantized_weights"] == sum(n.endswith("_scale_inv") for n in tensors) - 1, line
    assert not any(module.startswith(("model.visual", "mtp")) for module in line["unquantized"]), line
