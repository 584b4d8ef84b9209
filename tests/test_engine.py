"""The step-level engine API the worker service drives, and its error handling."""

from __future__ import annotations

import gc
import json
import random
import shutil
import weakref

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import ConfigError, RequestError
from tests.helpers import greedy, hf_logits


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    # float32: logprobs are compared with transformers' fp32 logits (tests/test_dtypes.py covers 16-bit).
    return LLM(
        str(qwen3_dir), max_model_len=128, kv_cache_memory="8MiB", kvcache_block_size=8, dtype="float32"
    )


def _drain(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _all_free(llm: LLM) -> bool:
    load = llm.engine.load()
    return load.kv_blocks_used == 0 and load.num_running == 0 and load.num_waiting == 0


def test_step_api_streams_deltas_and_one_terminal_output(llm):
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], greedy(5))
    engine.add_request("b", list(range(10, 40)), greedy(3))
    outputs = _drain(engine)
    assert [len(o.new_token_ids) for o in outputs["a"]] == [1] * 5
    assert [o.finish_reason for o in outputs["a"]] == [None] * 4 + ["length"]
    assert sum(o.finished for o in outputs["b"]) == 1
    assert outputs["b"][-1].num_prompt_tokens == 30
    assert _all_free(llm)


def test_no_step_runs_more_tokens_than_max_num_batched_tokens(qwen3_dir):
    """A prompt longer than the step's budget is prefilled in chunks beside the running decodes, and no step
    runs more than max_num_batched_tokens tokens (the activations a GPU sizes for): 100 prompt tokens at 16
    a step take at least 7 steps."""
    llm = LLM(str(qwen3_dir), max_model_len=128, kv_cache_memory="8MiB", max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("decoding", [5, 6, 7], greedy(12))
    engine.step()
    engine.add_request("long", list(range(2, 102)), greedy(2))
    tokens = []
    while engine.has_unfinished_requests():
        stats = engine.step().stats
        tokens.append(stats.num_prefill_tokens + stats.num_decode_tokens)
    assert max(tokens) == 16 and len(tokens) >= 7, tokens
    assert _all_free(llm)


def test_a_prefix_hit_needs_every_token_of_the_block(llm):
    """Cached KV is shared only by prompts equal up to the end of a full block: changing the last token of
    the first 8-token block shares nothing, changing the first of the second shares the first block."""
    prompt = list(range(30, 62))
    llm.generate([prompt], greedy(1), use_tqdm=False)
    for changed, cached in ((7, 0), (8, 8), (0, 0)):
        other = list(prompt)
        other[changed] = 500
        (out,) = llm.generate([other], greedy(1), use_tqdm=False)
        assert out["num_cached_tokens"] == cached, (changed, out["num_cached_tokens"])
    assert _all_free(llm)


def test_a_dropped_engine_frees_its_kv_cache(qwen3_dir):
    """An LLM dropped (shut down or not) takes its KV cache with it: the engine freezes what exists at its
    start out of the garbage collector's sight, so a reference cycle through the engine would keep the
    cache for the process's life (a test process making a few engines ran out of memory)."""
    for shut_down in (True, False):
        llm = LLM(str(qwen3_dir), max_model_len=128, kv_cache_memory="8MiB")
        llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
        if shut_down:
            llm.shutdown()
        cache = weakref.ref(llm.engine.runner.kv_cache)
        del llm
        gc.collect()
        kept = cache() is not None
        assert not kept, f"the KV cache outlived its engine (shut down: {shut_down})"


def test_load_reports_waiting_running_and_blocks(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"load{i}", list(range(2, 22)), greedy(4))
    load = engine.load()
    assert (load.num_waiting, load.num_running, load.kv_blocks_used) == (3, 0, 0)
    engine.step()
    load = engine.load()
    assert load.num_waiting == 0 and load.num_running == 3
    assert load.kv_blocks_used == 3 * 3  # 20 prompt tokens + 1 new, 8-token blocks, hits share none
    assert load.kv_blocks_used + load.kv_blocks_free == engine.block_manager.num_blocks
    _drain(engine)
    assert _all_free(llm)


@pytest.mark.parametrize("when", ["waiting", "running", "mid_prefill"])
def test_abort_in_any_state_frees_everything(qwen3_dir, when):
    llm = LLM(str(qwen3_dir), max_model_len=128, kv_cache_memory="8MiB", max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("x", list(range(2, 60)), greedy(50))
    if when != "waiting":
        engine.step()
    if when == "running":
        while engine.requests["x"].num_computed_tokens < 58:
            engine.step()
    assert engine.abort_request("x")
    assert not engine.abort_request("x")
    outputs = _drain(engine)
    assert [o.finish_reason for o in outputs["x"]] == ["abort"]
    assert _all_free(llm)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = [9, 8, 7, 6]
    free_run = llm.generate([prompt], greedy(12), use_tqdm=False)[0]["token_ids"]
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == free_run[: first + 1]
    # min_tokens bans the stop token until enough tokens exist: the first output then differs.
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    assert stop_at not in out["token_ids"][: first + 2]
    assert _all_free(llm)


def test_eos_stops_unless_ignored(qwen3_dir, tmp_path):
    prompt = [9, 8, 7, 6]
    base = LLM(str(qwen3_dir), max_model_len=128, kv_cache_memory="8MiB")
    free_run = base.generate([prompt], greedy(12), use_tqdm=False)[0]["token_ids"]
    # Same weights, but the config names the 4th generated token as EOS.
    model_dir = tmp_path / "eos_model"
    shutil.copytree(qwen3_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = free_run[3]
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_memory="8MiB")
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    first = free_run.index(free_run[3])
    assert stopped["token_ids"] == free_run[: first + 1] and stopped["finish_reason"] == "stop"
    ignored = llm.generate([prompt], greedy(12), use_tqdm=False)[0]
    assert ignored["token_ids"] == free_run and ignored["finish_reason"] == "length"
    # min_tokens bans EOS until that many tokens exist: the run goes past the first EOS.
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2)
    banned = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    assert free_run[3] not in banned[: first + 2] and len(banned) >= first + 2


def test_max_model_len_caps_generation(llm):
    out = llm.generate([list(range(2, 120))], greedy(100), use_tqdm=False)[0]
    assert out["finish_reason"] == "length"
    assert len(out["token_ids"]) == 128 - 118


def test_priorities_order_admission(qwen3_dir):
    llm = LLM(str(qwen3_dir), max_model_len=128, kv_cache_memory="8MiB", max_num_seqs=1)
    finished: list[str] = []
    for request_id, priority in [("low", 5), ("high", -1), ("mid", 0), ("mid2", 0)]:
        llm.engine.add_request(request_id, [3, 4, 5], greedy(2), priority=priority)
    while llm.engine.has_unfinished_requests():
        finished += [o.request_id for o in llm.engine.step().outputs if o.finished]
    assert finished == ["high", "mid", "mid2", "low"]


def test_seeded_sampling_reproducible_across_batches(llm):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=16)
    prompt = [11, 12, 13, 14, 15]
    alone = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    rng = random.Random(3)
    others = [[rng.randrange(2, 500) for _ in range(rng.randrange(1, 40))] for _ in range(9)]
    mixed = others[:4] + [prompt] + others[4:]
    other_params = [SamplingParams(temperature=1.0, max_tokens=20) for _ in others]
    outs = llm.generate(mixed, other_params[:4] + [params] + other_params[4:], use_tqdm=False)
    assert outs[4]["token_ids"] == alone


