"""Qwen3.5 and Qwen3.5-MoE from GGUF files (`qwen35`, `qwen35moe`) written at test time as llama.cpp's
converter writes them (tests/model_factory.py write_gguf: its tensor names, metadata and changes to the
tensors, a multi-token prediction block after the layers, the value heads in tiled order: these configs
have 4 value heads over 2 key heads). From F32 files: the checkpoint's config, its float32 greedy tokens
and its logits to float32 rounding. Quantized files serve their Q8_0 / Q4_1 tensors as they ship, in the
checkpoint's order; a dense Q8_0 file keeps the top-5 rule against float32; Q4_1 files and the MoE compute
exactly with their quantized values. bench/gguf_fidelity.py checks the writer against llama.cpp itself."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from nanovllm import LLM
from nanovllm.common.errors import ConfigError, UnsupportedModelError
from nanovllm.worker.layers.quantization import PackedWeight
from nanovllm.worker.llm import load_tokenizer
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf import cache as gguf_cache
from nanovllm.worker.models.gguf.cache import prepare_gguf
from nanovllm.worker.models.gguf.layout import hf_config, open_reader, read_metadata
from nanovllm.worker.models.gguf.tensors import gguf_quant_plan, gguf_tensors
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from tests.helpers import (
    QUANTIZED_LOGPROB_TOL,
    QUANTIZED_TOP_GAP,
    assert_within_float32_rounding,
    float32_references,
    greedy,
    greedy_with_logprobs,
    hf_greedy,
    info_logs,
    recorded_proposals,
    teacher_forced_logits,
    top5_rule,
)
from tests.model_factory import build_model, write_gguf

MAX_NEW = 16
_rng = random.Random(14)
PROMPTS = [[_rng.randrange(2, 512) for _ in range(n)] for n in (3, 40, 150)]
ENGINE = {"max_model_len": 512, "kv_cache_memory": "16MiB", "dtype": "float32"}
# Quantized files: value heads of 32 features, so ssm_out's columns move in whole Q8_0/Q4_1 blocks as the
# published models' 128 do (at 16 they cannot: test_quantized_tensors_...); the shared expert at 64.
BLOCK_ALIGNED = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}


def _source(root: Path, arch: str, **overrides) -> Path:
    if arch == "qwen3_5_moe":
        overrides = {"shared_expert_intermediate_size": 64, **overrides}
    return build_model(arch, root / "hf", num_layers=4, seed=5, max_position=512, overrides=overrides)


def _load(path: Path, root: Path, **kwargs) -> LLM:
    """The engine on a .gguf file, its conversion cached under `root` (tests/test_gguf_architectures.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_cache, "default_cache_root", lambda: root / "gguf-cache")
        return LLM(str(path), **{**ENGINE, **kwargs})


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_an_f32_file_serves_the_checkpoints_tokens_and_logits(tmp_path: Path, arch: str):
    """The file's metadata gives the checkpoint's config; its multi-token prediction block is not served;
    the MoE's gate and up come fused (--fuse-gate-up-exps). The directory it converts into with weights
    holds the checkpoint's tensors: the zero-centred norms as applied (1 + w), A_log to float32 rounding.
    Greedy tokens equal transformers' on the
    checkpoint. Teacher-forced logits in prefill and decode within 1e-4 of the checkpoint's own engine run
    the same way (deterministic as auto chose for the file: off for GGUF weights, where a prompt's linear
    layers run the chunked form), or where the hybrid amplifies float32 rounding within its bound
    (tests/helpers.py assert_within_float32_rounding): every weight the engine holds is the checkpoint's
    but A_log, which comes back as log(-ssm_a) (the converter wrote -exp(A_log)), float32 rounding from
    the checkpoint's in some heads. (Measured: equal.)"""
    source = _source(tmp_path, arch)
    path = write_gguf(source, tmp_path / "model.gguf", mtp=True, fuse_gate_up=arch == "qwen3_5_moe")
    with info_logs() as logs:
        llm = _load(path, tmp_path)
    assert llm.config.model_config == ModelConfig.from_pretrained_dir(source)
    skipped = [e for e in logs if e["event"] == "gguf_tensors_not_served"]
    assert skipped and skipped[0]["tensors"] == (15 if arch == "qwen3_5" else 19), skipped  # the MTP block
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out["token_ids"] == hf_greedy(source, prompt, MAX_NEW)
    # A reader of directories (a draft model, transformers) gets the checkpoint's tensors back
    checkpoint = load_file(str(source / "model.safetensors"))
    converted: dict[str, np.ndarray] = {}
    for shard in prepare_gguf(path, tmp_path / "with-weights", weights=True).glob("*.safetensors"):
        converted |= load_file(str(shard))
    assert converted.keys() == checkpoint.keys()
    one = np.float32(1)
    for name, value in checkpoint.items():
        if name.endswith("A_log"):
            # log(-ssm_a): ssm_a = -exp(A_log) within a unit of its own in the last place (its rounding and
            # exp's), which log turns into that relative error, plus the result's rounding to float32
            decay = np.exp(value.astype(np.float64)).astype(np.float32)
            bound = np.spacing(decay) / decay + np.spacing(np.abs(value)) / 2
            assert (np.abs(converted[name] - value) <= bound).all(), name
        elif name.endswith("norm.weight") and ".linear_attn." not in name:  # the file's 1 + w, applied
            assert np.array_equal(one + converted[name], one + value), name
        else:
            assert np.array_equal(converted[name], value), name
    own = LLM(str(source), **{**ENGINE, "deterministic": llm.config.deterministic})
    for chunk in (1000, 1):
        pairs = zip(teacher_forced_logits(llm, PROMPTS, chunk), teacher_forced_logits(own, PROMPTS, chunk))
        for index, (ours, theirs) in enumerate(pairs):
            if (ours - theirs).abs().max() > 1e-4:
                _, exact, moved = float32_references(source, PROMPTS[index])
                where = f"chunk {chunk} prompt {index}"
                assert_within_float32_rounding(ours.cpu(), theirs.cpu().double(), exact, moved, where)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("arch", "quant", "head_dim"),
    [("qwen3_5", "Q8_0", 16), ("qwen3_5", "Q4_1", 32), ("qwen3_5_moe", "Q8_0", 32)],
)
def test_quantized_tensors_are_served_in_the_checkpoints_order(
    tmp_path: Path, arch: str, quant: str, head_dim: int
):
    """Each packed tensor holds the checkpoint's tensor as llama.cpp's blocks quantize it, in the
    checkpoint's order (the value heads' rows, and ssm_out's columns block by block, put back; the fused
    experts' gate and up split), and dequantizes exactly as the tensor read dequantized does. With value
    heads of 16 features ssm_out's columns would move within blocks: it is dequantized (logged) and holds
    the checkpoint's tensor to Q8_0's rounding."""
    source = _source(tmp_path, arch, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim)
    path = write_gguf(source, tmp_path / "model.gguf", quant, fuse_gate_up=arch == "qwen3_5_moe")
    config = ModelConfig.from_pretrained_dir(source)
    with info_logs() as logs:
        plan = gguf_quant_plan(path, config, Qwen3_5ForCausalLM.packed_modules_mapping)
    assert plan.by_layer is not None
    out_proj_packed = "model.layers.0.linear_attn.out_proj" in plan.by_layer
    assert out_proj_packed == (head_dim == 32)
    dequantized = {e["tensor"] for e in logs if e["event"] == "gguf_tensor_dequantized"}
    assert dequantized == ({f"blk.{i}.ssm_out.weight" for i in range(3)} if head_dim == 16 else set())
    checkpoint = load_file(str(source / "model.safetensors"))
    qtype = gguf.GGMLQuantizationType[quant]
    dense = {name: t.read() for name, t in gguf_tensors(path, config, packed=False)}
    packed = 0
    for name, tensor in gguf_tensors(path, config):
        value = tensor.read()
        if not isinstance(value, PackedWeight):
            assert torch.equal(value, dense[name]), name
            continue
        packed += 1
        ours = value.dequantize(torch.float32).numpy()
        assert np.array_equal(ours, dense[name].numpy()), name
        theirs = gguf.quants.dequantize(gguf.quants.quantize(checkpoint[name], qtype), qtype)
        assert np.array_equal(ours, theirs.reshape(ours.shape)), name
    # Every 2-D weight but the router and the shared expert's gate, and ssm_out at 16: the embedding and
    # the head; in each linear layer in_proj_qkv, _z, _b, _a and out_proj, in the full-attention one q, k,
    # v and o; the dense MLP's three, or each of 8 experts' three and the shared expert's three.
    mlp = 3 if arch == "qwen3_5" else 3 * 8 + 3
    assert packed == 2 + 3 * (5 - (head_dim == 16) + mlp) + 4 + mlp
    if head_dim == 16:
        name = "model.layers.0.linear_attn.out_proj.weight"
        step = np.abs(checkpoint[name]).max() / 127  # Q8_0's largest step: its block's amax / 127
        # half a step of rounding, and the step's own rounding to float16 over 127 levels
        assert np.abs(dense[name].numpy() - checkpoint[name]).max() <= step * (0.5 + 127 / 2048)


