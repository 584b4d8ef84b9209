"""Qwen3.5's hybrid model (worker/models/qwen3_5.py) against transformers' Qwen3_5ForCausalLM on small
random configs: float32 greedy tokens equal and teacher-forced logits within 1e-4 in prefill, chunked
prefill and decode, for two layer patterns, with prompts shorter and longer than a step's chunk in one
batch; bf16 within the top-5 rule; a preempted request recomputes its state; the published multimodal
layout served text-only; what it does not run refused at start, naming it."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.common.block_hash import prefix_hashes
from nanovllm.common.errors import ConfigError, RequestError, UnsupportedModelError
from nanovllm.common.v1 import worker_pb2
from nanovllm.kernels.fla_gated_delta import fla_unavailable
from nanovllm.router.calls.validation import validate_generate
from nanovllm.router.fleet.tokenizer import ModelTokenizer
from nanovllm.router.fleet.workers import WorkerConnection
from nanovllm.v1 import generate_pb2
from nanovllm.worker.core.recurrent_states import RecurrentStates
from nanovllm.worker.layers.gated_delta_rule import causal_conv_step, chunked, recurrent_step
from nanovllm.worker.layers.kernels import LayerKernels
from nanovllm.worker.layers.quantization import PackedWeight
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.qwen3_5 import GatedRMSNorm, Qwen3_5ForCausalLM
from nanovllm.worker.runner.kv_cache import kv_bytes_per_block
from nanovllm.worker.service.metrics import WorkerMetrics
from nanovllm.worker.service.server import TOKENIZER_FILES
from tests.chat_templates import QWEN3
from tests.helpers import (
    QUANTIZED_LOGPROB_TOL,
    QUANTIZED_TOP_GAP,
    assert_within_float32_rounding,
    compare_tp,
    decode_layers_on_and_off,
    float32_references,
    greedy,
    greedy_with_logprobs,
    hf_greedy,
    hf_model,
    teacher_forced_logits,
    top5_rule,
)
from tests.model_factory import CHAT_TEMPLATE, build_model, build_tokenizer
from tests.resume_streams import MAX_TOKENS as RESUME_MAX_TOKENS
from tests.resume_streams import run as resume_run
from tests.services import collect, held_streams, router_and_worker, wait_idle
from tests.test_decode_graphs import CountingReplay
from tests.top5 import assert_close, random_prompts, run_case

MAX_NEW = 16
PATTERNS = {  # name: (architecture, layers, layer_types; None: transformers' default, every 4th layer full)
    "default-3to1": ("qwen3_5", 4, None),
    "full-first": ("qwen3_5", 3, ["full_attention", "linear_attention", "linear_attention"]),
    # 8 experts (2 a token) and a shared expert in every layer (tests/model_factory.py)
    "moe-3to1": ("qwen3_5_moe", 4, None),
}
ENGINE = {"max_model_len": 512, "kv_cache_memory": "16MiB", "dtype": "float32"}


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 9, 40, 77, 150)]


def _build(root: Path, pattern: str, **overrides) -> Path:
    arch, layers, types = PATTERNS[pattern]
    changes = {"layer_types": types} if types else {}
    return build_model(arch, root / pattern, num_layers=layers, seed=3, overrides={**changes, **overrides})


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def hybrid_model(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen3_5"), request.param)


def _all_back(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return (
        bm.num_free_blocks == bm.num_blocks and len(bm.states.free_slots) == llm.engine.runner.num_state_slots
    )


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_tokens_and_logits_equal_transformers(hybrid_model: Path, backend: str):
    """One batch of prompts of 1 to 150 tokens with 64-token steps: the long ones chunked, their state
    carried from step to step; then every position's logits fed 1000 (prefill), 7 (chunks that cross the
    rule's 64-token blocks) and 1 (decode) tokens a step. On the C++ kernels (auto on a CPU: decode steps
    update the state rows in place) and on PyTorch's ops."""
    llm = LLM(str(hybrid_model), max_num_batched_tokens=64, attention_backend=backend, **ENGINE)
    prompts = _prompts()
    outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(hybrid_model, prompt, MAX_NEW)
    references = [float32_references(hybrid_model, prompt) for prompt in prompts[1:]]
    for chunk in (1000, 7, 1):
        for index, logits in enumerate(teacher_forced_logits(llm, prompts[1:], chunk)):
            assert_within_float32_rounding(logits.cpu(), *references[index], f"chunk {chunk} prompt {index}")
    assert _all_back(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_decode_kernels_compute_the_recurrent_step(kernels, dtype: torch.dtype):
    """kernels/csrc/gated_delta_cpu.cpp against worker/layers/gated_delta_rule.py on 5 sequences in rows
    3, 0, 7, 5, 1 of 8 (the other rows untouched): float32 rounding apart (the decay is applied to the
    state's read after the sum there, before it here); in bf16 the inputs are bf16 and the arithmetic
    float32 in both, and the convolution's output rounds to bf16 in both (here its sum in another order
    than F.conv1d's: one rounding step apart at most)."""
    if kernels is None:
        pytest.skip("the C++ CPU kernels did not build here")
    gen = torch.Generator().manual_seed(1)
    batch, key_heads, heads, dk, dv, channels, width = 5, 2, 4, 16, 8, 24, 4
    slots = torch.tensor([3, 0, 7, 5, 1])
    conv_state = torch.randn(8, channels, width - 1, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    x = torch.randn(batch, channels, generator=gen).to(dtype)
    want, want_state = causal_conv_step(x, weight, conv_state[slots])
    expected_rest = conv_state.clone()
    got = kernels.causal_conv_decode_(x, conv_state, weight, slots)
    # The sums in another order: float32 rounding apart, or one bf16 rounding step of the output.
    step = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.float(), want.float(), atol=step, rtol=step)
    assert torch.equal(conv_state[slots], want_state)
    untouched = torch.ones(8, dtype=torch.bool).index_fill_(0, slots, False)
    assert torch.equal(conv_state[untouched], expected_rest[untouched])
    q, k = (torch.randn(batch, key_heads, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(batch, heads, dv, generator=gen).to(dtype)
    g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
    state = torch.randn(8, heads, dk, dv, generator=gen)
    before = state.clone()
    want_out, want_rows = recurrent_step(q, k, v, g, beta, state[slots])
    out = kernels.gated_delta_decode_(q, k, v, g, beta, state, slots)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[slots], want_rows, atol=1e-5, rtol=1e-5)
    # into a buffer of the model's dtype (the module path's): the float32 output rounded to it
    into = torch.full((batch, heads, dv), float("nan"), dtype=dtype)
    kernels.gated_delta_decode_(q, k, v, g, beta, before, slots, out=into)
    assert torch.equal(into, out.to(dtype)) and torch.equal(before, state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "key_heads, heads, dk, dv, width", [(2, 4, 16, 24, 4), (3, 3, 32, 16, 2), (1, 2, 8, 40, 6)]
)
def test_the_cpu_linear_attention_step_is_the_four_kernels_bit_for_bit(
    kernels, dtype, key_heads, heads, dk, dv, width
):
    """kernels' linear_attention_decode_ (the C++ decode layers' one call between a Gated DeltaNet layer's
    projections) equals causal_conv_decode_, delta_gates, gated_delta_decode_ and gated_rms_norm in turn, bit
    for bit, on 3 sequences in rows 4, 0, 2 of 5 (the others untouched): value heads one or two a key head,
    head dims under a 16-channel block and past it, convolutions 2 to 6 wide; a projection of the wrong width
    is refused by its numbers."""
    if kernels is None:
        pytest.skip("the C++ CPU kernels did not build here")
    gen = torch.Generator().manual_seed(dk * width + heads)
    batch, rows, eps = 3, 5, 1e-6
    slots = torch.tensor([4, 0, 2])
    key_size, value_size = key_heads * dk, heads * dv
    channels = 2 * key_size + value_size
    projected = (torch.randn(batch, channels + value_size + 2 * heads, generator=gen) * 2).to(dtype)
    gate = F.silu(torch.randn(batch, value_size, generator=gen))
    conv_state = torch.randn(rows, channels, width - 1, generator=gen).to(dtype)
    conv_weight = torch.randn(channels, width, generator=gen).to(dtype)
    state = torch.randn(rows, heads, dk, dv, generator=gen)
    a_log, dt_bias = (torch.randn(heads, generator=gen).to(dtype) for _ in range(2))
    norm_weight = (1 + torch.randn(dv, generator=gen) / 4).to(dtype)
    convs, states = conv_state.clone(), state.clone()

    mixed, _, b, a = projected.split([channels, value_size, heads, heads], -1)
    q, k, v = kernels.causal_conv_decode_(mixed, convs, conv_weight, slots).split(
        [key_size, key_size, value_size], -1
    )
    g, beta = kernels.delta_gates(a, b, a_log, dt_bias)
    core = kernels.gated_delta_decode_(
        q.reshape(batch, key_heads, dk), k.reshape(batch, key_heads, dk), v.reshape(batch, heads, dv), g, beta,
        states, slots,
    )  # fmt: skip
    want = kernels.gated_rms_norm(core.view(-1, dv), gate.view(-1, dv), norm_weight, eps).view(batch, -1)

    args = (conv_state, conv_weight, state, a_log, dt_bias, norm_weight, slots, key_heads, dk, heads, dv, eps)
    got = kernels.linear_attention_decode_(projected, gate, *args)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(conv_state, convs) and torch.equal(state, states)  # the rows updated, the others kept
    with pytest.raises(RuntimeError, match=f"projected must be \\[B, {channels + value_size + 2 * heads}\\]"):
        kernels.linear_attention_decode_(projected[:, :-1], gate, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, d, rotary", [(8, 2, 256, 64), (4, 2, 16, 16), (2, 1, 32, 8)])
def test_the_cpu_gated_qk_norm_rope_is_the_modules_ops_bit_for_bit(
    kernels, dtype, heads, kv_heads, d, rotary
):
    """kernels' gated_qk_norm_rope (the decode step's one call) equals the ops the module path runs on the
    C++ kernels bit for bit: rms_norm_fp32_weight of the q and k heads concatenated (each q head read past
    its gate), rotary on their first `rotary` dims, the rest passed."""
    if kernels is None:
        pytest.skip("the C++ CPU kernels did not build here")
    gen = torch.Generator().manual_seed(d + rotary)
    tokens = 3
    qkv = (torch.randn(tokens, (2 * heads + 2 * kv_heads) * d, generator=gen) * 3).to(dtype)
    weight = 1 + torch.randn(heads + kv_heads, d, generator=gen) / 4
    angles = torch.rand(tokens, 1, rotary // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    q = qkv[:, : 2 * heads * d].view(tokens, heads, 2 * d)[..., :d]
    k = qkv[:, 2 * heads * d :].view(tokens, 2 * kv_heads, d)[:, :kv_heads]
    normed = kernels.rms_norm_fp32_weight(torch.cat([q, k], 1), weight, 1e-6)
    want = torch.cat([kernels.rotary(normed[..., :rotary], cos, sin), normed[..., rotary:]], -1)
    got = kernels.gated_qk_norm_rope(qkv, heads, kv_heads, d, weight, 1e-6, cos, sin)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="qkv must be"):
        kernels.gated_qk_norm_rope(qkv[:, :-1], heads, kv_heads, d, weight, 1e-6, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [8, 20, 40, 96, 100, 128, 264, 504])
def test_the_cpu_gated_norm_is_the_modules_bit_for_bit(kernels, dtype: torch.dtype, dim: int):
    """kernels' gated_rms_norm (the decode step's) equals GatedRMSNorm on PyTorch (transformers' roundings)
    bit for bit: the same roundings, and the variance summed in PyTorch's order (on these rows, values of
    sizes spread over e^+-6, a float32 sum taken in sequence differs from PyTorch's in 33 of 64 rows at
    dim 20 and 56 of 64 at 128); dims with and without whole 8-lane vectors and whole fours of them."""
    gen = torch.Generator().manual_seed(dim)
    rows = 64
    scale = torch.exp(torch.randn(rows, dim, generator=gen) * 2)  # magnitudes spread over e^(+-6)
    core = torch.randn(rows, dim, generator=gen) * scale
    gate = torch.randn(rows, dim, generator=gen).to(dtype)
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            norm = GatedRMSNorm(dim, 1e-6)
        finally:
            torch.set_default_dtype(torch.float32)
    norm.weight.data = (1 + torch.randn(dim, generator=gen) / 4).to(dtype)
    want = norm(core.to(dtype), gate)
    got = kernels.gated_rms_norm(core, F.silu(gate.float()), norm.weight.data, 1e-6)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="gated_rms_norm: rows of 512 values"):
        kernels.gated_rms_norm(torch.ones(1, 512), torch.ones(1, 512), torch.ones(512, dtype=dtype), 1e-6)


TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_the_triton_kernels_compute_the_recurrent_step():
    """kernels/triton_gated_delta.py (in Triton's interpreter on a CPU, compiled on a GPU) against
    worker/layers/gated_delta_rule.py in float32: 5 sequences in rows 3, 0, 7, 5, 1 of 8 (float32 rounding
    apart), and a 9-token chunk of one sequence equal bit for bit to its tokens as 9 decode steps."""
    from nanovllm.kernels import triton_gated_delta as tgd

    gen = torch.Generator().manual_seed(2)
    batch, key_heads, heads, dk, dv, channels, width = 5, 2, 4, 16, 64, 40, 4
    slots = torch.tensor([3, 0, 7, 5, 1])

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(TRITON_DEVICE)

    conv_state = torch.randn(8, channels, width - 1, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    x = torch.randn(batch, channels, generator=gen)
    want, want_state = causal_conv_step(x, weight, conv_state[slots])
    state_dev = dev(conv_state)
    got = tgd.causal_conv_decode_(dev(x), state_dev, dev(weight), dev(slots))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(state_dev[dev(slots)].cpu(), want_state)
    q, k = (torch.randn(batch, key_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(batch, heads, dv, generator=gen)
    g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
    state = torch.randn(8, heads, dk, dv, generator=gen)
    want_out, want_rows = recurrent_step(q, k, v, g, beta, state[slots])
    again = dev(state.clone())
    state_dev = dev(state)
    out = tgd.gated_delta_decode_(dev(q), dev(k), dev(v), dev(g), dev(beta), state_dev, dev(slots))
    torch.testing.assert_close(out.cpu(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_dev[dev(slots)].cpu(), want_rows, atol=1e-5, rtol=1e-5)
    # into a bf16 buffer (the module path's, no copy after the kernel): the float32 output rounded to it
    into = dev(torch.full((batch, heads, dv), float("nan"))).bfloat16()
    tgd.gated_delta_decode_(dev(q), dev(k), dev(v), dev(g), dev(beta), again, dev(slots), out=into)
    assert torch.equal(into, out.bfloat16()) and torch.equal(again, state_dev)
    # a chunk against the same tokens one decode step at a time, on another row each
    n = 9
    q, k = (dev(torch.randn(n, key_heads, dk, generator=gen)) for _ in range(2))
    v, x = dev(torch.randn(n, heads, dv, generator=gen)), dev(torch.randn(n, channels, generator=gen))
    g, beta = dev(-torch.rand(n, heads, generator=gen)), dev(torch.rand(n, heads, generator=gen))
    states, convs = dev(torch.zeros(2, heads, dk, dv)), dev(torch.zeros(2, channels, width - 1))
    chunk = tgd.gated_delta_chunk_(q, k, v, g, beta, states, 0)
    conv_chunk = tgd.causal_conv_chunk_(x, convs, dev(weight), 0)
    one = dev(torch.tensor([1]))
    steps = [
        tgd.gated_delta_decode_(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], states, one
        )
        for t in range(n)
    ]
    conv_steps = [tgd.causal_conv_decode_(x[t : t + 1], convs, dev(weight), one) for t in range(n)]
    assert torch.equal(chunk, torch.cat(steps)) and torch.equal(states[0], states[1])
    assert torch.equal(conv_chunk, torch.cat(conv_steps)) and torch.equal(convs[0], convs[1])
    # the convolution's chunk computes its tokens side by side: from a state that is not zero, chunks
    # shorter than the state, one block of tokens and three, in bf16 (its rounding before the SiLU)
    for n in (1, 2, 9, 70):
        x = dev(torch.randn(n, channels, generator=gen)).bfloat16()
        convs = dev(torch.randn(1, channels, width - 1, generator=gen).bfloat16().repeat(2, 1, 1))
        conv_chunk = tgd.causal_conv_chunk_(x, convs, dev(weight).bfloat16(), 0)
        conv_steps = [
            tgd.causal_conv_decode_(x[t : t + 1], convs, dev(weight).bfloat16(), one) for t in range(n)
        ]
        assert torch.equal(conv_chunk, torch.cat(conv_steps)) and torch.equal(convs[0], convs[1]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_gates_and_gated_norm_are_the_modules(dtype: torch.dtype):
    """kernels/triton_gated_delta.py's delta_gates, gated_rms_norm and sigmoid_mul (one launch each on a GPU,
    where PyTorch takes three to eight) against the PyTorch path they replace, with its roundings: beta
    rounded to the dtype, the normalised row rounded, times the weight rounded, times SiLU(gate) rounded; the
    sigmoid of the attention's gate rounded, times its output rounded. Their exp, log and sums
    differ from PyTorch's by a few float32 ulps (a 128-term sum of squares in another order: up to 128 ulp
    of it, half that after the square root): within 2e-5 relative in float32; in bf16 that moves an output
    across a rounding boundary now and then, so one bf16 step (2^-8 relative) and at most 1% of them."""
    from nanovllm.kernels import triton_gated_delta as tgd

    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim = 7, 4, 128
    a, b = (torch.randn(tokens, 3 * heads, generator=gen).to(dtype)[:, :heads] * 4 for _ in range(2))
    a[0, 0], a[1, 1] = 30.0, -30.0  # softplus's linear branch and log1p's small end
    a_log, dt_bias = torch.randn(heads, generator=gen).to(dtype), torch.randn(heads, generator=gen).to(dtype)
    g, beta = tgd.delta_gates(*(t.to(TRITON_DEVICE) for t in (a, b, a_log, dt_bias)))
    torch.testing.assert_close(beta.cpu(), b.sigmoid().float(), rtol=2e-5, atol=0)
    want_g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    torch.testing.assert_close(g.cpu(), want_g, rtol=2e-5, atol=0)
    norm = GatedRMSNorm(dim, 1e-6)
    norm.weight.data = (1 + torch.randn(dim, generator=gen) / 4).to(dtype)
    x = (torch.randn(tokens * heads, dim, generator=gen) * 3).to(dtype)
    z = torch.randn(tokens, 2 * heads * dim, generator=gen).to(dtype)[:, heads * dim :]  # a view, as given
    want = norm(x, z).float()
    dev = norm.weight.data.to(TRITON_DEVICE)
    got = tgd.gated_rms_norm(x.to(TRITON_DEVICE), z.to(TRITON_DEVICE), dev, 1e-6).cpu().float()
    # the attention's output gate: x times sigmoid(gate), gate the second half of each head's [q | gate]
    qg = torch.randn(tokens, heads, 2 * dim, generator=gen).to(dtype)
    out = torch.randn(tokens, heads * dim, generator=gen).to(dtype)
    gate = qg[..., dim:]
    got_gate = tgd.sigmoid_mul(out.to(TRITON_DEVICE), qg.to(TRITON_DEVICE)[..., dim:]).cpu().float()
    want_gate = (out * torch.sigmoid(gate.reshape(tokens, heads * dim))).float()
    for ours, theirs in ((got, want), (got_gate, want_gate)):
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=1e-6)
        else:
            apart = (ours - theirs).abs() > 2**-8 * theirs.abs()
            assert not apart.any() and (ours != theirs).float().mean() <= 0.01


def test_hybrid_decode_layers_launch_few_kernels(default_model: Path, monkeypatch):
    """A bf16 decode step on the CUDA path's code (Triton attention, gated-delta and fused layer kernels;
    graphs off, every launch visible, counted as tests/test_triton_layers.py counts Qwen3's): each linear
    layer launches at most 11 kernels and each gated-attention layer at most 10 (24-25 and 24 before the
    gates, the gated norm, the zero-centred norms, the SwiGLU gate, the output gate and the q/k norm with
    the partial RoPE and the K/V store were fused and the rule wrote its output in the model's dtype; on an
    H200 a 0.8B-shape step launched 933 kernels)."""
    from nanovllm.worker.models.qwen3_5 import HybridDecoderLayer
    from tests.test_triton_layers import step_launches

    llm = LLM(
        str(default_model), dtype="bfloat16", attention_backend="triton", kv_cache_memory="16MiB",
        max_model_len=64, enforce_eager=True, device=TRITON_DEVICE.type,
    )  # fmt: skip
    engine = llm.engine
    for i in range(3):
        engine.add_request(str(i), [5 + i, 6, 7, 8], greedy(4))
    engine.step()  # the prefill
    layers = [m for m in engine.runner.model.modules() if isinstance(m, HybridDecoderLayer)]
    stats, per_layer = step_launches(engine, layers, monkeypatch)
    counts: dict[str, list[int]] = {"linear": [], "attention": []}
    for layer, launches in zip(layers, per_layer, strict=True):
        counts["attention" if layer.is_full_attention else "linear"].append(launches)
    assert stats.num_decode_tokens == 3 and stats.num_prefill_tokens == 0
    assert counts["linear"] and counts["attention"]
    assert max(counts["linear"]) <= 11 and max(counts["attention"]) <= 10, counts


def test_the_triton_path_gives_transformers_tokens(default_model: Path):
    """The model on the Triton attention backend (in the interpreter on a CPU): its linear layers on
    kernels/triton_gated_delta.py, prompts token by token, decode steps on the state rows; float32
    greedy tokens equal transformers', prompts shorter and longer than a 16-token step."""
    llm = LLM(str(default_model), attention_backend="triton", max_num_batched_tokens=16, **ENGINE)
    prompts = _prompts()[:3]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(6), use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(default_model, prompt, 6)
    assert _all_back(llm)


REPLAY_PROMPTS = [[5, 6, 7], list(range(40, 75)), [9] * 17, list(range(100, 130)), [11, 12]]
REPLAY_PARAMS = [greedy(n) for n in (3, 9, 5, 7, 12)]
REPLAY_ENGINE = {**ENGINE, "max_num_seqs": 8, "state_snapshot_interval": 16}


def _two_rounds(llm: LLM) -> list[list[int]]:
    """The prompts, then each prompt with its answer and one more token: the second round resumes from the
    snapshots the first left at the boundaries its decode steps crossed."""
    first = [o["token_ids"] for o in llm.generate(REPLAY_PROMPTS, REPLAY_PARAMS, use_tqdm=False)]
    follow = [p + out + [3] for p, out in zip(REPLAY_PROMPTS, first)]
    second = llm.generate(follow, REPLAY_PARAMS, use_tqdm=False)
    assert sum(o["num_cached_tokens"] for o in second) > 0
    return first + [o["token_ids"] for o in second]


@pytest.fixture(scope="module")
def eager_rounds(default_model: Path) -> list[list[int]]:
    """Both rounds on the eager engine of the C++ path, which the Triton path's tokens equal
    (test_the_triton_path_gives_transformers_tokens: both are transformers'), so the Triton case does
    not run a second engine in the interpreter."""
    return _two_rounds(LLM(str(default_model), **REPLAY_ENGINE))


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_decode_steps_replay_from_graphs_with_their_state_slots(
    default_model: Path, eager_rounds: list[list[int]], backend: str
):
    """Decode steps through worker/runner/decode_graphs.py (EagerReplay: its static buffers and padding
    without a CUDA graph): each row's state slot from the static buffer, padding rows on the pad state
    row, zeroing, restores and the copies at block boundaries (snapshots every 16 tokens here) around the
    replay; five sequences ending one after another pass through buckets 8 to 1. Tokens equal the eager
    engine's, the second round's prefix hits included, and the pad row is the only other row written."""
    llm = LLM(str(default_model), **REPLAY_ENGINE, attention_backend=backend)
    replay = CountingReplay()
    llm.engine.runner.use_decode_graphs(replay)
    assert _two_rounds(llm) == eager_rounds and sum(replay.replayed.values()) > 0
    assert _all_back(llm)


def test_chunked_and_recurrent_forms_agree():
    """The rule's two forms on one sequence of 150 tokens from a state: float32 rounding apart (the
    engine's prefill uses one, its decode the other)."""
    gen = torch.Generator().manual_seed(0)
    n, key_heads, heads, dk, dv = 150, 2, 4, 16, 8
    q, k = torch.randn(n, key_heads, dk, generator=gen), torch.randn(n, key_heads, dk, generator=gen)
    v = torch.randn(n, heads, dv, generator=gen)
    g, beta = -torch.rand(n, heads, generator=gen), torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.1
    out, final = chunked(q, k, v, g, beta, state)
    step_state, steps = state.unsqueeze(0), []
    for t in range(n):
        o, step_state = recurrent_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], step_state
        )
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps), out, atol=1e-5, rtol=0)
    torch.testing.assert_close(step_state[0], final, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen3_5_default"), "default-3to1")


def test_bf16_meets_the_top5_rule(default_model: Path):
    """tests/test_dtypes.py's rule: the top-5 rule, logprobs within its bound, most prompts equal. The
    zero-centred norms multiply by 1 + w in fp32 and round once, as transformers does (a bf16 1 + w, or
    q/k normalised over all heads at once, each failed it)."""
    prompts = random_prompts()
    name, outcomes = run_case("qwen3.5", default_model, "bfloat16", "auto", prompts, 32, "32MiB")
    assert_close(name, "bfloat16", outcomes, min_exact=len(prompts) // 2)


def test_preempted_requests_recompute_their_state(default_model: Path):
    """The state of 8 requests and 20 blocks of 4 tokens for 8 requests growing to 60 tokens: requests
    are preempted, lose their blocks and state slot, and recompute both from their tokens; every token
    equals a roomy engine's, and every block and slot comes back."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(8, 30))] for _ in range(8)]
    roomy = LLM(str(default_model), **ENGINE)
    expected = [o["token_ids"] for o in roomy.generate(prompts, greedy(30), use_tqdm=False)]
    model = ModelConfig.from_pretrained_dir(default_model)
    # 8 slots and the pad row (worker/runner/decode_graphs.py), 20 blocks
    memory = 9 * Qwen3_5ForCausalLM.state_layout(model, 1).bytes_per_slot(4) + 20 * kv_bytes_per_block(
        model, 4, model.num_key_value_heads, 4
    )
    options = {**ENGINE, "max_model_len": 64, "kvcache_block_size": 4, "kv_cache_memory": memory}
    options.update(
        state_memory_fraction=(8 * Qwen3_5ForCausalLM.state_layout(model, 1).bytes_per_slot(4) + 1) / memory
    )
    tight = LLM(str(default_model), **options, max_num_seqs=8, max_num_batched_tokens=32)
    got = [o["token_ids"] for o in tight.generate(prompts, greedy(30), use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert _all_back(tight)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen3_5_moe"), "moe-3to1")


def _publish(model_dir: Path, out: Path, architecture: str) -> Path:
    """`model_dir` in the published checkpoints' multimodal layout: the text model's config under
    text_config, its tensors under model.language_model. (a MoE's experts fused: gate_up_proj
    [E, 2I, H] and down_proj [E, H, I] per layer), a vision tower's tensor and an MTP head beside them (no
    vision_config: the tower is not served; tests/test_qwen3_5_vision.py serves one)."""
    out.mkdir()
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            (out / item.name).write_bytes(item.read_bytes())
    text = json.loads((model_dir / "config.json").read_text())
    config = {
        "architectures": [architecture],
        "text_config": {**text, "architectures": None},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    (out / "config.json").write_text(json.dumps(config))
    tensors, experts = {}, {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        layer, dot, rest = name.partition(".mlp.experts.")
        if dot:  # <e>.<projection>.weight
            expert, projection, _ = rest.split(".")
            experts.setdefault(layer, {}).setdefault(projection, {})[int(expert)] = tensor
        else:
            tensors[name] = tensor
    for layer, projections in experts.items():
        count = len(projections["down_proj"])
        gate_up = [torch.cat([projections["gate_proj"][e], projections["up_proj"][e]]) for e in range(count)]
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [projections["down_proj"][e] for e in range(count)]
        )
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize(
    ("model", "architecture"),
    [
        ("default_model", "Qwen3_5ForConditionalGeneration"),
        ("moe_model", "Qwen3_5MoeForConditionalGeneration"),
    ],
)
def test_the_published_multimodal_layout_is_served_text_only(
    request, model: str, architecture: str, tmp_path: Path
):
    """Read from text_config and model.language_model.*, fused experts split as they load, the vision
    tower and MTP head not loaded: the same tokens as the text model's own checkpoint."""
    model_dir = request.getfixturevalue(model)
    published = _publish(model_dir, tmp_path / "published", architecture)
    prompts = _prompts()[1:3]
    want = LLM(str(model_dir), **ENGINE).generate(prompts, greedy(8), use_tqdm=False)
    got = LLM(str(published), **ENGINE).generate(prompts, greedy(8), use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]


def test_moe_bf16_is_as_close_to_float32_as_transformers_bf16(moe_model: Path):
    """bf16 teacher-forced logits against transformers' float32 ones: the engine's mean error over every
    position of four prompts within 1.5x transformers' own bf16 error. Not vLLM's top-5 rule: with
    random routers, bf16 rounding sends tokens through other experts (two router logits round equal), and
    the linear layers' state carries the difference to every later position: both engines' bf16 logits lie
    up to 5-10 logits from float32's at some positions (measured: mean 0.70 summed over the prompts for
    the engine, 0.70 for transformers), and each fails the rule against the other and against float32 on
    some prompt, at positions where float32's choice is clear."""
    prompts = random_prompts()[2:]
    llm = LLM(str(moe_model), **{**ENGINE, "dtype": "bfloat16"})
    ours_error = their_error = 0.0
    for prompt, ours in zip(prompts, teacher_forced_logits(llm, prompts, 1000)):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            exact = hf_model(moe_model)(ids).logits[0]
            theirs = hf_model(moe_model, torch.bfloat16)(ids).logits[0].float()
        ours_error += (ours.cpu() - exact).abs().mean().item()
        their_error += (theirs - exact).abs().mean().item()
    assert ours_error <= 1.5 * their_error, (ours_error, their_error)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("pattern", ["default-3to1", "moe-3to1"])
def test_quantized_weights_compute_with_their_quantized_values(
    tmp_path: Path, pattern: str, quantization: str
):
    """Every linear projection packed (attention's, the linear layers' fused in_proj and out_proj, the MLP
    or every expert and the shared one; the head at int8; not the router or the convolution). The packed
    kernel and F.linear on the same weights dequantized differ in float32's summation order only, which
    the hybrid amplifies at some positions (see tests/helpers.py assert_within_float32_rounding): teacher-forced logits in
    prefill and decode within 1e-4 of the float engine on the dequantized weights, or within 2x the spread
    between two correct float32 engines on those weights (the C++ and the PyTorch backends). The float
    engine picks its kernels as the quantized one does (`deterministic` as auto chose for the quantized
    weights): against the fixed-order kernels the quantized engine's GEMM differed by up to 5.0e-4 where
    the spread was 1.4e-4 (AVX-512 EPYC); matched, up to 4.3e-5 (the experts' few rows). A wrong scale or
    nibble moves them by 1e-2 and more. (The MoE's shared expert at 64 features: a group divides a row.)"""
    model = _build(tmp_path, pattern, shared_expert_intermediate_size=64)
    kwargs = {**ENGINE, "max_model_len": 256}
    quantized = LLM(str(model), quantization=quantization, exact_quantized_matmuls=True, **kwargs)
    packed = {n: m for n, m in quantized.engine.runner.model.named_modules() if isinstance(m, PackedWeight)}
    layers = [name for name in packed if ".layers." in name]
    assert len(layers) == 4 * (2 + (2 * 8 + 2 if pattern == "moe-3to1" else 2))
    assert len(packed) == len(layers) + 1  # the head (the embedding, when tied to it)
    engines = []
    for backend in ("auto", "torch"):
        same_kernels = {"deterministic": quantized.engine.config.deterministic} if backend == "auto" else {}
        engine = LLM(str(model), attention_backend=backend, **kwargs, **same_kernels)
        weights = dict(engine.engine.runner.model.named_parameters())
        with torch.no_grad():
            for name, weight in packed.items():
                weights[name].copy_(weight.dequantize(torch.float32))
        engines.append(engine)
    prompts = _prompts()[1:]
    for chunk in (1000, 1):
        logits = [teacher_forced_logits(llm, prompts, chunk) for llm in (quantized, *engines)]
        for index, (ours, ref, other) in enumerate(zip(*logits)):
            error, spread = (ours - ref).abs().max().item(), (ref - other).abs().max().item()
            assert error <= max(1e-4, 2 * spread), f"chunk {chunk} prompt {index}: {error:.2e} ({spread:.2e})"


@pytest.mark.parametrize(
    "pattern, dtype, quantization",
    [
        ("default-3to1", "bfloat16", "none"),
        ("full-first", "float32", "none"),
        ("default-3to1", "bfloat16", "int8"),
        ("moe-3to1", "bfloat16", "none"),
        ("moe-3to1", "float32", "int4"),
    ],
)
def test_decode_layers_equal_the_module_path(tmp_path: Path, pattern: str, dtype: str, quantization: str):
    """A decode-only step's hybrid layers as one C++ call (kernels/csrc/decode_layers_cpu.cpp: the state rows
    in place, the gated attention, the zero-centred norms, a sparse layer's experts and shared expert) run the
    modules' kernels in their order: tokens and logprobs equal bit for bit, one sequence and several, with a
    linear or a full-attention first layer, dense or sparse, float and packed weights."""
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (5, 23, 61)]
    params = SamplingParams(temperature=0.0, logprobs=5, ignore_eos=True, max_tokens=12)
    kwargs = {"dtype": dtype, "quantization": quantization, "max_model_len": 256, "kv_cache_memory": "32MiB"}
    # the MoE's shared expert at 64 features: a quantization group divides a row
    overrides = {"shared_expert_intermediate_size": 64} if pattern.startswith("moe") else {}
    fused, modules = decode_layers_on_and_off(
        _build(tmp_path, pattern, **overrides), prompts, params, **kwargs
    )
    assert fused == modules


def test_every_layer_with_a_kernel_variant_runs_on_the_cpu_kernels(default_model: Path, moe_model: Path):
    """bind_kernels reaches every module that holds a `kernels` choice: the attention's output gate was
    written for the C++ kernels but left on PyTorch by a list of classes that did not name it."""
    for model_dir in (default_model, moe_model):
        model = LLM(str(model_dir), **ENGINE, device="cpu").engine.runner.model
        unbound = [
            name for name, m in model.named_modules() if hasattr(m, "kernels") and m.kernels.cpu is None
        ]
        assert not unbound, f"{model_dir.name}: modules left on PyTorch: {unbound[:5]}"
        assert model.model.decode_layers is not None


def test_int8_keeps_the_top5_rule_as_on_qwen3(default_model: Path):
    """tests/test_quantization.py's rule for int8 on the dense random models, here on the hybrid."""
    rng = random.Random(29)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 7, 30, 90)]
    kwargs = {**ENGINE, "max_model_len": 256}
    plain = greedy_with_logprobs(LLM(str(default_model), **kwargs), prompts, 24)
    quantized = greedy_with_logprobs(LLM(str(default_model), quantization="int8", **kwargs), prompts, 24)
    assert top5_rule("qwen3_5", plain, quantized, QUANTIZED_TOP_GAP) <= QUANTIZED_LOGPROB_TOL["float32"]