def test_logprobs_match_reference(llm):
    prompt = [21, 22, 23, 24]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True), use_tqdm=False
    )[0]
    tokens = prompt + out["token_ids"]
    ref = torch.log_softmax(hf_logits(llm.config.model, tokens), dim=-1)
    for i, entry in enumerate(out["logprobs"]):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == out["token_ids"][i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(4).indices.tolist()


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "no tokens"),
        (list(range(2, 130)), "128 tokens but max_model_len is 128"),
        ([5, 512], "outside the vocabulary [0, 512)"),
    ],
)
def test_bad_requests_are_rejected_clearly(llm, prompt, message):
    with pytest.raises(
        RequestError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        llm.engine.add_request("bad", prompt, greedy(4))
    assert not llm.engine.has_unfinished_requests()


def test_out_of_vocabulary_stop_id_fails_only_its_request(llm):
    """Banned below min_tokens, a stop id past the vocabulary would index past the logits row and fail the
    whole step: add_request refuses it, and the request already running finishes untouched."""
    engine = llm.engine
    engine.add_request("bystander", [3, 4, 5], greedy(6))
    engine.step()
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[7, 512])
    with pytest.raises(RequestError, match=r"stop_token_ids holds 512, outside the vocabulary \[0, 512\)"):
        engine.add_request("bad", [3], bad)
    outputs = _drain(engine)
    assert set(outputs) == {"bystander"}
    assert outputs["bystander"][-1].finish_reason == "length"
    assert _all_free(llm)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            seed=5,
            top_k=40,
            min_tokens=20,
            max_tokens=24,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
        ),
    ],
    ids=["greedy", "seeded"],
)
def test_a_resumed_request_continues_exactly(llm, params):
    """add_request with the first n output tokens (a stream moved off a failed worker) produces exactly the
    rest of the unbroken run: max_tokens, min_tokens, penalties and the seeded draws all count them."""
    engine = llm.engine
    prompt = [9, 10, 11, 12]
    engine.add_request("whole", prompt, params)
    whole = [t for out in _drain(engine)["whole"] for t in out.new_token_ids]
    assert len(set(whole)) > 3
    for n in (1, 9, len(whole) - 1):
        engine.add_request("resumed", prompt, params, output_token_ids=whole[:n])
        outputs = _drain(engine)["resumed"]
        assert [t for out in outputs for t in out.new_token_ids] == whole[n:]
        assert outputs[-1].num_output_tokens == len(whole)
    assert _all_free(llm)


