"""Speculative decoding (worker/sample/speculation.py and draft.py, Scheduler.update_from_output): proposals
verified in one forward pass never change a request's tokens. Every request of a mixed batch produces exactly
the tokens, and logprobs within 1e-4, that it produces without speculation, in float32."""

from __future__ import annotations

import collections
import json
import random

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import ConfigError
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.sample.speculation import propose_ngram
from tests.helpers import counting_proposals, two_sample_chi_square
from tests.model_factory import build_model
from tests.services import start_router, start_worker, wait_serving

F32 = {"dtype": "float32", "max_model_len": 256}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory):
    """A small random draft (1 layer, hidden 32, one kv head) with the test models' vocabulary: it rarely
    guesses right, so it tests shapes and bookkeeping, not acceptance."""
    return build_model(
        "qwen3",
        tmp_path_factory.mktemp("draft") / "qwen3",
        seed=7,
        num_layers=1,
        hidden=32,
        heads=2,
        kv_heads=1,
    )


def test_propose_ngram():
    # The suffix [1, 2] occurred at 0 and at 4; the latest occurrence wins.
    assert propose_ngram([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 2) == [4, 5]
    assert propose_ngram([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 9) == [4, 5, 1, 2]
    # The longest suffix that occurs is used: [7, 1] is nowhere earlier, [1] is.
    assert propose_ngram([1, 8, 7, 1], 3) == [8, 7, 1]
    assert propose_ngram([1, 2, 3], 4) == []
    assert propose_ngram([5], 4) == []
    assert propose_ngram([4, 4, 4], 2) == [4]


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that repeat themselves (so proposals get accepted) and one that does not; greedy, seeded
    sampling with every filter and penalty, min_tokens with stop ids, logprobs."""
    rng = random.Random(0)
    base = [rng.randrange(2, 60) for _ in range(40)]
    prompts = [
        base + base[:10],
        [5, 6, 7] * 10,
        [rng.randrange(2, 500) for _ in range(30)],
        base[5:] + base[:20],
        [9, 10, 11, 12] * 6,
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=3, max_tokens=33, logprobs=2),
        SamplingParams(
            temperature=1.0,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.2,
            seed=5,
            max_tokens=25,
            min_tokens=20,
            stop_token_ids=[7, 8],
        ),
        SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[7]),
        SamplingParams(temperature=0.5, seed=11, max_tokens=30, ignore_eos=True),
    ]
    return prompts, params


def _run(llm: LLM, prompts, params) -> tuple[list[dict], int, int]:
    """Outputs of LLM.generate, and the proposed and accepted tokens of the steps it ran."""
    with counting_proposals(llm) as counts:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return outs, *counts


def _assert_same(spec_outs: list[dict], plain_outs: list[dict]) -> None:
    for i, (spec, plain) in enumerate(zip(spec_outs, plain_outs)):
        assert spec["token_ids"] == plain["token_ids"], i
        assert spec["finish_reason"] == plain["finish_reason"], i
        assert len(spec["logprobs"]) == len(plain["logprobs"]), i
        for a, b in zip(spec["logprobs"], plain["logprobs"]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_ngram_changes_no_token(model_dirs, arch):
    """And again on the same engine, the prompts now hitting the prefix cache."""
    prompts, params = _requests()
    kwargs = {**F32, "kv_cache_memory": "8MiB"}
    plain, _, _ = _run(LLM(str(model_dirs[arch]), **kwargs), prompts, params)
    spec_llm = LLM(str(model_dirs[arch]), speculative_method="ngram", num_speculative_tokens=4, **kwargs)
    spec, proposed, accepted = _run(spec_llm, prompts, params)
    _assert_same(spec, plain)
    assert proposed > 0 and accepted > 0, (proposed, accepted)
    again, _, _ = _run(spec_llm, prompts, params)  # the prompts' full blocks now come from the prefix cache
    _assert_same(again, plain)
    assert sum(o["num_cached_tokens"] for o in again) > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_under_chunked_prefill_and_preemption(qwen3_dir, method):
    """A step budget of 24 tokens (prompts chunked, proposals cut to the budget) and a KV cache small
    enough to preempt, the batch run twice on one engine. The draft is the model itself: each block then
    holds twice the KV, so the cache gets twice the bytes for the same 40 blocks."""
    prompts, params = _requests()
    kwargs = {
        "dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 24, "kvcache_block_size": 4,
        "kv_cache_memory": 40 * 2048,
    }  # fmt: skip
    plain_llm = LLM(str(qwen3_dir), **kwargs)
    plain, _, _ = _run(plain_llm, prompts, params)
    if method == "draft":
        kwargs = {**kwargs, "speculative_model": str(qwen3_dir), "kv_cache_memory": 40 * 4096}
    spec_llm = LLM(str(qwen3_dir), speculative_method=method, num_speculative_tokens=6, **kwargs)
    first, proposed, accepted = _run(spec_llm, prompts, params)
    second, _, _ = _run(spec_llm, prompts, params)
    _assert_same(first, plain)
    _assert_same(second, plain)
    assert accepted > 0, (proposed, accepted)
    assert spec_llm.engine.scheduler.num_preemptions > 0
    assert spec_llm.engine.runner.num_blocks == 40


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_draft_model_changes_no_token(model_dirs, draft_dir, arch):
    """A draft of another shape and architecture family; the batch again from the prefix cache."""
    prompts, params = _requests()
    kwargs = {**F32, "kv_cache_memory": "8MiB"}
    plain, _, _ = _run(LLM(str(model_dirs[arch]), **kwargs), prompts, params)
    spec_llm = LLM(
        str(model_dirs[arch]), speculative_method="draft", speculative_model=str(draft_dir), **kwargs
    )
    spec, proposed, _ = _run(spec_llm, prompts, params)
    _assert_same(spec, plain)
    assert proposed > 0
    again, _, _ = _run(spec_llm, prompts, params)
    _assert_same(again, plain)


def test_draft_model_catches_up_exactly(qwen3_dir):
    """The model as its own draft: its greedy proposals are the verification's picks, so nearly all are
    accepted, provided the draft's KV cache holds every token it has seen at the right slot, across
    chunked prefill (a 24-token budget), preemption (which frees the draft's KV with the blocks) and prefix
    hits. A draft that read stale or misplaced KV would propose other tokens."""
    prompts = _requests()[0]
    params = [SamplingParams(temperature=0.0, max_tokens=40 + 5 * i, ignore_eos=True) for i in range(5)]
    kwargs = {
        "dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 24, "kvcache_block_size": 4,
        "kv_cache_memory": 40 * 2048,
    }  # fmt: skip
    plain, _, _ = _run(LLM(str(qwen3_dir), **kwargs), prompts, params)
    spec_llm = LLM(
        str(qwen3_dir), speculative_method="draft", speculative_model=str(qwen3_dir), num_speculative_tokens=3,
        **{**kwargs, "kv_cache_memory": 40 * 4096},  # the same blocks: each holds both models' KV
    )  # fmt: skip
    for _ in range(2):
        spec, proposed, accepted = _run(spec_llm, prompts, params)
        _assert_same(spec, plain)
        assert accepted >= 0.9 * proposed > 0, (proposed, accepted)
    assert spec_llm.engine.scheduler.num_preemptions > 0
    assert spec_llm.engine.runner.num_blocks == 40


def test_draft_runs_whole_on_rank_0_under_tensor_parallelism(qwen3_dir):
    """TP=2 with the model as its own draft: the draft is not sharded (rank 0 holds it and its KV whole),
    so its proposals are the sharded target's picks nearly always, and the tokens, logprobs included, are
    those of one process without speculation (fp32). Greedy, so that every proposal the target agrees
    with is accepted."""
    prompts = _requests()[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30 + 5 * i, ignore_eos=True, logprobs=2) for i in range(5)
    ]
    kwargs = {**F32, "kv_cache_memory": "8MiB", "device": "cpu"}
    plain, _, _ = _run(LLM(str(qwen3_dir), **kwargs), prompts, params)
    spec_llm = LLM(
        str(qwen3_dir), tensor_parallel_size=2, speculative_method="draft", speculative_model=str(qwen3_dir),
        num_speculative_tokens=3, **kwargs,
    )  # fmt: skip
    try:
        spec, proposed, accepted = _run(spec_llm, prompts, params)
    finally:
        spec_llm.shutdown()
    _assert_same(spec, plain)
    assert accepted >= 0.9 * proposed > 0, (proposed, accepted)


def test_draft_cache_holds_each_sequences_own_tokens(qwen3_dir, draft_dir):
    """After steps with rejected proposals (sampled requests), the draft's cache holds, at the slot of each
    position it counts as seen, the key of the token the sequence has there: equal to transformers' key
    for the same tokens. A draft that kept the KV of its rejected proposals fails this."""
    llm = LLM(
        str(qwen3_dir),
        speculative_method="draft",
        speculative_model=str(draft_dir),
        speculative_max_batch=8,
        kv_cache_memory="8MiB",
        **F32,
    )
    engine = llm.engine
    prompts = _requests()[0]
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=60, ignore_eos=True)
        )
    for _ in range(15):
        engine.step()
    draft = engine.runner.draft
    reference = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    block_size = llm.config.kvcache_block_size
    checked = 0
    for seq in engine.scheduler.running:
        seen = seq.num_draft_tokens
        assert 0 < seen < seq.num_tokens
        with torch.no_grad():
            cache = reference(torch.tensor([seq.token_ids[:seen]]), use_cache=True).past_key_values
        expected = cache.layers[-1].keys[0].transpose(0, 1)  # [seen, kv_heads, head_dim]
        slots = [seq.block_table[p // block_size] * block_size + p % block_size for p in range(seen)]
        got = draft.kv_cache[0, -1].flatten(0, 1)[slots].cpu()  # the draft's cache may be on a GPU
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        checked += seen - seq.num_prompt_tokens
    assert checked > 0  # output tokens, some after rejected proposals, were compared


def test_no_speculation_above_the_batch_limit(qwen3_dir):
    prompts, params = _requests()
    llm = LLM(
        str(qwen3_dir), speculative_method="ngram", speculative_max_batch=2, kv_cache_memory="8MiB", **F32
    )
    _, proposed, _ = _run(llm, prompts[:3], params[:3])
    assert proposed > 0  # once fewer than three are left decoding
    llm = LLM(
        str(qwen3_dir), speculative_method="ngram", speculative_max_batch=1, kv_cache_memory="8MiB", **F32
    )
    # Two requests decode side by side to the end (8 tokens each, no EOS in between): above the limit
    # of 1 at every step, so nothing is ever proposed.
    outs, proposed, _ = _run(
        llm, prompts[:2], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2
    )
    assert all(len(o["token_ids"]) == 8 for o in outs)
    assert proposed == 0


@pytest.mark.slow
def test_unseeded_sampling_keeps_its_distribution(qwen3_dir):
    """20,000 unseeded requests of 3 tokens at temperature 3, with and without speculation. The prompt holds
    each of tokens 2..199 once, so a first token among them gets its successor proposed, and the third
    token is picked after a verified proposal whenever that proposal was drawn. Its distribution must be the
    same as without speculation: a two-sample chi-square test at a false-failure rate of 1e-4 (z = 3.719),
    over the token ids seen at least 10 times in both runs together (the rest pooled). A verification
    that kept picks computed after a rejected proposal fails it by a wide margin.

    Temperature 3 flattens this random model enough that 14.2 of the proposals are expected to be accepted
    (the model's own probabilities, summed over the first tokens), so that none is accepted has probability
    e^-14.2 < 1e-6; at temperature 1 the expectation was 1.8, and a correct engine saw none one run in six."""
    prompt = list(range(2, 200))
    n = 20_000
    params = SamplingParams(temperature=3.0, max_tokens=3, ignore_eos=True)
    third: dict[str, collections.Counter] = {}
    for method in ("none", "ngram"):
        llm = LLM(
            str(qwen3_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", seed=1,
            speculative_method=method, num_speculative_tokens=1, speculative_max_batch=256,
        )  # fmt: skip
        outs, proposed, accepted = _run(llm, [prompt] * n, params)
        third[method] = collections.Counter(o["token_ids"][2] for o in outs)
        if method == "ngram":
            assert proposed > n // 5 and accepted > 0, (proposed, accepted)
    statistic, critical, cells = two_sample_chi_square(third["none"], third["ngram"])
    assert statistic < critical, (statistic, critical, cells)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"speculative_method": "medusa"},
            "speculative_method must be one of none, ngram, draft, mtp, got 'medusa'",
        ),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\], got 0"),
        ({"num_speculative_tokens": 17}, r"num_speculative_tokens must be in \[1, 16\], got 17"),
        ({"speculative_max_batch": 0}, "speculative_max_batch must be >= 1, got 0"),
        ({"speculative_method": "draft"}, "speculative_method=draft needs speculative_model"),
        (
            {"speculative_method": "ngram", "speculative_model": "/m"},
            "speculative_model is used only with speculative_method=draft, got speculative_method='ngram'",
        ),
        (
            {"speculative_method": "draft", "speculative_model": "/nonexistent"},
            "/nonexistent/config.json not found",
        ),
    ],
)
def test_bad_speculation_settings(qwen3_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(qwen3_dir), **kwargs)


def _copy_with(source, target, config: dict | None = None, swap: tuple[int, int] | None = None):
    """source's config.json (with `config`'s keys changed) and tokenizer.json (with the tokens of two ids
    swapped) in `target`: enough for the configuration's checks, which run before any weight is read."""
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps({**json.loads((source / "config.json").read_text()), **(config or {})})
    )
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    if swap is not None:
        vocab = tokenizer["model"]["vocab"]
        by_id = {i: t for t, i in vocab.items()}
        vocab[by_id[swap[0]]], vocab[by_id[swap[1]]] = swap[1], swap[0]
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target


def test_draft_with_another_vocabulary_is_refused(qwen3_dir, tmp_path):
    bigger = _copy_with(qwen3_dir, tmp_path / "bigger", config={"vocab_size": 1000})
    with pytest.raises(
        ConfigError,
        match=f"speculative_model {bigger} has a vocabulary of 1000 tokens and the model .* one of 512",
    ):
        LLM(str(qwen3_dir), speculative_method="draft", speculative_model=str(bigger))
    swapped = _copy_with(qwen3_dir, tmp_path / "swapped", swap=(300, 301))
    with pytest.raises(
        ConfigError, match="vocabularies of 512 tokens that differ: token id 300 is .* in the draft's"
    ):
        LLM(str(qwen3_dir), speculative_method="draft", speculative_model=str(swapped))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_served_stream_with_speculation_equals_offline_without(qwen3_dir, kernels, tmp_path, method):
    """A worker speculating behind a router: each stream (several tokens per step arrive in one update)
    equals the offline engine's output without speculation, text and logprobs included."""
    log_path = tmp_path / "worker.log"
    draft = (
        ["--speculative-model", str(qwen3_dir)] if method == "draft" else []
    )  # the model drafts for itself
    worker = start_worker(
        qwen3_dir, "--speculative-method", method, *draft, "--log-level", "debug", log_path=log_path
    )
    router = start_router([worker.address], log_path=tmp_path / "router.log")
    texts = ["w1 w2 w3 w1 w2 w3 w1 w2 w3 w1 w2", "w7 w8 w9 w10 w7 w8 w9", "w40 w41 w42"]
    params = [
        generate_pb2.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
        generate_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
        generate_pb2.SamplingParams(temperature=0, max_tokens=24),
    ]
    try:
        wait_serving(worker.address)
        wait_serving(router.address)
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            served = [
                list(stub.Generate(generate_pb2.GenerateRequest(text=t, sampling=p, return_token_ids=True)))
                for t, p in zip(texts, params)
            ]
    finally:
        router.stop()
        worker.stop()
    offline = LLM(
        str(qwen3_dir), kv_cache_memory="32MiB", max_model_len=512, dtype="float32"
    )  # as the worker
    expected = offline.generate(
        texts,
        [
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24),
        ],
        use_tqdm=False,
    )
    for responses, reference in zip(served, expected):
        assert [t for r in responses for t in r.token_ids] == reference["token_ids"]
        assert "".join(r.text for r in responses) == reference["text"]
    logprobs = [lp for r in served[0] for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == expected[0]["token_ids"]
    for got, want in zip(logprobs, expected[0]["logprobs"]):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    steps = [json.loads(line) for line in log_path.read_text().splitlines() if '"engine_step"' in line]
    assert sum(s.get("spec_accepted", 0) for s in steps) > 0
    assert max(len(r.token_ids) for responses in served for r in responses) > 1
