"""Async scheduling: the engine schedules and launches step N+1 before it applies step N's picks, and its
outputs are exactly the synchronous engine's.

On a CPU the runner computes each step before `launch` returns, so nothing overlaps in time; but the
engine's side is the code that runs on CUDA: places held for picks in flight, the next step's inputs
taking them from the last step's picks, one-step-late outputs, rows of finished requests discarded. Float32
throughout: there a request's tokens do not depend on its batch (tests/test_batch_invariance.py), and the
async engine's batches differ (a request that stopped at step N still has its row in step N+1).
"""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import ConfigError
from tests.helpers import greedy

F32 = {"dtype": "float32", "max_model_len": 128, "kvcache_block_size": 8}


def _llm(model_dir, mode: str, **kwargs) -> LLM:
    return LLM(str(model_dir), async_scheduling=mode, **{"kv_cache_memory": "8MiB", **F32, **kwargs})


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _drive(llm: LLM, prompts, params, abort: dict[int, str] | None = None) -> tuple[dict, int]:
    """Every request's (tokens, finish reason, logprobs), each request ending with exactly one terminal
    output; `abort` aborts a request at a step number. Also returns how many steps overlapped."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    results: dict[str, tuple[list[int], str | None, list]] = {}
    overlapped = 0
    step = 0
    while engine.has_unfinished_requests():
        if abort and step in abort:
            assert engine.abort_request(abort[step])
        result = engine.step()
        overlapped += result.stats.overlapped
        step += 1
        for out in result.outputs:
            tokens, reason, logprobs = results.setdefault(out.request_id, ([], None, []))
            assert reason is None, f"request {out.request_id} got an output after its terminal one"
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs)
            assert out.num_output_tokens == len(tokens)
            results[out.request_id] = (tokens, out.finish_reason, logprobs)
    load = engine.load()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0), load
    assert all(reason is not None for _, reason, _ in results.values())
    return results, overlapped


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for request_id, (tokens, reason, logprobs) in expected.items():
        assert got[request_id][:2] == (tokens, reason), request_id
        # The same numbers computed in batches of other sizes: float32 rounding of the logits only.
        for a, b in zip(got[request_id][2], logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def _mixed_params(prompts, stops: list[int]) -> list[SamplingParams]:
    """Greedy and seeded sampling, stop ids that end requests early (taken from a first run's tokens),
    min_tokens holding a stop back, logprobs, and lengths that end requests at different steps."""
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        stop = [stops[i]] if i % 3 else []
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=5 + i, stop_token_ids=stop))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=i, max_tokens=30))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=stop, min_tokens=6))
        else:
            params.append(SamplingParams(temperature=0.7, seed=100 + i, logprobs=3, max_tokens=3 + 2 * i))
    return params


@pytest.fixture(scope="module")
def mixed(qwen3_dir):
    prompts = _prompts(12)
    first = _llm(qwen3_dir, "off").generate(prompts, greedy(8), use_tqdm=False)
    return prompts, _mixed_params(prompts, [o["token_ids"][3] for o in first])


def test_async_outputs_equal_the_synchronous_engines(qwen3_dir, mixed):
    prompts, params = mixed
    expected, none = _drive(_llm(qwen3_dir, "off"), prompts, params)
    got, overlapped = _drive(_llm(qwen3_dir, "on"), prompts, params)
    assert none == 0 and overlapped > 10
    assert any(reason == "stop" for _, reason, _ in expected.values())  # some rows were discarded
    _assert_same(got, expected)


def test_penalties_and_constraints_wait_for_their_tokens(qwen3_dir, mixed):
    """A request whose next step needs its new token on the host (penalties count it, a constraint
    advances on it) makes the engine apply the step before scheduling the next; the others still overlap
    while it is not running."""
    prompts, params = mixed
    params = list(params)
    params[1] = SamplingParams(
        temperature=0.8, seed=5, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=9
    )
    params[5] = SamplingParams(temperature=0.0, regex="(ab|cd)+e", max_tokens=12)
    expected, _ = _drive(_llm(qwen3_dir, "off"), prompts, params)
    got, overlapped = _drive(_llm(qwen3_dir, "on"), prompts, params)
    assert overlapped > 0
    _assert_same(got, expected)


def test_under_preemption(qwen3_dir):
    """A KV cache far smaller than the batch needs: requests are preempted while a pick of theirs is in
    flight, and recomputed; the tokens are those of a roomy synchronous run."""
    prompts = _prompts(8, seed=9)
    params = [greedy(30 + i) for i in range(8)]
    expected, _ = _drive(_llm(qwen3_dir, "off", kvcache_block_size=4), prompts, params)
    tight = _llm(qwen3_dir, "on", kvcache_block_size=4, kv_cache_memory=40 * 2048)
    got, overlapped = _drive(tight, prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0 and overlapped > 0
    _assert_same(got, expected)


def test_abort_with_a_pick_in_flight(qwen3_dir):
    """Aborting a request whose pick is in flight: one terminal output, its tokens a prefix of what it
    would have generated, every block back, and the other requests unchanged."""
    prompts = _prompts(4, seed=4)
    params = [greedy(20) for _ in prompts]
    expected, _ = _drive(_llm(qwen3_dir, "off"), prompts, params)
    got, _ = _drive(_llm(qwen3_dir, "on"), prompts, params, abort={6: "2"})
    tokens, reason, _ = got.pop("2")
    assert reason == "abort" and tokens == expected.pop("2")[0][: len(tokens)] and tokens
    _assert_same(got, expected)


def test_max_model_len_with_a_pick_in_flight(qwen3_dir):
    """A request that reaches max_model_len with a pick in flight is not scheduled past it."""
    prompt = _prompts(1, seed=2)[0]
    expected, _ = _drive(_llm(qwen3_dir, "off"), [prompt], [greedy(500)])
    got, _ = _drive(_llm(qwen3_dir, "on"), [prompt], [greedy(500)])
    assert len(got["0"][0]) == 128 - len(prompt) and got["0"][1] == "length"
    _assert_same(got, expected)


def test_async_scheduling_setting(qwen3_dir):
    # On by default on CUDA; a CPU computes each step itself, so there is nothing to overlap.
    assert _llm(qwen3_dir, "auto").engine.async_scheduling == torch.cuda.is_available()
    with pytest.raises(ConfigError, match="async_scheduling must be auto, on or off, got 'yes'"):
        _llm(qwen3_dir, "yes")
    with pytest.raises(ConfigError, match="async_scheduling=on needs .* speculative_method=none"):
        _llm(qwen3_dir, "on", speculative_method="ngram")