def test_moe_two_ranks_equal_one(moe_model: Path):
    """Each expert's and the shared expert's intermediate features split across the ranks."""
    compare_tp(moe_model)


# The published Qwen3.6 and 3.8 text configs (both declare Qwen3.5's architectures), four layers each and
# narrow, with their head counts, ratios and fields: (architecture, hidden, heads, KV heads, overrides).
_FIELDS = {"full_attention_interval": 4, "attn_output_gate": True, "mamba_ssm_dtype": "float32",
           "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}  # fmt: skip
_ROPE = {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
         "mrope_interleaved": True, "mrope_section": [2, 1, 1]}  # fmt: skip
_DENSE_27B = {  # Qwen3.6-27B and 3.8-27B: 24 query heads over 4, linear 48 value heads over 16 keys
    "head_dim": 32, "intermediate_size": 216, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
}  # fmt: skip
SHAPES = {
    "qwen3.6-27b": ("qwen3_5", 64, 24, 4, {**_DENSE_27B, "mtp_num_hidden_layers": 1}),
    "qwen3.8-27b": ("qwen3_5", 64, 24, 4, {**_DENSE_27B, **_FIELDS}),
    # 256 experts, 8 a token, a shared expert; 16 query heads over 2, linear 32 value heads over 16 keys
    "qwen3.6-35b-a3b": ("qwen3_5_moe", 64, 16, 2, {
        **_FIELDS, "head_dim": 32, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    }),
}  # fmt: skip


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_published_qwen3_6_and_3_8_shapes_give_transformers_tokens(tmp_path: Path, shape: str):
    """Each shape's float32 greedy tokens equal transformers', as the text model's checkpoint and in the
    published multimodal layout its Hub repository ships."""
    arch, hidden, heads, kv_heads, overrides = SHAPES[shape]
    model = build_model(
        arch, tmp_path / "text", num_layers=4, hidden=hidden, heads=heads, kv_heads=kv_heads, seed=5,
        rope=_ROPE, overrides=overrides,
    )  # fmt: skip
    assert json.loads((model / "config.json").read_text()).get("mtp_num_hidden_layers") == 1
    prompts = _prompts()[1:4]
    want = [hf_greedy(model, prompt, 8) for prompt in prompts]
    multimodal = (
        "Qwen3_5MoeForConditionalGeneration" if arch == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    )
    published = _publish(model, tmp_path / "published", multimodal)
    for directory in (model, published):
        outs = LLM(str(directory), **ENGINE).generate(prompts, greedy(8), use_tqdm=False)
        assert [o["token_ids"] for o in outs] == want, directory.name


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            {"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
            ["layer_types", "sliding_attention"],
        ),
        ({"layer_types": ["linear_attention"] * 4}, ["layer_types", "no 'full_attention' layer"]),
        ({"attn_output_gate": False}, ["attn_output_gate"]),
        ({"layer_scale": [1.0, 1.0, 1.0, 1.0]}, ["layer_scale", "unknown"]),
        ({"mamba_ssm_dtype": "bfloat16"}, ["mamba_ssm_dtype='bfloat16'", "float32"]),
        ({"linear_num_value_heads": 3}, ["linear_num_value_heads=3", "linear_num_key_heads=2"]),
    ],
)
def test_a_config_it_does_not_implement_fails_at_start_naming_it(tmp_path: Path, change: dict, words):
    model = build_model("qwen3_5", tmp_path / "hybrid", num_layers=4, tokenizer=False)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError) as failure:
        LLM(str(model), dtype="float32")
    assert all(word in str(failure.value) for word in words), str(failure.value)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"speculative_method": "ngram"}, ["speculative_method"]),
        ({"deterministic": True, "attention_backend": "torch"}, ["deterministic"]),  # neither C++ nor Triton
    ],
)
def test_features_it_does_not_run_yet_are_refused_naming_them(default_model: Path, options: dict, words):
    with pytest.raises(ConfigError) as failure:
        LLM(str(default_model), **{**ENGINE, **options})
    assert all(word in str(failure.value) for word in words), str(failure.value)


