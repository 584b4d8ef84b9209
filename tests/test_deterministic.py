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
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import resolve_model
from nanovllm.worker.runner.kv_cache import kv_bytes_per_block
from tests.model_factory import build_model, write_gguf

DTYPES = ("bfloat16", "float16")
ARCHS = ("qwen3", "llama", "qwen2")
# (arch, dtype, kv_cache_dtype): every arch in every 16-bit dtype, and an FP8 KV cache (kernels/fp8_kv.py)
CASES = [(a, d, "auto") for a in ARCHS for d in DTYPES] + [
    ("qwen3", "bfloat16", "fp8"),
    ("llama", "float16", "fp8_e5m2"),
]
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
    kv_cache_dtype: str
    alone: list[dict]  # GREEDY, SEEDED and CONSTRAINED on TARGET, each alone

    def llm(self, **options) -> LLM:
        defaults = {
            "max_model_len": 256,
            "kv_cache_memory": "16MiB",
            "deterministic": True,
            "kv_cache_dtype": self.kv_cache_dtype,
        }
        return LLM(str(self.model), dtype=self.dtype, **{**defaults, **options})


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block back
    return outs


def _count_proposals(llm: LLM) -> list[int]:
    """A one-item list that counts the speculative tokens `llm`'s engine proposes from now on."""
    proposed = [0]
    step = llm.engine.step

    def counting_step():
        result = step()
        proposed[0] += result.stats.num_spec_proposed
        return result

    llm.engine.step = counting_step
    return proposed


def _assert_identical(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    assert got["logprobs"] == want["logprobs"]  # chosen and top-2 logprobs, compared as floats: bit for bit
    assert got["finish_reason"] == want["finish_reason"]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: "-".join(x for x in p if x != "auto"))
def case(request, model_dirs, kernels) -> Case:
    arch, dtype, kv_cache_dtype = request.param
    case = Case(model_dirs[arch], dtype, kv_cache_dtype, [])
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
    element_size = 1 if case.kv_cache_dtype != "auto" else torch.finfo(getattr(torch, case.dtype)).bits // 8
    per_block = kv_bytes_per_block(shape, 4, shape.num_key_value_heads, element_size)
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
    proposed = _count_proposals(llm)
    outs = _generate(llm, [TARGET, TARGET], [GREEDY, SEEDED])
    assert proposed[0] > 0
    _assert_identical(outs[0], case.alone[0])
    _assert_identical(outs[1], case.alone[1])


