"""AWQ and GPTQ int4 checkpoints (Qwen3) loaded as Qwen publishes them: random checkpoints written in
those layouts (tests/model_factory.py: AWQ's GEMM packing, GPTQ's with g_idx and its stored z - 1) with
float32 copies of the same weights, exactly dequantized (s (q - z)) and as the engine's int4 planes hold
them (the min -s z rounded to float16); transformers on a copy is the reference: in float32 the greedy
tokens equal and the logits within 1e-4 (the bound every dense float model here meets)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from nanovllm import LLM
from nanovllm.common.errors import ConfigError
from tests.helpers import QUANTIZED_LOGPROB_TOL, compare_tp, hf_logits, teacher_forced_logits
from tests.model_factory import build_model, edit_quantized, write_int4
from tests.quantized_checkpoints import (
    ENGINE,
    assert_transformers_tokens,
    checkpoint_prompts,
    loaded_with_start_log,
)
from tests.top5 import assert_close, random_prompts, run_case


def _logit_gap(llm: LLM, reference: Path) -> float:
    """The largest |ours - transformers'| over every position of the prompts, fed 7 tokens a step."""
    prompts = checkpoint_prompts()[1:]
    ours = teacher_forced_logits(llm, prompts, 7)
    return max((o.cpu() - hf_logits(reference, p)).abs().max().item() for o, p in zip(ours, prompts))


@pytest.fixture(scope="module")
def int4_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # o_proj's 256 input features split over two ranks in whole groups of 128
    shape = {
        "hidden": 256,
        "heads": 8,
        "kv_heads": 2,
        "overrides": {"head_dim": 32, "intermediate_size": 512},
    }
    return build_model("qwen3", tmp_path_factory.mktemp("int4") / "base", seed=7, **shape)


@pytest.fixture(scope="module", params=["awq", "gptq"])
def int4_model(
    request, int4_base: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    return (request.param, *write_int4(int4_base, root, request.param, symmetric=request.param == "gptq"))


def test_int4_planes_hold_the_weights_up_to_each_groups_min_in_float16(int4_model) -> None:
    """The engine's int4 planes hold w = s q + m with a float16 min m: for s (q - z) that is m = -s z, which
    float16's 11 bits hold exactly for GPTQ's symmetric zero (8 s), but not for AWQ's zeros (0-15, s z needs
    up to 15 bits): there each weight moves by at most half a float16 step of s z (2^-11 of it)."""
    method, _, exact, as_int4 = int4_model
    exact_weights, int4_weights = (
        load_file(exact / "model.safetensors"),
        load_file(as_int4 / "model.safetensors"),
    )
    moved = max((int4_weights[n] - w).abs().max().item() for n, w in exact_weights.items())
    if method == "gptq":
        assert moved == 0
    else:
        largest = max(w.abs().max().item() for n, w in exact_weights.items() if n.endswith("_proj.weight"))
        assert 0 < moved <= 2**-11 * 16 * largest  # |s z| <= 15 s <= 16 s, and the group's range is 15 s


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_awq_and_gptq_give_transformers_tokens_on_the_dequantized_weights(int4_model, quantization) -> None:
    """auto repacks each layer into the engine's int4 planes: equal to transformers on the weights those
    planes hold (for GPTQ the dequantized ones; for AWQ each group's min rounded to float16, above, which
    moved the logits of the exactly dequantized model by up to 0.03 here); the start log counts the rounded
    mins. none dequantizes exactly, s (q - z) in float32."""
    method, packed, exact, as_int4 = int4_model
    llm, line = loaded_with_start_log(model=str(packed), quantization=quantization)
    reference = as_int4 if quantization == "auto" else exact
    assert_transformers_tokens(llm, reference)
    assert _logit_gap(llm, reference) <= 1e-4
    assert line["format"] == method and line["quantized_weights"] == 2 * 7, line
    if quantization == "auto":
        assert line["held_as"] == "int4 in groups of 128", line
        rounded, groups = (
            int(n) for n in line["mins_rounded_to_float16"].removesuffix(" groups").split(" of ")
        )
        scales = [t for n, t in load_file(packed / "model.safetensors").items() if n.endswith(".scales")]
        assert groups == sum(t.numel() for t in scales)
        assert (rounded == 0) == (method == "gptq"), line


def test_awq_two_ranks_equal_one(int4_base, tmp_path) -> None:
    """Row-parallel layers (o, down) split their input features along whole groups of 128 (GPTQ's planes
    are the same PackedWeights once loaded)."""
    compare_tp(write_int4(int4_base, tmp_path, "awq")[0])


def test_gptq_in_activation_order_is_refused_packed_and_served_dequantized(int4_base, tmp_path) -> None:
    packed, dequantized, _ = write_int4(int4_base, tmp_path, "gptq", symmetric=True, act_order=True)
    with pytest.raises(ConfigError, match=r"model\.layers\.\d\.\S+\.g_idx: desc_act .* --quantization none"):
        LLM(str(packed), **ENGINE)
    assert_transformers_tokens(LLM(str(packed), quantization="none", **ENGINE), dequantized)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"bits": 8}, "bits=8"),
        ({"group_size": 100}, "group_size=100"),
        ({"zero_point": False}, "zero_point=false"),
        ({"version": "gemv"}, "version='gemv'"),
    ],
)
def test_an_int4_config_it_cannot_load_fails_at_start_naming_it(int4_base, tmp_path, change, words) -> None:
    packed, *_ = write_int4(int4_base, tmp_path, "awq")
    with pytest.raises(ConfigError, match=words):
        LLM(str(edit_quantized(packed, tmp_path / "edited", config=change)), **ENGINE)