def test_a_state_that_cannot_fit_fails_at_start_with_the_numbers(default_model: Path):
    with pytest.raises(ConfigError) as failure:
        LLM(str(default_model), **{**ENGINE, "kv_cache_memory": 20_000})
    message = str(failure.value)
    assert "MiB" in message and "state_memory_fraction=0.5" in message and "kv_cache_memory" in message


def test_requests_wait_for_a_state_slot_when_fewer_fit_than_max_num_seqs(default_model: Path):
    """Room for the state of 3 requests, max_num_seqs 8: three run at a time, the others wait for a
    slot, and all eight finish with the tokens of an engine that runs them all at once."""
    state = Qwen3_5ForCausalLM.state_layout(ModelConfig.from_pretrained_dir(default_model), 1).bytes_per_slot(
        4
    )
    memory = 2 * 2**20
    llm = LLM(str(default_model), **{**ENGINE, "kv_cache_memory": memory}, max_num_seqs=8,
              state_memory_fraction=(3 * state + 1) / memory, enable_prefix_caching=False)  # fmt: skip
    assert llm.engine.runner.num_state_slots == 3
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    want = LLM(str(default_model), **ENGINE).generate(prompts, greedy(12), use_tqdm=False)
    got = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert _all_back(llm)


def test_deterministic_bf16_gives_a_request_what_it_gives_it_alone(default_model: Path):
    """--deterministic in bf16 (on by default on a CPU): a 150-token request's tokens and logprobs are
    bit-identical alone, in a batch of five cut into 7-token steps, after a prefix-cache hit (its linear
    layers resumed from the snapshot another request left at 96 tokens), and preempted and recomputed.
    Prompt chunks run the decode step's arithmetic token by token (kernels/csrc/gated_delta_cpu.cpp)."""
    params = greedy(16)
    params.logprobs = 2
    options = {**ENGINE, "dtype": "bfloat16", "deterministic": True}
    target = _prompts()[4]
    alone = LLM(str(default_model), **options).generate([target], params, use_tqdm=False)[0]
    want = (alone["token_ids"], alone["logprobs"])
    chunked_llm = LLM(str(default_model), **options, max_num_batched_tokens=7)
    batch = chunked_llm.generate([*_prompts()[:4], target], params, use_tqdm=False)
    assert (batch[4]["token_ids"], batch[4]["logprobs"]) == want
    cached = LLM(str(default_model), **options, state_snapshot_interval=32)
    cached.generate([target[:100] + [3, 4, 5]], params, use_tqdm=False)
    hit = cached.generate([target], params, use_tqdm=False)[0]
    assert hit["num_cached_tokens"] == 96 and (hit["token_ids"], hit["logprobs"]) == want
    rng = random.Random(8)
    crowd = [[rng.randrange(2, 500) for _ in range(rng.randrange(20, 60))] for _ in range(6)]
    model = ModelConfig.from_pretrained_dir(default_model)
    state, block = (
        Qwen3_5ForCausalLM.state_layout(model, 1).bytes_per_slot(2),
        kv_bytes_per_block(model, 4, model.num_key_value_heads, 2),
    )
    memory = 8 * state + 56 * block  # 7 slots, the pad row, 56 blocks of 4 tokens for 7 requests of up to 166
    options.update(max_model_len=192, kvcache_block_size=4)
    tight = LLM(str(default_model), **{**options, "kv_cache_memory": memory}, max_num_seqs=7,
                state_memory_fraction=(7 * state + 1) / memory, enable_prefix_caching=False)  # fmt: skip
    crowded = tight.generate([*crowd, target], params, use_tqdm=False)[-1]
    assert tight.engine.scheduler.num_preemptions > 0
    assert (crowded["token_ids"], crowded["logprobs"]) == want


