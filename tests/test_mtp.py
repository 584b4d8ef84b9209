"""Qwen3.5's MTP speculation (speculative_method=mtp; worker/sample/mtp.py, the state's rollback in
worker/core/recurrent_states.py): on random Qwen3.5 and Qwen3.5-MoE models with random heads in the
published layout, a batch's tokens and logprobs with MTP equal those without, in float32 and (bit for bit)
bf16 under --deterministic, with prompts longer than a step's chunk, seeded sampling beside greedy, a
prefix-cache hit, preemption and two tensor-parallel ranks. A random head's proposals are nearly all rejected; an oracle
(bench/mtp.py) makes some right, so steps keep 1 to K + 1 tokens. Without the rollback the tokens differ.
Settings it does not run with, and a checkpoint without the head, are refused at start by name."""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import random
import signal
from pathlib import Path

import psutil
import pytest

from bench.mtp import OracleProposals
from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import ConfigError, EngineDeadError
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from nanovllm.worker.runner.kv_cache import kv_bytes_per_block
from tests.helpers import counting_proposals, rank_processes, recorded_proposals, two_sample_chi_square
from tests.model_factory import VOCAB, build_model
from tests.resume_streams import MAX_TOKENS as RESUME_MAX_TOKENS
from tests.resume_streams import run as resume_run
from tests.services import held_streams, wait_idle

# A snapshot of the linear layers' state every 16 tokens: prompts hit the prefix cache, and verifications
# cross boundaries whose snapshots join the cache only when the tokens before them were kept.
ENGINE = {
    "max_model_len": 512,
    "kv_cache_memory": "16MiB",
    "dtype": "float32",
    "max_num_batched_tokens": 64,
    "state_snapshot_interval": 16,
}


def _build(root: Path, arch: str, mtp: bool = True) -> Path:
    return build_model(arch, root / arch, num_layers=4, seed=3, mtp=mtp)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def model(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("mtp"), request.param)


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1 to 150 tokens (longer than the 64-token step); greedy, seeded sampling with filters
    and penalties, logprobs; max_tokens apart, so some requests stop speculating before the others."""
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 9, 40, 77, 150)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True, logprobs=1
        ),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            seed=5,
            max_tokens=24,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    ]
    return prompts, params


def _tokens(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def _assert_same(got: list[dict], expected: list[dict], exact: bool) -> None:
    assert _tokens(got) == _tokens(expected)
    for a, b in zip(got, expected):
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert x.token_id == y.token_id
            assert x.logprob == y.logprob if exact else abs(x.logprob - y.logprob) < 1e-4


def _all_back(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return (
        bm.num_free_blocks == bm.num_blocks
        and bm.states is not None
        and len(bm.states.free_slots) == (bm.states.num_slots)
    )


def _oracle(llm: LLM, prompts: list[list[int]], expected: list[dict]) -> None:
    """Proposals right for 0, 1, ..., K of their tokens in turn (the rest wrong)."""
    turns = itertools.count()
    continuations = {tuple(p): o["token_ids"] for p, o in zip(prompts, expected)}
    OracleProposals(llm, continuations, right=lambda n: next(turns) % (n + 1))


@pytest.fixture(scope="module")
def plain(model: Path) -> list[dict]:
    prompts, params = _requests()
    return LLM(str(model), **ENGINE).generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_tokens_equal_without_mtp(model: Path, plain: list[dict], k: int):
    """The random head (nearly every proposal rejected), then the oracle (steps keep 1..K+1 tokens), then
    the same again from the prefix cache: the tokens and logprobs of the engine without speculation."""
    prompts, params = _requests()
    llm = LLM(
        str(model), speculative_method="mtp", num_speculative_tokens=k, speculative_max_batch=8, **ENGINE
    )
    with counting_proposals(llm) as counts:
        _assert_same(llm.generate(prompts, params, use_tqdm=False), plain, exact=False)
    assert counts[0] > 0, counts
    _oracle(llm, prompts, plain)
    with counting_proposals(llm) as counts:
        again = llm.generate(prompts, params, use_tqdm=False)
    _assert_same(again, plain, exact=False)
    assert 0 < counts[1] < counts[0], counts  # some kept, some rejected
    assert sum(o["num_cached_tokens"] for o in again) > 0  # the prompts' blocks hit
    assert _all_back(llm)


def test_a_draft_vocabulary_narrows_the_proposals_not_the_tokens(model: Path, plain: list[dict]):
    """speculative_draft_vocab: the whole vocabulary proposes what no setting proposes; 64 ids propose
    only ids below 64 (where the random head, unrestricted, proposes ids above too); the tokens and
    logprobs stay the engine's without speculation."""

    def run(draft_vocab: int) -> tuple[list[dict], list[list[int]]]:
        llm = LLM(
            str(model),
            speculative_method="mtp",
            num_speculative_tokens=3,
            speculative_max_batch=8,
            speculative_draft_vocab=draft_vocab,
            **ENGINE,
        )
        proposals = recorded_proposals(llm)
        return llm.generate(*_requests(), use_tqdm=False), proposals

    (_, unrestricted), (whole_out, whole), (narrow_out, narrow) = run(0), run(VOCAB), run(64)
    assert whole == unrestricted and any(t >= 64 for p in unrestricted for t in p)
    assert narrow and all(t < 64 for p in narrow for t in p)
    _assert_same(whole_out, plain, exact=False)
    _assert_same(narrow_out, plain, exact=False)


