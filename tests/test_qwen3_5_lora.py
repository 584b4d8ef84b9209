"""LoRA on Qwen3.5's hybrid (worker/models/qwen3_5.py's lora_projections): adapters made with PEFT on every
linear layer it reaches (attention's q/k/v/o, the linear layers' in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a and out_proj, the dense MLP's gate/up/down; the MoE's experts are not adapted) against
transformers + PEFT in float32; a batch mixing adapters and the base equal to each request alone; two
tensor-parallel ranks equal to one; prefix-cache hits (state snapshots included) kept apart per adapter."""

from __future__ import annotations

import random
from pathlib import Path

import psutil
import pytest

from nanovllm import LLM
from tests.helpers import TP_ENGINE, TP_PROMPTS, greedy, rank_processes
from tests.model_factory import ALL_LORA_TARGETS, build_model, make_adapter
from tests.test_lora import peft_greedy, peft_model, prompts

LINEAR_ATTENTION = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ENGINE = {"max_model_len": 256, "kv_cache_memory": "16MiB", "max_lora_rank": 8, "dtype": "float32"}
MAX_NEW = 16


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """Per model (dense, MoE): the base model and its adapters, every layer kind and a subset."""
    root = tmp_path_factory.mktemp("hybrid-lora")
    out = {}
    for arch, everything in (
        ("qwen3_5", ALL_LORA_TARGETS + LINEAR_ATTENTION),
        ("qwen3_5_moe", ATTENTION + LINEAR_ATTENTION),
    ):
        base = build_model(arch, root / arch, num_layers=4, seed=3, tokenizer=False)
        out[arch] = (
            base,
            {
                "all": make_adapter(base, root / arch / "all", 8, everything, seed=10),
                "linear": make_adapter(base, root / arch / "linear", 4, ["in_proj_z", "out_proj"], seed=11),
            },
        )
    return out


def _engine(base: Path, adapters: dict[str, Path], **options) -> LLM:
    return LLM(str(base), lora_adapters=[f"{n}={p}" for n, p in adapters.items()], **{**ENGINE, **options})


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_tokens_equal_peft(hybrids, arch: str):
    """Each adapter: greedy tokens equal transformers + PEFT's, and differ from the base model's."""
    base, adapters = hybrids[arch]
    llm = _engine(base, adapters)
    batch = prompts(1, 3)
    base_tokens = [o["token_ids"] for o in llm.generate(batch, greedy(MAX_NEW), use_tqdm=False)]
    for name, directory in adapters.items():
        ours = [o["token_ids"] for o in llm.generate(batch, greedy(MAX_NEW), use_tqdm=False, lora_name=name)]
        reference = peft_model(base, directory)
        assert ours == [peft_greedy(reference, p, MAX_NEW) for p in batch], name
        assert ours != base_tokens, f"{name} does not change the greedy tokens: the test would prove nothing"


def test_a_mixed_batch_equals_each_request_alone_and_hits_stay_per_adapter(hybrids):
    """Both adapters and the base in one batch with chunked prefill; each request alone on an engine
    without a prefix cache gives the same tokens. A prompt repeated under another adapter never hits the
    first one's blocks or state snapshots; repeated under the same adapter, it does."""
    base, adapters = hybrids["qwen3_5"]
    rng = random.Random(4)
    batch = [[rng.randrange(2, 500) for _ in range(n)] for n in (50, 80, 43, 61, 35, 90)]
    names = [None, "all", "linear"] * 2
    llm = _engine(base, adapters, max_num_batched_tokens=32, state_snapshot_interval=32)
    mixed = llm.generate(batch, greedy(MAX_NEW), use_tqdm=False, lora_name=names)
    alone = _engine(base, adapters, enable_prefix_caching=False)
    for prompt, name, out in zip(batch, names, mixed):
        expected = alone.generate([prompt], greedy(MAX_NEW), use_tqdm=False, lora_name=name)[0]["token_ids"]
        assert out["token_ids"] == expected, name
    shared = batch[1][:64] + [7, 8, 9]  # 64 tokens of a prompt that ran under "all" (snapshot at 32, 64)
    other = llm.generate([shared], greedy(4), use_tqdm=False, lora_name="linear")[0]
    same = llm.generate([shared], greedy(4), use_tqdm=False, lora_name="all")[0]
    assert other["num_cached_tokens"] == 0 and same["num_cached_tokens"] == 64
    assert (
        other["token_ids"]
        == alone.generate([shared], greedy(4), use_tqdm=False, lora_name="linear")[0]["token_ids"]
    )


def test_tp2_equals_tp1(hybrids):
    """The linear layers' in_proj_qkv adapter split as its weights are (each rank its heads' q, k and v
    rows of B), out_proj's A by columns: TP=2's greedy tokens equal TP=1's, the base mixed in."""
    base, adapters = hybrids["qwen3_5"]
    names = [None, "all", "linear", "all", None]
    runs = []
    for size in (1, 2):
        llm = _engine(base, adapters, tensor_parallel_size=size, **{**TP_ENGINE, "dtype": "float32"})
        try:
            outputs = llm.generate(TP_PROMPTS, greedy(MAX_NEW), use_tqdm=False, lora_name=names)
            runs.append([o["token_ids"] for o in outputs])
        finally:
            llm.shutdown()
    assert runs[1] == runs[0]
    assert rank_processes(psutil.Process()) == []