def _prompts_on(model_dir: Path, prompts_kernel, prompts: list[list[int]], params: SamplingParams, **options):
    """Outputs of `prompts`, then of the first again (a prefix hit), from a bf16 engine on the Triton kernels
    whose linear layers take their prompt chunks through `prompts_kernel` (None: token by token)."""
    from nanovllm.kernels import triton_gated_delta, triton_layers

    options = {**ENGINE, "dtype": "bfloat16", "attention_backend": "triton", **options}
    llm = LLM(
        str(model_dir), **options, enforce_eager=True, device=TRITON_DEVICE.type, state_snapshot_interval=32
    )
    runner = llm.engine.runner
    kernels = LayerKernels(
        triton=triton_layers, gated_delta=triton_gated_delta, gated_delta_prompts=prompts_kernel
    )
    runner.model.bind_kernels(runner.backend_choice.backend, kernels)
    walking = [layer.prompts_token_by_token for layer in runner.model.linear_attention_layers()]
    assert walking == [prompts_kernel is None] * len(walking)
    outs = llm.generate(prompts, params, use_tqdm=False)
    outs.append(llm.generate([prompts[0]], params, use_tqdm=False)[0])
    assert outs[-1]["num_cached_tokens"] == 32 and _all_back(llm)
    return outs