def test_preempted_requests_recompute_with_mtp(model: Path, plain: list[dict]):
    """A cache too small for the batch: requests are preempted mid-speculation (their pending rollback and
    the head's pending rows dropped with their blocks) and recompute to the same tokens."""
    prompts, params = _requests()
    config = ModelConfig.from_pretrained_dir(model)
    state = Qwen3_5ForCausalLM.state_layout(config, 1).bytes_per_slot(4)
    # 60 blocks of 4 tokens (the model's and the head's KV), the 5 requests' slots (4 rows each with K = 3)
    # and the pad row: the batch needs about 96 blocks, its longest request 44.
    block = kv_bytes_per_block(config, 4, config.num_key_value_heads, 4)
    block += block // config.num_attention_layers
    memory = 21 * state + 60 * block
    llm = LLM(
        str(model), speculative_method="mtp", num_speculative_tokens=3, speculative_max_batch=8,
        **{**ENGINE, "kv_cache_memory": memory, "kvcache_block_size": 4, "max_num_seqs": 5, "max_model_len": 240},
        enable_prefix_caching=False, state_memory_fraction=(20 * state + 1) / memory,
    )  # fmt: skip
    _oracle(llm, prompts, plain)
    _assert_same(llm.generate(prompts, params, use_tqdm=False), plain, exact=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.num_blocks == 60
    assert _all_back(llm)


def test_two_ranks_propose_as_one_and_keep_the_tokens(model: Path, plain: list[dict]):
    """tensor_parallel_size=2: each rank runs the head's passes on its share of the head (its KV heads, its
    slice of the vocabulary; the first 300 ids cross both ranks' slices of 256) and the rank 0 broadcasts of
    each pass's rows. The proposals equal one rank's; the tokens and logprobs equal the engine's without
    speculation (one rank), with the random head and then the oracle; every block and state slot back.
    Then rank 1 killed while requests speculate: a step or a pass of the head raises EngineDeadError
    naming it, and no rank is left. The first three requests (the others' longer prompts add time, not
    cases)."""
    prompts, params = (part[:3] for part in _requests())
    plain = plain[:3]
    options = {
        "speculative_method": "mtp", "num_speculative_tokens": 3, "speculative_max_batch": 8,
        "speculative_draft_vocab": 300, **ENGINE,
    }  # fmt: skip
    one = LLM(str(model), **options)
    one_rank = recorded_proposals(one)
    one.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model), tensor_parallel_size=2, device="cpu", **options)
    try:
        two_ranks = recorded_proposals(llm)
        _assert_same(llm.generate(prompts, params, use_tqdm=False), plain, exact=False)
        assert two_ranks == one_rank and any(t >= VOCAB // 2 for p in two_ranks for t in p)
        _oracle(llm, prompts, plain)
        with counting_proposals(llm) as counts:
            _assert_same(llm.generate(prompts, params, use_tqdm=False), plain, exact=False)
        assert 0 < counts[1] < counts[0], counts
        assert _all_back(llm)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(str(i), prompt, params[i])
        llm.engine.step()
        (rank1,) = rank_processes(psutil.Process())
        os.kill(rank1.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {rank1.pid}\) exited with code -9"):
            for _ in range(100):  # more steps than the requests' tokens: the dead rank is noticed
                llm.engine.step()
    finally:
        llm.shutdown()
    assert rank_processes(psutil.Process()) == []


def test_a_state_not_rolled_back_changes_the_tokens(model: Path, plain: list[dict]):
    """The planted bug: a rejection that leaves the rejected tokens' updates in the linear layers' state.
    The tokens then differ from the engine's without speculation (what the tests above check)."""
    prompts, params = _requests()
    llm = LLM(
        str(model), speculative_method="mtp", num_speculative_tokens=3, speculative_max_batch=8, **ENGINE
    )
    states = llm.engine.block_manager.states
    assert states is not None
    states.roll_back = lambda seq, verified, kept: None  # type: ignore[method-assign]
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) != _tokens(plain)


