"""GGUF files of the Qwen architectures (qwen2, qwen3, qwen3moe), written at test time as llama.cpp's
converter writes them (tests/model_factory.py write_gguf, which transformers' own GGUF reader reads back
as the source checkpoint: a test below). Served from F32 they equal transformers on the source checkpoint:
greedy tokens, logits within 1e-4 in prefill and decode, YaRN past twice its original context. A Q8_0
Qwen3-MoE file serves every expert as it ships, equal to the same file dequantized. Files it cannot serve
fail at start naming why."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nanovllm import LLM
from nanovllm.common.errors import UnsupportedModelError
from nanovllm.worker.layers.quantization import PackedWeight
from nanovllm.worker.llm import load_tokenizer
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf import cache as gguf_cache
from nanovllm.worker.models.gguf import layout
from nanovllm.worker.models.gguf.cache import prepare_gguf
from nanovllm.worker.models.gguf.tokenizer import transformers_tokenizer
from tests.helpers import (
    TEXTS,
    TEXTS_WITH_DIGITS,
    greedy,
    hf_greedy,
    hf_logits,
    hf_model,
    teacher_forced_logits,
)
from tests.model_factory import build_model, write_gguf

ORIGINAL = 64  # the YaRN case's original context: the longest prompt runs past twice that
CASES = {  # name: (architecture, config overrides, rope_parameters)
    "qwen2": ("qwen2", {}, None),
    "qwen3-yarn": (
        "qwen3",
        {},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "qwen3-moe": ("qwen3_moe", {"norm_topk_prob": True}, None),  # llama.cpp's qwen3moe always renormalises
}
MAX_NEW = 16
_rng = random.Random(12)
PROMPTS = [[_rng.randrange(2, 512) for _ in range(n)] for n in (3, 40, 150)]
ENGINE = {"max_model_len": 512, "kv_cache_memory": "16MiB"}


def _load(path: Path, root: Path, **kwargs) -> LLM:
    """The engine on a .gguf file, its conversion cached under `root` rather than the user's cache (the
    conversion is real; only where it goes changes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_cache, "default_cache_root", lambda: root / "gguf-cache")
        return LLM(str(path), **ENGINE, **kwargs)