@pytest.mark.slow
def test_prompts_together_give_what_their_tokens_walked_give(default_model: Path):
    """LayerKernels.gated_delta_prompts (fla-core's chunked kernels on CUDA) takes a step's prompt chunks
    together, each sequence's cut where the step keeps a copy of its state, round after round. Given the
    token walk itself as that kernel (a sequence at a time), an engine must give the walking engine's
    token and logprobs bit for bit: three prompts, 16 tokens a step (chunks across steps), snapshots every
    32 tokens (inside chunks), and a hit resuming from one. A wrong row, slot, round or copy changes bits
    (a copy kept before its piece ran, planted, failed it at the hit)."""
    from nanovllm.kernels import triton_gated_delta

    def walk(q, k, v, g, beta, state, slots, lengths):
        outs, first = [], 0
        for slot, n in zip(slots, lengths, strict=True):
            rows = slice(first, first + n)
            outs.append(
                triton_gated_delta.gated_delta_chunk_(
                    q[rows], k[rows], v[rows], g[rows], beta[rows], state, slot
                )
            )
            first += n
        return torch.cat(outs)

    params = greedy(1)
    params.logprobs = 2
    prompts = [_prompts()[2][:34], [7, 8, 9] * 7, [300, 301] * 3]
    together, walked = (
        _prompts_on(default_model, kernel, prompts, params, max_num_batched_tokens=16)
        for kernel in (walk, None)
    )
    assert [(o["token_ids"], o["logprobs"]) for o in together] == [
        (o["token_ids"], o["logprobs"]) for o in walked
    ]