@pytest.mark.slow
def test_unseeded_sampling_keeps_its_distribution(tmp_path: Path):
    """4,000 unseeded requests of 3 tokens at temperature 0.5, with MTP and without: the third token's
    distribution is the same (the two-sample chi-square of tests/helpers.py at a false-failure rate of 1e-4).
    The proposal is the second token most often drawn without MTP (a random head's are never accepted at
    this temperature), accepted in about a fifth of the requests: their third token is drawn in the same
    verification, after the accepted proposal; the others' in the next step, after a rollback. Measured once:
    33 against a critical value of 102; with the rollback left out (the planted bug above) 3,943."""
    model = _build(tmp_path, "qwen3_5")
    prompt = list(range(2, 200))
    params = SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True)

    def engine(method: str) -> LLM:
        return LLM(
            str(model), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", seed=1,
            speculative_method=method, num_speculative_tokens=1, speculative_max_batch=256,
        )  # fmt: skip

    plain = _tokens(engine("none").generate([prompt] * 4000, params, use_tqdm=False))
    second = collections.Counter(t[1] for t in plain).most_common(1)[0][0]
    llm = engine("mtp")
    # The continuation's first token is the prefill's draw, never proposed.
    OracleProposals(llm, {tuple(prompt): [0, second]})
    with counting_proposals(llm) as counts:
        tokens = _tokens(llm.generate([prompt] * 4000, params, use_tqdm=False))
    assert _all_back(llm)
    proposed, accepted = counts
    assert proposed == 4000 and 400 < accepted < 1600, counts
    statistic, critical, cells = two_sample_chi_square(
        collections.Counter(t[2] for t in plain), collections.Counter(t[2] for t in tokens)
    )
    assert statistic < critical, (statistic, critical, cells)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_deterministic_bf16_is_bit_identical(model: Path, kv_cache_dtype: str):
    """bf16 with --deterministic, the KV cache in bf16 or FP8 (the head's own in bf16): tokens and logprobs
    with MTP (the oracle, 1..K+1 tokens kept a step) bit-identical to those without."""
    prompts, params = _requests()
    options = {**ENGINE, "dtype": "bfloat16", "deterministic": True, "kv_cache_dtype": kv_cache_dtype}
    expected = LLM(str(model), **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(
        str(model), speculative_method="mtp", num_speculative_tokens=3, speculative_max_batch=8, **options
    )
    _oracle(llm, prompts, expected)
    _assert_same(llm.generate(prompts, params, use_tqdm=False), expected, exact=True)


def test_a_checkpoint_without_the_head_is_refused(tmp_path: Path):
    model = _build(tmp_path, "qwen3_5", mtp=False)
    with pytest.raises(ConfigError, match=r"holds no mtp\.\* tensors"):
        LLM(str(model), speculative_method="mtp", **ENGINE)


@pytest.mark.parametrize(
    ("arch", "options", "message"),
    [
        ("qwen3", {}, "speculative_method=mtp needs a model with a multi-token-prediction head"),
        ("qwen3_5", {"num_speculative_tokens": 5}, r"num_speculative_tokens must be in \[1, 4\]"),
        ("qwen3_5", {"speculative_draft_vocab": VOCAB + 1}, r"speculative_draft_vocab must be in \[0, 512\]"),
    ],
)
def test_settings_it_does_not_run_are_refused(tmp_path: Path, arch: str, options: dict, message: str):
    model = _build(tmp_path, arch, mtp=False)
    with pytest.raises(ConfigError, match=message):
        LLM(str(model), speculative_method="mtp", **{**ENGINE, **options})


def test_a_draft_vocabulary_without_mtp_is_refused(tmp_path: Path):
    model = _build(tmp_path, "qwen3_5", mtp=False)
    with pytest.raises(ConfigError, match="speculative_draft_vocab is used only with speculative_method=mtp"):
        LLM(str(model), speculative_draft_vocab=64, **ENGINE)


@pytest.mark.slow  # Triton's interpreter: about 20 s
def test_the_triton_kernels_verify_and_roll_back(model: Path):
    """On the Triton attention backend (in the interpreter on a CPU) the linear layers run on
    kernels/triton_gated_delta.py, a verification's tokens through its chunk kernels one at a time: the
    tokens with MTP (the oracle, 1..K+1 tokens kept a step) equal those without, on the same kernels."""
    if "moe" in model.name:
        pytest.skip("the dense model covers the kernels; the MoE's experts add only interpreter time")
    prompts, params = _requests()
    prompts, params = prompts[:2], [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    options = {**ENGINE, "attention_backend": "triton", "max_num_batched_tokens": 16}
    expected = LLM(str(model), **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model), speculative_method="mtp", num_speculative_tokens=3, **options)
    assert llm.engine.runner.kernel_backend == "triton"
    _oracle(llm, prompts, expected)
    with counting_proposals(llm) as counts:
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(expected)
    assert 0 < counts[1] < counts[0], counts


@pytest.mark.slow  # two workers and a router
def test_streams_resume_token_identical_when_their_worker_is_killed(model: Path, kernels, tmp_path: Path):
    """tests/test_resume.py's case with MTP (float32, K = 3): eight streams on worker A, A SIGKILLed
    mid-stream; on B each request recomputes its state, and the head its KV, from its prompt and the
    tokens so far, and every stream equals its unbroken run token for token."""
    if "moe" in model.name:
        pytest.skip("the dense model covers failover; the MoE's experts change nothing in it")
    flags = ("--dtype", "float32", "--speculative-method", "mtp", "--num-speculative-tokens", "3")
    flags += ("--speculative-max-batch", "8")  # the eight streams speculate together
    with held_streams(model, tmp_path, worker_flags=flags) as (_, b, router, kill_a):
        results, at_kill = asyncio.run(resume_run(router.address, kill_when=4, kill=kill_a))
        assert all(4 <= n < RESUME_MAX_TOKENS for n in at_kill), at_kill
        unbroken, _ = asyncio.run(resume_run(router.address))
        assert results == unbroken
        wait_idle(b.address)
