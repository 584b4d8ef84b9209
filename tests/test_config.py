"""Configuration parsing: memory sizes, model configs in their several spellings, clear errors."""

from __future__ import annotations

import json

import pytest

from nanovllm.common.errors import ConfigError, InvalidStateTransition, UnsupportedModelError
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.config import parse_memory_size
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.sequence import Sequence, SequenceStatus

GiB = 2**30


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2GiB", 2 * GiB),
        ("512MB", 512 * 10**6),
        ("1.5 gib", int(1.5 * GiB)),
        (4096, 4096),
        (0.25, GiB),
        ("0.5", 2 * GiB),
    ],
)
def test_parse_memory_size(value, expected):
    assert parse_memory_size(value, available_bytes=4 * GiB) == expected


@pytest.mark.parametrize("value", ["lots", "2 parsecs", -5, 0, True])
def test_parse_memory_size_rejects(value):
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        parse_memory_size(value, available_bytes=GiB)


def _hf(**overrides):
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "eos_token_id": 3,
    }
    cfg.update(overrides)
    return cfg


def test_rope_theta_in_either_spelling():
    assert ModelConfig.from_hf_dict(_hf(rope_theta=5e5)).rope_theta == 5e5
    nested = _hf(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert ModelConfig.from_hf_dict(nested).rope_theta == 1e6
    assert ModelConfig.from_hf_dict(_hf()).rope_theta == 10000.0


def test_architecture_specs():
    qwen3 = ModelConfig.from_hf_dict(_hf())
    assert qwen3.spec.qk_norm and not qwen3.spec.qkv_bias and qwen3.head_dim == 16
    qwen2 = ModelConfig.from_hf_dict(_hf(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.spec.qkv_bias and not qwen2.spec.o_bias
    llama = ModelConfig.from_hf_dict(
        _hf(architectures=["LlamaForCausalLM"], attention_bias=True, head_dim=32)
    )
    assert llama.spec.qkv_bias and llama.spec.o_bias and llama.head_dim == 32


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "yarn"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_unsupported_models_are_named(overrides, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict(_hf(**overrides))


def test_generation_config_eos_ids_are_merged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf(eos_token_id=3)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    assert ModelConfig.from_pretrained_dir(tmp_path).eos_token_ids == (3, 7)


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_pretrained_dir(tmp_path)


def test_sequence_transitions_are_checked():
    seq = Sequence(0, "r", [1, 2], SamplingParams())
    seq.transition(SequenceStatus.RUNNING)
    seq.transition(SequenceStatus.WAITING)  # preempted
    seq.transition(SequenceStatus.RUNNING)
    seq.transition(SequenceStatus.FINISHED_LENGTH)
    with pytest.raises(InvalidStateTransition, match="FINISHED_LENGTH -> RUNNING"):
        seq.transition(SequenceStatus.RUNNING)
    fresh = Sequence(1, "s", [1], SamplingParams())
    with pytest.raises(InvalidStateTransition, match="WAITING -> FINISHED_STOPPED"):
        fresh.transition(SequenceStatus.FINISHED_STOPPED)