@pytest.mark.parametrize(
    "outputs, max_tokens, message",
    [
        ([5] * 4, 4, "output_token_ids holds 4 tokens: max_tokens 4 leaves none to generate"),
        ([5] * 124, 200, r"the prompt \(4 tokens\) and output_token_ids \(124\) fill max_model_len 128"),
        ([5, 512], 8, r"output_token_ids holds 512, outside the vocabulary \[0, 512\)"),
    ],
)
def test_bad_resumed_outputs_are_rejected(llm, outputs, max_tokens, message):
    with pytest.raises(RequestError, match=message):
        llm.engine.add_request("bad", [3, 4, 5, 6], greedy(max_tokens), output_token_ids=outputs)
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_request_id_rejected(llm):
    llm.engine.add_request("dup", [3], greedy(1))
    with pytest.raises(RequestError, match="already in flight"):
        llm.engine.add_request("dup", [3], greedy(1))
    _drain(llm.engine)


def test_kv_cache_too_small_names_the_numbers(qwen3_dir):
    with pytest.raises(ConfigError, match=r"KV cache holds 2 blocks .* max_model_len=128 needs"):
        LLM(
            str(qwen3_dir),
            max_model_len=128,
            kvcache_block_size=16,
            kv_cache_memory=2 * 16 * 512,  # 512 B per token in float32
            dtype="float32",
        )


def test_unknown_llm_argument(qwen3_dir):
    with pytest.raises(ConfigError, match="unknown LLM arguments \\['max_len'\\]"):
        LLM(str(qwen3_dir), max_len=10)


def _preempting_llm(model_dir) -> LLM:
    """30 blocks of 4 tokens (2 KiB each in float32, so that preempted and roomy runs agree exactly) and
    32 tokens a step: 8 requests of 40 new tokens preempt one another."""
    return LLM(
        str(model_dir), max_model_len=96, kvcache_block_size=4, kv_cache_memory=30 * 2048,
        max_num_batched_tokens=32, dtype="float32",
    )  # fmt: skip


def test_preemption_then_prefix_hit_regression(qwen3_dir):
    """nano-vllm bug: a preempted sequence re-admitted on a prefix hit indexed past its block table."""
    rng = random.Random(5)
    shared = [rng.randrange(2, 500) for _ in range(24)]
    prompts = [shared + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    roomy = LLM(
        str(qwen3_dir), max_model_len=96, kv_cache_memory="8MiB", kvcache_block_size=4, dtype="float32"
    )
    expected = [o["token_ids"] for o in roomy.generate(prompts, greedy(40), use_tqdm=False)]
    tight = _preempting_llm(qwen3_dir)
    got = [o["token_ids"] for o in tight.generate(prompts, greedy(40), use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.prefix_hit_tokens > 0
    assert got == expected
    assert _all_free(tight)


def test_prefix_hit_rate_counts_each_prompt_once_through_preemptions(qwen3_dir):
    """A preempted request recomputed from its own cached blocks is no new prompt and no hit: prompts that
    share no block keep the rate at 0 however often they are preempted."""
    rng = random.Random(6)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(8, 30))] for _ in range(8)]
    tight = _preempting_llm(qwen3_dir)
    tight.generate(prompts, greedy(40), use_tqdm=False)
    bm = tight.engine.block_manager
    assert tight.engine.scheduler.num_preemptions > 0
    assert (bm.prefix_queried_tokens, bm.prefix_hit_tokens) == (sum(map(len, prompts)), 0)