@pytest.fixture(scope="module", params=sorted(CASES))
def source(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides, rope = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    return build_model(arch, root / "hf", seed=6, max_position=512, rope=rope, overrides=overrides)


def test_an_f32_file_serves_the_checkpoints_tokens_and_logits(source: Path, tmp_path: Path):
    llm = _load(write_gguf(source, tmp_path / "model.gguf"), tmp_path, dtype="float32")
    ours, theirs = llm.config.model_config, ModelConfig.from_pretrained_dir(source)
    assert ours == theirs  # architecture, shape, experts, RoPE scaling: the file's metadata says it all
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out["token_ids"] == hf_greedy(source, prompt, MAX_NEW)
    for chunk in (1000, 1):  # prefill, decode
        for prompt, logits in zip(PROMPTS, teacher_forced_logits(llm, PROMPTS, chunk)):
            torch.testing.assert_close(logits.cpu(), hf_logits(source, prompt), atol=1e-4, rtol=0)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_transformers_reads_the_written_files_as_their_checkpoint(tmp_path: Path, arch: str):
    """The writer's conventions (names, the experts' 3-D layout, metadata) checked against transformers'
    GGUF reader, an implementation independent of this project's. Its qwen3 mapping lacks head_dim and its
    qwen3_moe mapping the experts' width, so these models take transformers' defaults for them (128, 768)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    overrides = {
        "head_dim": 128,
        **({"moe_intermediate_size": 768, "norm_topk_prob": True} if "moe" in arch else {}),
    }
    source = build_model(arch, tmp_path / "hf", seed=7, hidden=128, heads=2, kv_heads=1, overrides=overrides)
    path = write_gguf(source, tmp_path / "model.gguf")
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name), dtype=torch.float32
    )
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert model.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([PROMPTS[1]])).logits
    torch.testing.assert_close(logits, hf_model(source)(torch.tensor([PROMPTS[1]])).logits, atol=0, rtol=0)


def test_a_q8_0_mixture_of_experts_file_serves_its_experts_as_they_ship(tmp_path: Path):
    """Every projection Q8_0 (the 8 experts' gate, up and down of both layers in 3-D tensors): each expert
    a PackedWeight over its own blocks, and float32 logits within 1e-4 of the same file dequantized
    (quantization=none), as tests/test_quantization.py holds SmolLM2's Q4_1."""
    source = build_model("qwen3_moe", tmp_path / "hf", seed=8, overrides={"norm_topk_prob": True})
    path = write_gguf(source, tmp_path / "model.gguf", "Q8_0")
    shipped = _load(path, tmp_path, dtype="float32")
    packed = [n for n, m in shipped.engine.runner.model.named_modules() if isinstance(m, PackedWeight)]
    experts = [n for n in packed if ".experts." in n]
    assert len(experts) == 2 * 8 * 2, packed  # layers x experts x (w13, w2)
    plain = _load(path, tmp_path, dtype="float32", quantization="none")
    for chunk in (1000, 1):
        for ours, ref in zip(
            teacher_forced_logits(shipped, PROMPTS, chunk), teacher_forced_logits(plain, PROMPTS, chunk)
        ):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_a_file_of_other_types_serves_them_dequantized_by_default(tmp_path: Path):
    """Every projection Q5_0, a type not served as it ships (as the K-quants of most published files): with
    quantization auto they load dequantized, straight from the file (the converted directory holds no
    weights), with logits within 1e-4 of transformers on the float32 directory the file converts into
    with weights; quantization=none reads the same file the same way and computes the same logits."""
    source = build_model("qwen3", tmp_path / "hf", seed=10)
    path = write_gguf(source, tmp_path / "model.gguf", "Q5_0")
    auto = _load(path, tmp_path, dtype="float32")
    assert not any(isinstance(m, PackedWeight) for m in auto.engine.runner.model.modules())
    assert not list(Path(auto.config.model).glob("*.safetensors"))
    converted = prepare_gguf(path, tmp_path / "with-weights", weights=True)
    logits = teacher_forced_logits(auto, PROMPTS, 1000)
    for prompt, ours in zip(PROMPTS, logits):
        torch.testing.assert_close(ours.cpu(), hf_logits(converted, prompt), atol=1e-4, rtol=0)
    # deterministic as auto chose it for the file (off for GGUF weights): the same kernels on both
    plain = _load(
        path, tmp_path, dtype="float32", quantization="none", deterministic=auto.config.deterministic
    )
    assert not list(Path(plain.config.model).glob("*.safetensors"))
    for ours, ref in zip(logits, teacher_forced_logits(plain, PROMPTS, 1000)):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_qwens_pre_tokenizer_splits_as_transformers_does(tmp_path: Path):
    """A file naming Qwen's pre-tokenizer ("qwen2", as every Qwen2/Qwen3 GGUF does) gets its tokenizer
    built here (worker/models/gguf/tokenizer.py), not by transformers' slower conversion, and tokenizes
    as transformers' conversion of the same file does, digits, line breaks and non-Latin scripts included."""
    source = build_model("qwen3", tmp_path / "hf", seed=11, tokenizer=True)
    path = write_gguf(source, tmp_path / "model.gguf", pre="qwen2")
    bare = prepare_gguf(path, tmp_path / "cache", weights=False)
    ours, theirs = load_tokenizer(bare), transformers_tokenizer(path)
    assert type(ours.backend_tokenizer.pre_tokenizer).__name__ == "Sequence"
    # (Texts with "<|...|>" left out: transformers' Qwen conversion adds <|endoftext|> to a vocabulary that,
    # being this test's, lacks it.)
    for text in [t for t in [*TEXTS, *TEXTS_WITH_DIGITS] if "<|" not in t]:
        assert ours.encode(text) == theirs.encode(text), text


def test_the_cache_keeps_only_directories_a_file_still_reaches(tmp_path: Path):
    """A conversion deletes the cached directories of its file's earlier versions and of files that are
    gone; a directory without a source record is left alone, as is every other file's."""
    import os
    import shutil

    source = build_model("qwen3", tmp_path / "hf", seed=12)
    first, second = write_gguf(source, tmp_path / "a.gguf"), write_gguf(source, tmp_path / "b.gguf")
    moved = tmp_path / "c.gguf"
    shutil.copy(first, moved)
    root = tmp_path / "cache"
    unrecorded = root / "converted-before-records"
    unrecorded.mkdir(parents=True)
    a1, b, _ = (prepare_gguf(path, root, weights=False) for path in (first, second, moved))
    moved.unlink()
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))  # a new version
    a2 = prepare_gguf(first, root, weights=False)
    assert a2 != a1
    assert sorted(p.name for p in root.iterdir()) == sorted([a2.name, b.name, unrecorded.name])


