"""--deterministic: in bfloat16 and float16 a request's tokens and logprobs are bit-identical whatever the
engine does around it: the batch it runs in, how its prompt is chunked, a prefix-cache hit, preemption,
n-gram or draft speculation, a JSON-schema constraint. Each case is compared with `==` (floats exactly)
against the request run alone on an engine of its own.

Without the flag none of this holds in 16-bit (tests/test_batch_invariance.py is float32 only): PyTorch's
GEMM and SDPA sum in an order that depends on how many rows they get, and one rounding apart in bf16
soon means another logprob, then another token. The kernels that make it hold are in
worker/layers/linear.py and kernels/backends.py; the Triton ones are tested here too, in the interpreter."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.worker.config import ModelConfig
from nanovllm.worker.runner.kv_cache import kv_bytes_per_block
from tests.model_factory import build_model

DTYPES = ("bfloat16", "float16")
ARCHS = ("qwen3", "llama", "qwen2")
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=17, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2
)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}
CONSTRAINED = SamplingParams(
    temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, json_schema=json.dumps(SCHEMA)
)


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def _target_prompt() -> list[int]:
    """90 tokens (more than one 64-token chunk), whose middle repeats its start so that n-gram speculation
    has something to propose."""
    rng = random.Random(5)
    head = _random_prompt(rng, 40)
    return head + head[:25] + _random_prompt(rng, 25)


TARGET = _target_prompt()


def _others(n: int, seed: int = 11) -> tuple[list[list[int]], list[SamplingParams]]:
    """n other requests of 1 to 119 prompt tokens, greedy or seeded, of varied lengths."""
    rng = random.Random(seed)
    prompts = [_random_prompt(rng, rng.randrange(1, 120)) for _ in range(n)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40))
        if i % 2
        else SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randrange(1, 40))
        for i in range(n)
    ]
    return prompts, params


@dataclass
class Case:
    model: Path
    dtype: str
    alone: list[dict]  # GREEDY, SEEDED and CONSTRAINED on TARGET, each alone

    def llm(self, **options) -> LLM:
        defaults = {"max_model_len": 256, "kv_cache_memory": "16MiB", "deterministic": True}
        return LLM(str(self.model), dtype=self.dtype, **{**defaults, **options})


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block back
    return outs


def _assert_identical(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    assert got["logprobs"] == want["logprobs"]  # chosen and top-2 logprobs, compared as floats: bit for bit
    assert got["finish_reason"] == want["finish_reason"]


@pytest.fixture(scope="module", params=[(a, d) for a in ARCHS for d in DTYPES], ids=lambda p: "-".join(p))
def case(request, model_dirs, kernels) -> Case:
    arch, dtype = request.param
    case = Case(model_dirs[arch], dtype, [])
    llm = case.llm(enable_prefix_caching=False)
    case.alone = [_generate(llm, [TARGET], [p])[0] for p in (GREEDY, SEEDED, CONSTRAINED)]
    return case


def test_the_batch_does_not_change_the_request(case: Case):
    """The target, greedy and seeded, among 0 to 62 others of every length, on one engine."""
    llm = case.llm(enable_prefix_caching=False)
    for size in (2, 8, 64):
        prompts, params = _others(size - 2, seed=size)
        at = len(prompts) // 2
        prompts[at:at] = [TARGET, TARGET]
        params[at:at] = [GREEDY, SEEDED]
        outs = _generate(llm, prompts, params)
        _assert_identical(outs[at], case.alone[0])
        _assert_identical(outs[at + 1], case.alone[1])


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_does_not_change_the_request(case: Case, chunk: int):
    """Its prompt split into chunks of `chunk` tokens (the step's token budget), beside two others."""
    llm = case.llm(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    prompts, params = _others(2)
    outs = _generate(llm, [prompts[0], TARGET, prompts[1], TARGET], [params[0], GREEDY, params[1], SEEDED])
    _assert_identical(outs[1], case.alone[0])
    _assert_identical(outs[3], case.alone[1])


def test_a_prefix_cache_hit_does_not_change_the_request(case: Case):
    """Half its prompt (three 16-token blocks) computed for another request first, then taken from the cache."""
    llm = case.llm()
    _generate(llm, [TARGET[:48] + _random_prompt(random.Random(3), 30)], [GREEDY])
    outs = _generate(llm, [TARGET, TARGET], [GREEDY, SEEDED])
    assert outs[0]["num_cached_tokens"] == 48
    _assert_identical(outs[0], case.alone[0])
    _assert_identical(outs[1], case.alone[1])


def test_preemption_does_not_change_the_request(case: Case):
    """A KV cache of 40 four-token blocks (one sequence of 128 tokens fits, eight do not): requests are
    preempted and recomputed."""
    shape = ModelConfig.from_pretrained_dir(case.model)
    per_block = kv_bytes_per_block(
        shape, 4, shape.num_key_value_heads, torch.finfo(getattr(torch, case.dtype)).bits // 8
    )
    llm = case.llm(
        max_model_len=128, kvcache_block_size=4, kv_cache_memory=40 * per_block, max_num_batched_tokens=64
    )
    prompts, params = _others(6)
    prompts = [p[:60] for p in prompts]
    outs = _generate(
        llm, [*prompts[:3], TARGET, *prompts[3:], TARGET], [*params[:3], GREEDY, *params[3:], SEEDED]
    )
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_identical(outs[3], case.alone[0])
    _assert_identical(outs[-1], case.alone[1])


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random draft with the test models' vocabulary (1 layer, hidden 32): it seldom guesses right, so
    most proposals are rejected, and some are taken."""
    root = tmp_path_factory.mktemp("draft")
    return build_model("qwen3", root / "qwen3", seed=7, num_layers=1, hidden=32, heads=2, kv_heads=1)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_does_not_change_the_request(case: Case, draft_dir: Path, method: str):
    options = {"speculative_method": method, "num_speculative_tokens": 4}
    if method == "draft":
        options["speculative_model"] = str(draft_dir)
    llm = case.llm(**options)
    proposed = 0
    step = llm.engine.step

    def counting_step():
        nonlocal proposed
        result = step()
        proposed += result.stats.num_spec_proposed
        return result

    llm.engine.step = counting_step
    outs = _generate(llm, [TARGET, TARGET], [GREEDY, SEEDED])
    assert proposed > 0
    _assert_identical(outs[0], case.alone[0])
    _assert_identical(outs[1], case.alone[1])


def test_a_json_schema_constraint_holds_and_the_request_does_not_change(case: Case):
    """Constrained, it is the same alone as in a batch of 8 with its prompt in 7-token chunks."""
    llm = case.llm(max_num_batched_tokens=7)
    prompts, params = _others(7)
    outs = _generate(llm, [*prompts[:4], TARGET, *prompts[4:]], [*params[:4], CONSTRAINED, *params[4:]])
    _assert_identical(outs[4], case.alone[2])
    assert outs[4]["text"].startswith("{")