def test_a_q8_0_file_keeps_the_top5_rule_against_float32(tmp_path: Path):
    """tests/test_quantization.py's rule for int8 on the random dense models, here on a Q8_0 file served as
    it ships (every projection, the embedding and the head: the start log's weights_quantized line says
    so), against the float32 checkpoint."""
    source = _source(tmp_path, "qwen3_5", **BLOCK_ALIGNED)
    with info_logs() as logs:
        shipped = _load(write_gguf(source, tmp_path / "model.gguf", "Q8_0", mtp=True), tmp_path)
    (stated,) = [e for e in logs if e["event"] == "weights_quantized"]
    assert stated["format"] == "gguf" and stated["types"] == {"Q8_0": 2 + 4 * 4}, stated
    rng = random.Random(29)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 7, 30, 90)]
    plain = greedy_with_logprobs(LLM(str(source), **ENGINE), prompts, 24)
    assert (
        top5_rule("Q8_0", plain, greedy_with_logprobs(shipped, prompts, 24), QUANTIZED_TOP_GAP)
        <= QUANTIZED_LOGPROB_TOL["float32"]
    )


@pytest.mark.parametrize(
    ("arch", "quant"), [("qwen3_5", "Q4_1"), ("qwen3_5_moe", "Q8_0"), ("qwen3_5_moe", "Q4_1")]
)
def test_quantized_files_compute_with_their_quantized_values(tmp_path: Path, arch: str, quant: str):
    """Served as they ship against the float engine on the same file dequantized (quantization none), as
    tests/test_quantization.py holds SmolLM2's Q4_1: teacher-forced logits within 1e-4, or within twice the
    spread of two correct float32 engines on those weights where the hybrid amplifies rounding
    (tests/test_qwen3_5.py's rule for int8/int4). Not the top-5 rule against float32: Q4_1's 16 levels on
    these random Gaussian weights are not held to it, as int4's are not on Qwen3 (its argmax within float32's
    top-5 at 74% of a prompt's positions dense, 64% MoE: the engine's own int4 gives 76% and 69%), and on the
    MoE Q8_0's rounding moves the random routers' near-ties to other experts (its first token leaves float32's
    top-5 on one prompt), as int8's does with top-1 routing (docs/models.md)."""
    source = _source(tmp_path, arch, **BLOCK_ALIGNED)
    path = write_gguf(source, tmp_path / "model.gguf", quant, fuse_gate_up=quant == "Q8_0")
    shipped = _load(path, tmp_path, exact_quantized_matmuls=True)  # x in float32, as the float engine's
    packed = [m for m in shipped.engine.runner.model.modules() if isinstance(m, PackedWeight)]
    assert len(packed) == (2 + 4 * 4 if arch == "qwen3_5" else 2 + 4 * (2 + 2 * 8 + 2))
    references = [_load(path, tmp_path, quantization="none", attention_backend=b) for b in ("auto", "torch")]
    prompts = PROMPTS[1:]
    for chunk in (1000, 1):
        logits = [teacher_forced_logits(llm, prompts, chunk) for llm in (shipped, *references)]
        for index, (ours, ref, other) in enumerate(zip(*logits)):
            error, spread = (ours - ref).abs().max().item(), (ref - other).abs().max().item()
            assert error <= max(1e-4, 2 * spread), f"chunk {chunk} prompt {index}: {error:.2e} ({spread:.2e})"