def test_a_json_schema_constraint_holds_and_the_request_does_not_change(case: Case):
    """Constrained, it is the same alone as in a batch of 8 with its prompt in 7-token chunks."""
    llm = case.llm(max_num_batched_tokens=7)
    prompts, params = _others(7)
    outs = _generate(llm, [*prompts[:4], TARGET, *prompts[4:]], [*params[:4], CONSTRAINED, *params[4:]])
    _assert_identical(outs[4], case.alone[2])
    assert outs[4]["text"].startswith("{")


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Every quantized weight format the CPU runs, on a random Qwen3 of 256 features (a row of 256 or 512
    weights is 2-8 of the integer dots' 64-byte chunks, so their order can show: a planted reversal of the
    chunks in tiles of 5-8 rows fails the 4-bit formats' cases here, and none at 64 features, one or two
    chunks a row): int8 and int4 quantized as it loads, Q8_0, Q4_0 and Q4_1 as a GGUF file ships them."""
    root = tmp_path_factory.mktemp("quantized")
    model = build_model("qwen3", root / "qwen3", hidden=256, seed=1)
    formats: dict[str, tuple[Path, dict]] = {q: (model, {"quantization": q}) for q in ("int8", "int4")}
    for qtype in ("Q8_0", "Q4_0", "Q4_1"):
        formats[qtype] = (write_gguf(model, root / f"{qtype}.gguf", qtype), {})
    return formats


@pytest.mark.parametrize(
    ("weights", "dtype"),
    [(w, "bfloat16") for w in ("int8", "int4", "Q8_0", "Q4_0", "Q4_1")]
    + [("int8", "float32"), ("Q4_1", "float32")],
)
def test_quantized_weights_give_the_request_what_they_give_it_alone(
    quantized_models, weights: str, dtype: str
):
    """Each quantized format in bf16 (the integer dots at every row count where the CPU has them), 8 and 4 bits
    in float32 (the registers and the panels): the projections never leave their fixed order (never the
    dequantized GEMM, which a prompt of more than 64 rows would take without the flag). The
    target, greedy and seeded, alone; then on one engine with half its prompt from the prefix cache, among 6
    others, its prompt in 7-token steps, n-gram speculation proposing once the batch is small."""
    model, options = quantized_models[weights]
    case = Case(model, dtype, "auto", [])
    alone = case.llm(enable_prefix_caching=False, **options)
    want = [_generate(alone, [TARGET], [p])[0] for p in (GREEDY, SEEDED)]
    llm = case.llm(max_num_batched_tokens=7, speculative_method="ngram", num_speculative_tokens=4, **options)
    proposed = _count_proposals(llm)
    _generate(llm, [TARGET[:48] + _random_prompt(random.Random(3), 30)], [GREEDY])
    prompts, params = _others(6)
    outs = _generate(
        llm, [*prompts[:3], TARGET, TARGET, *prompts[3:]], [*params[:3], GREEDY, SEEDED, *params[3:]]
    )
    assert outs[3]["num_cached_tokens"] == 48 and proposed[0] > 0
    _assert_identical(outs[3], want[0])
    _assert_identical(outs[4], want[1])


# --- the Triton kernels, in the interpreter on a CPU (compiled on a GPU) ---------------------------------

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_linear_gives_each_row_what_it_gives_the_row_alone(dtype):
    """37 rows (a partial 64-row tile) against a K of 200 (a partial 64-wide step): every row of the batch
    equals the row alone and the row in a batch of 3, bit for bit. Against PyTorch's float32 product of the
    same inputs, each output is within what two orders of summing K terms can differ by, 2 K u sum|x w|
    (u = 2^-24, the products' roundings included), plus one rounding of the output to `dtype`."""
    from nanovllm.kernels import triton_layers

    gen = torch.Generator().manual_seed(0)
    k = 200
    x = torch.randn(37, k, generator=gen).to(TRITON_DEVICE, dtype)
    weight = (torch.randn(80, k, generator=gen) / k**0.5).to(TRITON_DEVICE, dtype)
    bias = torch.randn(80, generator=gen).to(TRITON_DEVICE, dtype)
    batch = triton_layers.linear(x, weight, bias)
    for i in (0, 5, 34):
        assert torch.equal(triton_layers.linear(x[i : i + 1], weight, bias)[0], batch[i])
        assert torch.equal(triton_layers.linear(x[i : i + 3], weight, bias)[0], batch[i])
    xf, wf, bf = x.float(), weight.float(), bias.float()
    reference = torch.nn.functional.linear(xf, wf, bf)
    bound = 2 * k * 2**-24 * (xf.abs() @ wf.abs().T + bf.abs()) + torch.finfo(dtype).eps * reference.abs()
    assert ((batch.float() - reference).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_attention_gives_each_query_what_it_gives_the_query_alone(dtype):
    """A step of three decodes and three chunks (one past a 64-query tile) on the batch-invariant Triton
    backend: each query's output equals that query run alone (a decode of one row over the cache up to
    its position), bit for bit."""
    from nanovllm.kernels.attention import AttentionMetadata, ChunkBatch, DecodeBatch
    from nanovllm.kernels.backends import TritonAttention

    backend = TritonAttention(num_sms=1, batch_invariant=True)
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 4, 2, 32, 16
    k_cache, v_cache = (
        torch.randn(40, block, kv_heads, dim, generator=gen).to(TRITON_DEVICE, dtype) for _ in "kv"
    )
    tables = torch.randperm(40, generator=gen)[:36].view(6, 6).to(TRITON_DEVICE)
    decode_lens = [1, 17, 90]
    chunks = [(0, 70), (30, 5), (64, 1)]  # (start position, tokens) of sequences 3, 4, 5
    decode = DecodeBatch(tables[:3], torch.tensor(decode_lens, device=TRITON_DEVICE), block)
    loc = [0]
    for _, n in chunks:
        loc.append(loc[-1] + n)
    cached = ChunkBatch(
        query_start_loc=torch.tensor(loc, device=TRITON_DEVICE),
        start_positions=torch.tensor([s for s, _ in chunks], device=TRITON_DEVICE),
        block_tables=tables[3:],
        max_query_len=70,
        num_tokens=loc[-1],
        block_size=block,
    )
    meta = AttentionMetadata(slot_mapping=torch.empty(0), decode=decode, cached=cached)
    query = torch.randn(3 + loc[-1], heads, dim, generator=gen).to(TRITON_DEVICE, dtype)
    out = backend.forward(query, None, None, k_cache, v_cache, meta, dim**-0.5)
    alone_rows = [(tables[i], n) for i, n in enumerate(decode_lens)]
    alone_rows += [(tables[3 + s], start + j + 1) for s, (start, n) in enumerate(chunks) for j in range(n)]
    for t in (0, 1, 2, 3, 40, 72, 73, 77, 78):
        table, context = alone_rows[t]
        one = DecodeBatch(table[None], torch.tensor([context], device=TRITON_DEVICE), block)
        assert torch.equal(backend.decode(query[t : t + 1], k_cache, v_cache, one, dim**-0.5)[0], out[t]), t


@pytest.mark.slow
def test_triton_engine_gives_the_request_what_it_gives_it_alone(model_dirs):
    """The engine on the Triton kernels (attention, fused layers, projections) in bfloat16, in the
    interpreter: 40 tokens of the target alone, then beside two others with its prompt in 16-token chunks."""
    options = {"attention_backend": "triton", "enforce_eager": True, "device": TRITON_DEVICE.type}
    case = Case(model_dirs["qwen3"], "bfloat16", "auto", [])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompt = TARGET[:40]
    alone = _generate(case.llm(enable_prefix_caching=False, **options), [prompt], [params])[0]
    llm = case.llm(max_num_batched_tokens=16, enable_prefix_caching=False, **options)
    assert llm.engine.runner.kernel_backend == "triton"
    outs = _generate(llm, [[7, 8, 9] * 4, prompt, [300, 301] * 5], [params, params, params])
    _assert_identical(outs[1], alone)


@pytest.mark.slow
def test_four_tensor_parallel_ranks_give_the_request_what_they_give_it_alone(model_dirs):
    """Four ranks (two of them per kv head) in bfloat16 sum their partial projections in rank order: a
    ring all-reduce adds an element's parts in an order set by where it falls in the ring's chunks, which
    moves with the batch's size. The target alone, then in a batch of 8, on one engine."""
    case = Case(model_dirs["qwen3"], "bfloat16", "auto", [])
    llm = case.llm(tensor_parallel_size=4, device="cpu", enable_prefix_caching=False)
    try:
        alone = _generate(llm, [TARGET], [GREEDY])[0]
        prompts, params = _others(7)
        outs = _generate(llm, [*prompts[:3], TARGET, *prompts[3:]], [*params[:3], GREEDY, *params[3:]])
        _assert_identical(outs[3], alone)
    finally:
        llm.shutdown()


def test_auto_is_on_for_float_weights_and_off_for_quantized_ones(model_dirs, quantized_models, kernels):
    """deterministic=None: on for float weights on a CPU with the C++ kernels, off for every quantized and
    GGUF format (their batch-invariant kernel keeps prompts off PyTorch's GEMM), with the reason the worker
    logs at start; asked for, it is what was asked."""
    float_weights = EngineConfig(model=str(model_dirs["qwen3"]))
    assert float_weights.deterministic is True and float_weights.deterministic_reason.startswith("auto: on")
    for weights, (model, options) in quantized_models.items():
        model_dir, gguf_file = resolve_model(str(model))
        config = EngineConfig(model=model_dir, gguf_file=gguf_file, **options)
        assert config.deterministic is False, weights
        assert f"off for {config.weight_format} weights" in config.deterministic_reason, weights
    asked = EngineConfig(model=str(model_dirs["qwen3"]), quantization="int4", deterministic=True)
    assert asked.deterministic is True and asked.deterministic_reason == "asked for"