@pytest.mark.skipif(
    fla_unavailable(TRITON_DEVICE) is not None,
    reason=f"fla-core's kernels on a GPU: {fla_unavailable(TRITON_DEVICE)} (.ci/gpu hybrid runs this with it)",
)
def test_fla_prompts_meet_the_top5_rule_against_the_walk(default_model: Path):
    """fla-core's chunked prompts (kernels/fla_gated_delta.py) against the token walk, bf16 on a GPU: their
    sums differ (a chunk's matmuls), so vLLM's top-5 rule holds them, within a few bf16 roundings."""
    from nanovllm.kernels.fla_gated_delta import gated_delta_prompts_

    params = greedy(8)
    params.logprobs = 5
    prompts = [_prompts()[3], _prompts()[4], [7, 8, 9] * 30]
    fla, walked = (
        _prompts_on(default_model, kernel, prompts, params) for kernel in (gated_delta_prompts_, None)
    )
    # 1.0 nats: 8 bf16 roundings of logits in [16, 32) (tests/top5.py's LOGPROB_TOL for bf16)
    assert top5_rule("fla-core against the walk", fla, walked) <= 1.0


@pytest.mark.slow
def test_deterministic_on_triton_gives_a_request_what_it_gives_it_alone(default_model: Path):
    """--deterministic on the Triton kernels (CUDA's path; Triton's interpreter on a CPU), bf16: a request's
    tokens and logprobs bit-identical alone, beside two others with its prompt in 8-token chunks, and after
    a prefix-cache hit (its linear layers resumed from a snapshot at 32). The Triton gated-delta kernels walk
    a chunk's tokens as decode steps do; the projections and attention are Triton's batch-invariant ones."""
    params = greedy(3)
    params.logprobs = 2
    options = {**ENGINE, "dtype": "bfloat16", "deterministic": True, "attention_backend": "triton"}
    options.update(enforce_eager=True, device=TRITON_DEVICE.type, state_snapshot_interval=32)
    target = _prompts()[2]  # 40 tokens
    alone = LLM(str(default_model), **options, enable_prefix_caching=False)
    assert alone.engine.runner.kernel_backend == "triton"
    first = alone.generate([target], params, use_tqdm=False)[0]
    want = (first["token_ids"], first["logprobs"])
    llm = LLM(str(default_model), **options, max_num_batched_tokens=8)
    batch = llm.generate([[7, 8, 9] * 4, target, [300, 301] * 5], params, use_tqdm=False)
    assert (batch[1]["token_ids"], batch[1]["logprobs"]) == want
    hit = llm.generate([target], params, use_tqdm=False)[0]
    assert hit["num_cached_tokens"] == 32 and (hit["token_ids"], hit["logprobs"]) == want