def _rewrite(path: Path, out: Path, drop: str = "", **fields) -> Path:
    """A copy of GGUF file `path` without tensors whose names contain `drop`, metadata changed by
    `fields` (key: value; None removes it)."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), fields.pop("general.architecture", arch))
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "general.architecture")) or name in fields:
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    for name, value in fields.items():
        if value is not None:
            writer.add_key_value(name, value, gguf.GGUFValueType.UINT32)
    for tensor in reader.tensors:
        if not drop or drop not in tensor.name:
            data = np.array(tensor.data)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_files_it_cannot_serve_fail_at_start_naming_why(tmp_path: Path):
    source = build_model("qwen3_moe", tmp_path / "hf", seed=9, overrides={"norm_topk_prob": True})
    path = write_gguf(source, tmp_path / "model.gguf")
    cases = {
        "shared experts": (
            _rewrite(path, tmp_path / "shared.gguf", **{"qwen3moe.expert_shared_count": 2}),
            ["expert_shared_count=2", "shared experts"],
        ),
        "a dense layer": (
            _rewrite(path, tmp_path / "dense.gguf", drop="blk.1.ffn_"),
            ["layers [1]", "no experts"],
        ),
        "no expert width": (
            _rewrite(path, tmp_path / "width.gguf", **{"qwen3moe.expert_feed_forward_length": None}),
            ["qwen3moe.expert_feed_forward_length"],
        ),
        "another architecture": (
            _rewrite(path, tmp_path / "gemma.gguf", **{"general.architecture": "gemma3"}),
            ["'gemma3'", "llama, qwen2, qwen3, qwen3moe"],
        ),
    }
    for case, (bad, words) in cases.items():
        with pytest.raises(UnsupportedModelError) as failure:
            _load(bad, tmp_path, dtype="float32")
        assert all(word in str(failure.value) for word in words), (case, str(failure.value))


def test_a_file_is_parsed_once_per_version(tmp_path: Path):
    """Building a GGUFReader parses every metadata field in Python (seconds for a real vocabulary), so
    open_reader keeps the last one: converting a file and loading it with its packed weights parse it once;
    a rewritten file (another size, here another type) is parsed anew and its reader reads the new file."""
    path = write_gguf(build_model("qwen3", tmp_path / "hf", seed=7), tmp_path / "model.gguf", "Q8_0")
    before = layout._reader.cache_info().misses
    llm = _load(path, tmp_path, dtype="float32")
    assert layout._reader.cache_info().misses - before == 1
    assert any(isinstance(p, PackedWeight) for p in llm.engine.runner.model.modules())  # the packed path ran
    packed = layout.open_reader(path)
    assert {t.tensor_type.name for t in packed.tensors} >= {"Q8_0"}
    write_gguf(tmp_path / "hf", path, "F32")
    rewritten = layout.open_reader(path)
    assert rewritten is not packed and layout.open_reader(path) is rewritten
    assert "Q8_0" not in {t.tensor_type.name for t in rewritten.tensors}