def test_qwen35s_pre_tokenizer_keeps_combining_marks_in_their_word(tmp_path: Path):
    """A file naming "qwen35" (Qwen3.5's vocabulary) gets Qwen3.5's split, built here: a combining mark
    stays with its letters, where Qwen2's split starts a punctuation run with it."""
    source = build_model("qwen3_5", tmp_path / "hf", num_layers=4, seed=5)
    text = "cafe\u0301! ok"
    splits = {}
    for pre in ("qwen35", "qwen2"):
        bare = prepare_gguf(
            write_gguf(source, tmp_path / f"{pre}.gguf", pre=pre), tmp_path / pre, weights=False
        )
        pre_tokenizer = load_tokenizer(bare).backend_tokenizer.pre_tokenizer
        splits[pre] = [span for _, span in pre_tokenizer.pre_tokenize_str(text)]
    assert splits == {"qwen35": [(0, 5), (5, 6), (6, 9)], "qwen2": [(0, 4), (4, 6), (6, 9)]}


def test_the_layer_kinds_and_what_it_cannot_serve_come_from_the_metadata(tmp_path: Path):
    """Newer llama.cpp may name each layer's kind (attention.recurrent_layers) instead of the interval;
    metadata that cannot describe the model fails at start naming the key."""
    path = write_gguf(_source(tmp_path, "qwen3_5"), tmp_path / "model.gguf")
    reader = open_reader(path)
    metadata, names = read_metadata(reader), [t.name for t in reader.tensors]
    flags = [True, False, True, True]  # linear, full, linear, linear
    config = hf_config({**metadata, "qwen35.attention.recurrent_layers": flags}, names)
    assert config["layer_types"] == [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
    ]
    cases = {
        "qwen35.ssm.inner_size": (62, ["inner_size=62", "time_step_rank=4"]),
        "qwen35.ssm.group_count": (None, ["qwen35.ssm.group_count"]),
        "qwen35.nextn_predict_layers": (4, ["nextn_predict_layers", "block_count=4"]),
        "qwen35.attention.recurrent_layers": ([True, False], ["2 flags", "4 layers"]),
    }
    for key, (value, words) in cases.items():
        changed = {k: v for k, v in metadata.items() if k != key} | (
            {key: value} if value is not None else {}
        )
        with pytest.raises(UnsupportedModelError) as failure:
            hf_config(changed, names)
        assert all(word in str(failure.value) for word in words), (key, str(failure.value))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_the_files_mtp_block_proposes_as_the_checkpoints_head(tmp_path: Path, arch: str):
    """A checkpoint with its multi-token prediction head, written as the converter writes it (mtp.layers.0
    as the block after the layers, fc and the head's norms as nextn tensors, every norm 1 + w): with
    speculative_method=mtp the file's head proposes what the checkpoint's head proposes (float32: the same
    weights; the file's A_log to float32 rounding), the tokens are the checkpoint's without speculation, and
    a file without the block is refused naming it."""
    source = build_model(arch, tmp_path / "hf", num_layers=4, seed=5, max_position=512, mtp=True)
    path = write_gguf(source, tmp_path / "model.gguf", mtp=True, fuse_gate_up=arch == "qwen3_5_moe")
    mtp = {"speculative_method": "mtp", "num_speculative_tokens": 3, "speculative_max_batch": 8}

    def run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
        proposals = recorded_proposals(llm)
        outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
        return [o["token_ids"] for o in outs], proposals

    from_file, from_checkpoint = run(_load(path, tmp_path, **mtp)), run(LLM(str(source), **ENGINE, **mtp))
    assert from_file == from_checkpoint and from_file[1]
    assert from_file[0] == [hf_greedy(source, prompt, MAX_NEW) for prompt in PROMPTS]
    without = write_gguf(
        build_model(arch, tmp_path / "plain", num_layers=4, seed=5, max_position=512), tmp_path / "plain.gguf"
    )
    with pytest.raises(ConfigError, match="holds no block after its 4 layers with nextn tensors"):
        _load(without, tmp_path, **mtp)