def test_a_repeated_prefix_resumes_from_its_state_snapshot(default_model: Path):
    """Two prompts sharing 200 tokens, one after the other, blocks of 16 and a snapshot every 64 tokens:
    the second resumes its linear layers from the snapshot at 192 (the last block with one) and its
    attention from the cached blocks; its tokens equal transformers' and a cache-less engine's."""
    rng = random.Random(7)
    shared = [rng.randrange(2, 512) for _ in range(200)]
    first, second = shared + [5, 6, 7, 8], shared + [9, 10, 11]
    llm = LLM(str(default_model), **ENGINE, state_snapshot_interval=64)
    llm.generate([first], greedy(MAX_NEW), use_tqdm=False)
    out = llm.generate([second], greedy(MAX_NEW), use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 192
    assert out["token_ids"] == hf_greedy(default_model, second, MAX_NEW)
    plain = LLM(str(default_model), **ENGINE, enable_prefix_caching=False)
    assert out["token_ids"] == plain.generate([second], greedy(MAX_NEW), use_tqdm=False)[0]["token_ids"]
    assert _all_back(llm)


def _offline_link() -> WorkerConnection:
    """A router's link to a worker it never dials (its bookkeeping alone), made inside an event loop as the
    router makes it: its gRPC channel asks for the current loop, and outside one that depended on whether
    an earlier test in the same process had left one (asyncio.run clears it), so the test failed or
    passed by the order pytest-xdist's `load` distribution gave it."""

    async def make() -> WorkerConnection:
        return WorkerConnection("127.0.0.1:9", prepare=None)

    return asyncio.run(make())


def test_the_router_counts_a_hybrid_workers_hit_to_its_last_snapshot(default_model: Path):
    """A hybrid worker reports the blocks that end at a state snapshot (resume points) beside its cached
    blocks; the router's link counts a prompt's cached prefix only up to the last of them: a 230-token
    shared prefix (blocks of 16, snapshots every 64) has 14 blocks of KV cached but resumes at 192, the
    hit the engine makes."""
    rng = random.Random(7)
    shared = [rng.randrange(2, 512) for _ in range(230)]
    llm = LLM(str(default_model), **ENGINE, state_snapshot_interval=64)
    llm.generate([shared + [rng.randrange(2, 512) for _ in range(40)]], greedy(4), use_tqdm=False)
    bm = llm.engine.block_manager
    changes = bm.take_cache_events()
    assert changes.state.stored == set(bm.states.cache) and bm.states.cache
    link = _offline_link()
    link._apply(
        worker_pb2.PrefixCacheEvents(
            reset=True, stored=sorted(bm.cached), resume_points=True, state_stored=bm.state_cached()
        )
    )
    second = shared + [9, 10, 11]
    expected = link.cached_prefix_blocks(prefix_hashes(second, 16))
    assert expected * 16 == llm.generate([second], greedy(4), use_tqdm=False)[0]["num_cached_tokens"] == 192
    assert (
        len([h for h in prefix_hashes(second, 16) if h in link.cached_blocks]) > expected
    )  # KV goes further


def _router_tokenizer(template: str, root: Path) -> ModelTokenizer:
    """The test tokenizer with `template` (Qwen3's with its markers as added tokens), as a worker sends it."""
    hf = build_tokenizer(template)
    if template == QWEN3:
        hf.add_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"])
    hf.save_pretrained(root)
    files = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}
    return ModelTokenizer(worker_pb2.WorkerInfo(model="m", tokenizer_files=files))


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, QWEN3], ids=["chatml", "qwen3"])
def test_the_router_finds_where_a_chats_last_user_message_begins(template: str, tmp_path: Path):
    """For a worker that takes the hint (WorkerInfo.shared_prefix_hints), a chat's prompt says how many of
    its tokens come before its last user message's content, on the tests' two templates: chats with the
    same earlier messages (a system prompt, a turn with reasoning, with Qwen3's a tool call and its result)
    agree on exactly those tokens and part right after, an empty question and one starting with a space
    included. A worker that does not take it gets 0, as does a chat with no user message."""
    tokenizer = _router_tokenizer(template, tmp_path)
    info = worker_pb2.WorkerInfo(model="m", max_model_len=4096, vocab_size=512, shared_prefix_hints=True)
    message = generate_pb2.ChatMessage
    history = [
        message(role="system", content="You are a terse assistant. " * 8),
        message(role="user", content="Weather in Paris?"),
        message(role="assistant", content="<think>\nlook it up\n</think>\n\nOne moment."),
    ]
    if template == QWEN3:
        call = generate_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
        history += [
            message(role="assistant", content="", tool_calls=[call]),
            message(role="tool", content="18C, sunny", tool_call_id="call_1"),
            message(role="assistant", content="18C and sunny."),
        ]
    prompts = []
    for question in ("And in Rome?", " and Oslo", ""):
        chat = generate_pb2.Chat(messages=[*history, message(role="user", content=question)])
        valid = validate_generate(generate_pb2.GenerateRequest(chat=chat), tokenizer, info)
        ids, before = valid.prompt_token_ids, valid.shared_prefix_tokens
        text = tokenizer.backend.decode(ids)
        assert tokenizer.backend.decode(ids[:before]) == text[: text.rindex(question + "<|im_end|>")]
        prompts.append((ids, before))
    assert len({tuple(ids[:before]) for ids, before in prompts}) == 1
    assert len({ids[before] for ids, before in prompts}) == 3  # each question's own first token
    plain = worker_pb2.WorkerInfo(model="m", max_model_len=4096, vocab_size=512)
    chat = generate_pb2.Chat(messages=[*history, message(role="user", content="And in Rome?")])
    assert (
        validate_generate(generate_pb2.GenerateRequest(chat=chat), tokenizer, plain).shared_prefix_tokens == 0
    )
    alone = generate_pb2.Chat(messages=[message(role="system", content="Be brief.")])
    assert (
        validate_generate(generate_pb2.GenerateRequest(chat=alone), tokenizer, info).shared_prefix_tokens == 0
    )


def test_the_router_counts_a_hinted_snapshot_while_its_request_is_in_flight(default_model: Path):
    """A request with a shared_prefix_tokens hint goes to a hybrid worker in its Submit, and until the
    worker reports the snapshot it leaves there, the router counts that block as a resume point, as it
    counts the request's blocks as cached: a burst sharing a system prompt finds the first one's worker.
    The worker keeps it at the block boundary at or below the hint."""
    rng = random.Random(3)
    system = [rng.randrange(2, 512) for _ in range(300)]
    first, second = system + [5, 6, 7], system + [8, 9]
    link = _offline_link()
    link.info, link.connected = worker_pb2.WorkerInfo(kvcache_block_size=16), True
    link._apply(worker_pb2.PrefixCacheEvents(reset=True, resume_points=True))
    link.submit("a", first, greedy(4), 0, block_hashes=prefix_hashes(first, 16), shared_prefix_tokens=300)
    assert link._outbound.get_nowait().submit.shared_prefix_tokens == 300
    assert link.cached_prefix_blocks(prefix_hashes(second, 16)) == 18  # 288 tokens: the hint's boundary
    link.release("a", abort=False)
    assert link.cached_prefix_blocks(prefix_hashes(second, 16)) == 0
    llm = LLM(str(default_model), **ENGINE)
    llm.engine.add_request("a", first, greedy(2), shared_prefix_tokens=300)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.block_manager.states.resumes_at(prefix_hashes(first, 16)[17])
    with pytest.raises(RequestError, match="shared_prefix_tokens is 304, outside the prompt's 303 tokens"):
        llm.engine.add_request("b", first, greedy(2), shared_prefix_tokens=304)


def test_a_chats_second_request_resumes_where_its_last_user_message_begins(
    default_model: Path, kernels, tmp_path: Path
):
    """Through a router's chat API to a Qwen3.5 worker (default flags, float32): the worker says it takes
    the hint, the router sends where each chat's last user message begins, the worker keeps a snapshot at
    the block boundary at or below it, and the second chat with the same system prompt already resumes
    there; the answers equal the offline engine's without a prefix cache."""
    chats = [
        generate_pb2.Chat(
            messages=[
                generate_pb2.ChatMessage(role="system", content="You are terse. Answer in one line. " * 8),
                generate_pb2.ChatMessage(role="user", content=question),
            ]
        )
        for question in ("Why is the sky blue?", "Name a prime number.")
    ]
    params = generate_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with router_and_worker(default_model, tmp_path) as (_, router):
        streams = [
            collect(
                router.address, generate_pb2.GenerateRequest(chat=c, sampling=params, return_token_ids=True)
            )[0]
            for c in chats
        ]
    # The hint as the router works it out, from the files the worker sends.
    files = {n: (default_model / n).read_bytes() for n in TOKENIZER_FILES if (default_model / n).is_file()}
    tokenizer = ModelTokenizer(worker_pb2.WorkerInfo(model="m", tokenizer_files=files))
    info = worker_pb2.WorkerInfo(model="m", max_model_len=512, vocab_size=512, shared_prefix_hints=True)
    valid = [validate_generate(generate_pb2.GenerateRequest(chat=c), tokenizer, info) for c in chats]
    assert valid[1].shared_prefix_tokens >= 16
    assert [r[-1].usage.cached_prompt_tokens for r in streams] == [
        0,
        valid[1].shared_prefix_tokens // 16 * 16,
    ]
    plain = LLM(str(default_model), **ENGINE, enable_prefix_caching=False)
    expected = plain.generate([v.prompt_token_ids for v in valid], greedy(4), use_tqdm=False)
    assert [[t for r in stream for t in r.token_ids] for stream in streams] == [
        o["token_ids"] for o in expected
    ]


