"""Checkpoint loading: sharded safetensors, tied embeddings, and clear errors for mismatches."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from nanovllm import LLM
from nanovllm.common.errors import ConfigError
from tests.helpers import greedy
from tests.model_factory import build_model


def test_sharded_checkpoint_loads_like_single_file(tmp_path, model_dirs):
    sharded = build_model("qwen3", tmp_path / "sharded", seed=1, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 3
    prompt = [[3, 4, 5, 6, 7]]
    single = LLM(str(model_dirs["qwen3"]), max_model_len=64, kv_cache_memory="4MiB")
    split = LLM(str(sharded), max_model_len=64, kv_cache_memory="4MiB")
    assert split.generate(prompt, greedy(8), use_tqdm=False) == single.generate(
        prompt, greedy(8), use_tqdm=False
    )


def test_tokenizer_round_trip_and_tqdm(model_dirs, capsys):
    llm = LLM(str(model_dirs["llama"]), max_model_len=64, kv_cache_memory="4MiB")
    out = llm.generate("The quick brown fox", greedy(6), use_tqdm=True)[0]
    assert out["token_ids"] and out["text"] == llm.tokenizer.decode(
        out["token_ids"], skip_special_tokens=True
    )
    assert "tok/s" in capsys.readouterr().err


def _tamper(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path, model_dirs):
    bad = tmp_path / "missing"
    _tamper(model_dirs["qwen3"], bad, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ConfigError, match="lacks 1 parameters.*layers.1.mlp.down_proj"):
        LLM(str(bad), max_model_len=64, kv_cache_memory="4MiB")


def test_unexpected_tensor_is_named(tmp_path, model_dirs):
    bad = tmp_path / "extra"
    _tamper(
        model_dirs["qwen3"],
        bad,
        lambda t: t.update({"model.vision_tower.weight": t["model.norm.weight"].clone()}),
    )
    with pytest.raises(ConfigError, match="vision_tower.weight"):
        LLM(str(bad), max_model_len=64, kv_cache_memory="4MiB")