def test_a_missing_int4_plane_fails_at_start_naming_it(int4_model, tmp_path) -> None:
    missing = "model.layers.0.mlp.up_proj.qzeros"
    with pytest.raises(ConfigError, match=rf"{missing} is missing"):
        LLM(str(edit_quantized(int4_model[1], tmp_path / "edited", drop=missing)), **ENGINE)


def test_qwen3_moe_experts_load_from_awq(tmp_path) -> None:
    """Each expert's projections repacked into its own int4 planes, the router left in float."""
    overrides = {"head_dim": 32, "moe_intermediate_size": 128}
    base = build_model(
        "qwen3_moe", tmp_path / "base", hidden=256, heads=8, kv_heads=2, seed=3, overrides=overrides
    )
    packed, _, as_int4 = write_int4(base, tmp_path, "awq")
    llm, line = loaded_with_start_log(model=str(packed))
    assert_transformers_tokens(llm, as_int4)
    assert line["quantized_weights"] == 2 * (4 + 8 * 3), line  # per layer: q, k, v, o and each expert's three
    assert line["unquantized"]["model.layers.*.mlp.gate"] == 2, line


def test_awq_in_bfloat16_meets_the_top5_rule(kernels, int4_base, tmp_path) -> None:
    """tests/test_dtypes.py's rule against transformers in bf16 on the weights the int4 planes hold. Where
    the kernel has integer dots (AVX512-VNNI or AVX2), 16-bit activations are also rounded to int8 in
    blocks of 32 for each decode row, which transformers does not: the logprobs are then held to the
    quantized models' bound (tests/helpers.py QUANTIZED_LOGPROB_TOL), and prompts equal to the end are not
    asked for, as near-ties part (seen 2026-11-29 on the AVX2 EPYC: 1.01 nats, bf16's own bound 1.0; 1 of 6
    prompts to the end). The float32 test above holds the tokens exactly."""
    packed, _, as_int4 = write_int4(int4_base, tmp_path, "awq")
    prompts = random_prompts()
    name, outcomes = run_case(
        "qwen3 awq", packed, "bfloat16", "auto", prompts, 24, "16MiB", reference=as_int4
    )
    if kernels.linear_quantized_int8_dots():
        assert_close(name, "bfloat16", outcomes, min_exact=0, tolerance=QUANTIZED_LOGPROB_TOL["bfloat16"])
    else:
        assert_close(name, "bfloat16", outcomes, min_exact=len(prompts) // 2)