def _conversation_hit_rate(model_dir: Path, turns: int, **options) -> tuple[float, list[list[int]]]:
    """An 8-turn conversation, each turn's prompt the whole conversation so far and a new user message:
    the prefix cache's hit rate and each turn's answer."""
    rng = random.Random(11)
    llm = LLM(str(model_dir), max_model_len=1024, kv_cache_memory="32MiB", dtype="float32", **options)
    conversation, answers = [], []
    for _ in range(turns):
        conversation += [rng.randrange(2, 512) for _ in range(rng.randrange(20, 40))]
        answer = llm.generate([conversation], greedy(24), use_tqdm=False)[0]["token_ids"]
        answers.append(answer)
        conversation += answer
    return llm.engine.block_manager.prefix_cache_hit_rate, answers


def test_a_conversations_turns_hit_as_on_qwen3(default_model: Path, qwen3_dir: Path):
    """Each turn leaves a snapshot at its last block boundary, so the next turn resumes there: the hit
    rate within 10 points of the same conversation on a Qwen3 model (whose cache has no state to keep),
    and the answers equal a cache-less engine's."""
    hybrid, answers = _conversation_hit_rate(default_model, 8)
    dense, _ = _conversation_hit_rate(qwen3_dir, 8)
    assert hybrid >= dense - 0.10, (hybrid, dense)
    assert answers == _conversation_hit_rate(default_model, 8, enable_prefix_caching=False)[1]


def _system_prompt_requests(
    model_dir: Path, hint: bool, bursts: tuple[int, ...] = (1,) * 32, **options
) -> tuple[LLM, list[list[int]], list[int]]:
    """Requests sharing a 300-token system prompt, each with its own 15-29 token question, in `bursts`
    (each burst's requests queued at once, run to the end before the next; 32 one after another by
    default), default flags but the memory (float32); with `hint` each says where its question begins,
    as the router's chat API does (Submit.shared_prefix_tokens). Each one's tokens and cached tokens."""
    rng = random.Random(13)
    system = [rng.randrange(2, 512) for _ in range(300)]
    llm = LLM(str(model_dir), max_model_len=1024, kv_cache_memory="32MiB", dtype="float32", **options)
    engine, tokens, cached = llm.engine, [], []
    for size in bursts:
        ids = [str(len(tokens) + i) for i in range(size)]
        got: dict[str, list[int]] = {i: [] for i in ids}
        for request_id in ids:
            question = [rng.randrange(2, 512) for _ in range(rng.randrange(15, 30))]
            hint_tokens = len(system) if hint else 0
            engine.add_request(request_id, system + question, greedy(2), shared_prefix_tokens=hint_tokens)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                got[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finished[out.request_id] = out.num_cached_tokens
        tokens += [got[i] for i in ids]
        cached += [finished[i] for i in ids]
    return llm, tokens, cached


def test_a_shared_system_prompt_hits_as_on_qwen3(default_model: Path, qwen3_dir: Path):
    """Issue 81's workload: 32 requests sharing a 300-token system prompt (blocks of 16: 18 blocks shared),
    one after another, default flags. Without a hint (raw prompts, the offline API) the second finds 288
    tokens of KV cached but no state there: it computes them and leaves a snapshot at 288, where the others
    resume; with the router's hint the first leaves it. The hit rate within 10 points of Qwen3's on the
    same workload (it was 0), the tokens a cache-less engine's, every block and slot back."""
    dense, _, _ = _system_prompt_requests(qwen3_dir, hint=False)
    rates = {}
    for hint in (False, True):
        llm, tokens, cached = _system_prompt_requests(default_model, hint)
        assert cached[:3] == ([0, 288, 288] if hint else [0, 0, 288])
        rates[hint] = llm.engine.block_manager.prefix_cache_hit_rate
        assert rates[hint] >= dense.engine.block_manager.prefix_cache_hit_rate - 0.10, rates
        assert _all_back(llm)
    _, plain, _ = _system_prompt_requests(default_model, hint=False, enable_prefix_caching=False)
    assert tokens == plain


def test_a_burst_sharing_a_prompt_leaves_one_snapshot_where_it_branches(default_model: Path):
    """Four requests queued at once sharing a 300-token system prompt: nothing is cached yet, so none hits,
    but the three admitted after the first in that step share 288 tokens with it: one of them copies the
    state there (one copy: the others see it planned), and the next request resumes at 288. The snapshots
    held and their bytes are reported."""
    saves: list[tuple[int, int]] = []
    plan_saves = RecurrentStates.plan_saves

    def counted(self: RecurrentStates, seq, start: int, end: int) -> list[tuple[int, int]]:
        saves.extend(planned := plan_saves(self, seq, start, end))
        return planned

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecurrentStates, "plan_saves", counted)
        llm, _, cached = _system_prompt_requests(default_model, hint=False, bursts=(4, 1))
    assert cached == [0, 0, 0, 0, 288]
    assert [boundary for boundary, _ in saves].count(288) == 1
    assert _all_back(llm)
    # Held now: each request's own row (left at its last boundary) and the branch's; reported in the load
    # and the worker's metrics.
    load, metrics = llm.engine.load(), WorkerMetrics()
    row = llm.engine.runner.state_row_bytes
    assert (load.state_snapshots, load.state_snapshot_bytes) == (5 + 1, 6 * row)
    assert load.state_snapshot_rows == llm.engine.runner.num_state_snapshots > 6
    metrics.observe_load(load)
    assert metrics.registry.get_sample_value("nanovllm:state_snapshot_bytes") == 6 * row
    assert (
        metrics.registry.get_sample_value("nanovllm:state_snapshot_usage_perc")
        == 6 / load.state_snapshot_rows
    )


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preempted_requests_resume_from_their_snapshots(default_model: Path, async_scheduling: str):
    """Preemption with the prefix cache on and room for snapshots: a preempted request's own snapshot
    (left when it lost its blocks) is a hit when it comes back; tokens equal a roomy engine's, with the
    next step scheduled while one runs (async scheduling) as without."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(8, 30))] for _ in range(8)]
    roomy = LLM(str(default_model), **ENGINE)
    expected = [o["token_ids"] for o in roomy.generate(prompts, greedy(30), use_tqdm=False)]
    model = ModelConfig.from_pretrained_dir(default_model)
    state, block = (
        Qwen3_5ForCausalLM.state_layout(model, 1).bytes_per_slot(4),
        kv_bytes_per_block(model, 4, model.num_key_value_heads, 4),
    )
    left = 20 * block + 16 * state  # past the 8 slots and the pad row: 20 blocks and 16 snapshots
    options = {**ENGINE, "max_model_len": 64, "kvcache_block_size": 4, "kv_cache_memory": 9 * state + left}
    options.update(max_num_seqs=8, max_num_batched_tokens=32, state_cache_fraction=(16 * state + 1) / left)
    options.update(state_memory_fraction=(8 * state + 1) / (9 * state + left))
    tight = LLM(str(default_model), **options, async_scheduling=async_scheduling)
    bm = tight.engine.block_manager
    restores = []
    restore = bm.states.restore
    bm.states.restore = lambda seq: restores.append(restore(seq)) or restores[-1]  # counts the hits
    got = [o["token_ids"] for o in tight.generate(prompts, greedy(30), use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert any(row >= 0 for row in restores), restores
    assert got == expected
    assert _all_back(tight)


def test_two_ranks_equal_one(default_model: Path):
    """Key and value heads of the linear layers split across the ranks as attention heads are, each rank
    with its share of every state slot: tokens equal, logits within 1e-4 (tests/helpers.py)."""
    compare_tp(default_model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [("--dtype", "float32"), ("--dtype", "bfloat16", "--deterministic")],
    ids=["float32", "bf16-deterministic"],
)
def test_streams_resume_token_identical_when_their_worker_is_killed(
    default_model: Path, kernels, tmp_path: Path, flags: tuple[str, ...]
):
    """tests/test_resume.py's case on the hybrid, float32: eight streams (greedy, and seeded sampling with
    penalties) on worker A, A SIGKILLed mid-stream; on B each request recomputes its state from its prompt
    and the tokens so far, and every stream equals its unbroken run token for token: in float32, and in
    bf16 with --deterministic (the resumed streams run in other batches, their prompts chunked otherwise)."""
    with held_streams(default_model, tmp_path, worker_flags=flags) as (_, b, router, kill_a):
        results, at_kill = asyncio.run(resume_run(router.address, kill_when=4, kill=kill_a))
        assert all(4 <= n < RESUME_MAX_TOKENS for n in at_kill), at_kill
        unbroken, _ = asyncio.run(resume_run(router.address))
        assert results == unbroken
        wait_idle(b.address)
