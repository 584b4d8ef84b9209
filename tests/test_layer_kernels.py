"""The C++ CPU layer kernels (RMSNorm, SwiGLU gate, RoPE, the few-rows projection) against their PyTorch
versions, in each dtype the kernels take; the PyTorch versions against transformers' own code in 16-bit
(the same roundings); and a decode step's layers as one C++ call against the modules."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.cpu_kernels import FEW_ROWS_MAX, cpu_digest
from nanovllm.worker.layers.kernels import LayerKernels
from nanovllm.worker.layers.linear import RowParallelLinear
from nanovllm.worker.layers.norm import HeadRMSNorm, RMSNorm
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.rotary import RotaryEmbedding, apply_rotary
from tests.helpers import decode_layers_on_and_off

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_DTYPES = DTYPES[1:]


def assert_matches(out: torch.Tensor, ref: torch.Tensor, max_differing: float = 1e-3) -> None:
    """fp32: close. 16-bit: the same roundings as the reference, so equal bit for bit but for the odd
    element where an fp32 intermediate summed in another order rounds the other way (one ulp of the
    intermediate, up to two of the output after the weight multiply)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref)
        return
    finfo = torch.finfo(out.dtype)
    torch.testing.assert_close(out, ref, rtol=2 * finfo.eps, atol=finfo.tiny)
    assert (out != ref).float().mean().item() <= max_differing


def torch_norm(hidden: int, weight: torch.Tensor, eps: float) -> RMSNorm:
    """The RMSNorm layer on its PyTorch path (no kernels bound)."""
    norm = RMSNorm(hidden, eps)
    norm.weight.data = weight
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (37, 64), (300, 1024)])
def test_rms_norm_matches_torch(kernels, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    w = torch.rand(hidden, generator=gen).to(dtype)
    assert_matches(kernels.rms_norm(x, w, 1e-5), torch_norm(hidden, w, 1e-5)(x))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_rms_norm_torch_path_rounds_as_transformers(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 576, generator=gen) * 3).to(dtype)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    hf.weight.data = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    assert torch.equal(torch_norm(576, hf.weight.data, 1e-5)(x), hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_both_in_place(kernels, dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(9, 128, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(128, generator=gen).to(dtype)
    expected, expected_residual = torch_norm(128, w, 1e-6).add_and_norm(x.clone(), residual.clone())
    kernels.add_rms_norm_(x, residual, w, 1e-6)
    assert torch.equal(residual, expected_residual)  # one rounded add, as PyTorch's
    assert_matches(x, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rms_norm_with_a_float32_weight_is_the_add_then_the_norm(kernels, dtype):
    """Qwen3.5's zero-centred norms keep 1 + w in float32 in a 16-bit model: add_rms_norm_'s residual is then
    PyTorch's one rounded add and its x what rms_norm_fp32_weight gives on that residual, bit for bit (a
    float32 model's weight is in x's dtype: the test above)."""
    gen = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(9, 1024, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(1024, generator=gen) + 0.5
    expected_residual = x.clone().add_(residual)
    expected = kernels.rms_norm_fp32_weight(expected_residual, w, 1e-6)
    kernels.add_rms_norm_(x, residual, w, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_head_rms_norm_reads_q_and_k_in_place_of_the_qkv_output(kernels, dtype, tokens):
    """Qwen3's q/k norm: one weight row per head, on the q and k columns of the fused QKV output (a
    strided view), as HeadRMSNorm's PyTorch path computes it."""
    heads, kv_heads, d = 6, 2, 64
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 3).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, -1, d)
    norm = HeadRMSNorm(heads, kv_heads, d, 1e-6)
    norm.weight.data = torch.rand(heads + kv_heads, d, generator=gen).to(dtype)
    assert_matches(kernels.rms_norm(qk, norm.weight, 1e-6), norm(qk))


def test_rms_norm_takes_any_layout(kernels):
    x = torch.randn(8, 64).t()
    w = torch.rand(8)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm(x.contiguous(), w, 1e-6))
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be .*\[3, 64\]"):
        kernels.rms_norm(torch.randn(2, 4, 64), torch.ones(3, 64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 70])
def test_store_kv_writes_what_index_copy_writes(kernels, dtype, tokens):
    """K and V as the attention layer has them (column slices of the QKV output) into their slots."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 6 * 64, generator=gen).to(dtype)
    key, value = qkv[:, 2 * 64 : 4 * 64].view(tokens, 2, 64), qkv[:, 4 * 64 :].view(tokens, 2, 64)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    k_cache, v_cache = (torch.randn(8, 16, 2, 64, generator=gen).to(dtype) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, 2, 64).index_copy_(0, slots, key)
    expected_v.view(-1, 2, 64).index_copy_(0, slots, value)
    kernels.store_kv_(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_store_kv_refuses_slots_outside_the_cache(kernels):
    cache, key = torch.zeros(2, 16, 2, 64), torch.zeros(3, 2, 64)
    with pytest.raises(RuntimeError, match="store_kv_: slot 32 of token 2 is outside the cache's 32 slots"):
        kernels.store_kv_(key, key, cache, cache.clone(), torch.tensor([0, 5, 32]))
    with pytest.raises(RuntimeError, match="one slot per token, got 2 slots for 3 keys"):
        kernels.store_kv_(key, key, cache, cache.clone(), torch.tensor([0, 5]))


def test_rejects_mixed_dtypes(kernels):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(
        RuntimeError, match="rms_norm: all tensors must have the same dtype, got x BFloat16, weight Float"
    ):
        kernels.rms_norm(x, torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="residual Half"):
        kernels.add_rms_norm_(x, x.half(), torch.ones(64, dtype=torch.bfloat16), 1e-6)
    cos = torch.ones(4, 1, 64)
    with pytest.raises(RuntimeError, match="rotary: .* got x BFloat16, cos Float, sin Float"):
        kernels.rotary(x.view(4, 1, 64), cos, cos)


def test_rejects_other_dtypes(kernels):
    with pytest.raises(RuntimeError, match="silu_and_mul: float32, bfloat16 or float16 only, got Double"):
        kernels.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, half", [(1, 1536), (13, 64)])
def test_silu_and_mul_matches_torch(kernels, dtype, rows, half):
    x = (torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert_matches(kernels.silu_and_mul(x), F.silu(gate) * up)  # transformers' act_fn(gate) * up


def test_silu_and_mul_extremes(kernels):
    """The kernel's own exp: overflow, underflow and NaN behave as PyTorch's."""
    gate = torch.tensor(
        [-200.0, -89.0, -87.0, 0.0, 87.0, 89.0, 200.0, float("inf"), float("-inf"), float("nan")]
    )
    x = torch.cat([gate, torch.ones_like(gate)])[None]
    torch.testing.assert_close(kernels.silu_and_mul(x)[0], F.silu(gate), equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
def test_sigmoid_mul_matches_torch(kernels, dtype, per_row):
    """x * sigmoid(gate), the sigmoid rounded to the dtype (Qwen3.5's attention output gate, a row of gates;
    a shared expert's, one gate a row): the vectorised exp as PyTorch's, overflow and NaN included."""
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 2048, generator=generator) * 4).to(dtype)
    gate = (torch.randn(5, 1 if per_row else 2048, generator=generator) * 8).to(dtype)
    if not per_row:
        gate[0, :5] = torch.tensor([-200.0, 200.0, float("inf"), float("-inf"), float("nan")])
    want = x * torch.sigmoid(gate)
    got = kernels.sigmoid_mul(x, gate)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, equal_nan=True)
    else:
        assert_matches(got.nan_to_num(), want.nan_to_num())
        assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_torch_on_a_strided_view(kernels, dtype):
    rotary = RotaryEmbedding(head_dim=64, max_position=512, base=1e6, dtype=dtype)
    positions = torch.tensor([0, 1, 7, 300, 511])
    cos, sin = rotary.lookup(positions)
    qkv = torch.randn(5, (8 + 2 + 2) * 64).to(dtype)
    qk = qkv[:, : 10 * 64].view(5, 10, 64)  # q and k heads of a fused projection: rows are strided
    out, ref = kernels.rotary(qk, cos, sin), apply_rotary(qk, cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref)
    else:
        assert torch.equal(out, ref)  # the same three roundings, no sums to reorder


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_rotary_torch_path_rounds_as_transformers(dtype):
    rotary = RotaryEmbedding(head_dim=64, max_position=512, base=1e6, dtype=dtype)
    cos, signed_sin = rotary.lookup(torch.arange(0, 512, 7))
    sin = torch.cat([-signed_sin[..., :32], signed_sin[..., 32:]], dim=-1)  # transformers' [sin, sin]
    q = torch.randn(cos.shape[0], 12, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(apply_rotary(q, cos, signed_sin), (q * cos) + (rotate_half(q) * sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13])
@pytest.mark.parametrize(
    "in_features, out_features, bias", [(576, 960, False), (37, 13, True), (1536, 577, True)]
)
def test_linear_few_rows_matches_fp32_matmul(kernels, dtype, rows, in_features, out_features, bias):
    """fp32 sums in another order than PyTorch's: close. 16-bit: the exact product summed in fp32 and rounded
    once, as PyTorch's GEMMs do; so within one rounding of the fp32 result. Shapes with a tail of fewer than
    8 inputs, an odd number of outputs, and more rows than one tile."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    out = kernels.linear_few_rows(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (rows, out_features)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, rtol=torch.finfo(dtype).eps, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features", [100, 1024, 12288])
def test_linear_few_rows_row_does_not_depend_on_its_neighbours(kernels, dtype, in_features):
    """Each output is summed in one order whatever the number of rows: a sequence's projections are bit for
    bit the same alone, in a small batch, or as one row of a speculative verification. Two tiles (9-16 rows)
    take each chunk of weight rows in turn; above, the kernel runs x in blocks against panels of weights held
    in L2 (the native bf16 tile's blocks twice the others' rows, its panels packed 64 outputs wide and summed
    across them, each 6 rows of x);
    12288 features make both smaller than the 21 rows and each thread's share of the 301 outputs, so rows
    and outputs cross blocks; 100 leaves a tail of inputs past the vector steps, 1024 none."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(FEW_ROWS_MAX + 5, in_features, generator=gen).to(dtype)
    w = torch.randn(301, in_features, generator=gen).to(dtype)
    b = torch.randn(301, generator=gen).to(dtype)
    alone = torch.cat([kernels.linear_few_rows(x[i : i + 1], w, b) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(kernels.linear_few_rows(x[:rows], w, b), alone[:rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_few_rows_is_the_same_at_any_thread_count(kernels, dtype):
    """Each thread reads its own range of weight rows and a thread done early takes the rest of another's
    from the far end (kernels/csrc/parallel_rows.h): whichever thread computes an output, and however the
    ranges were cut, it is the same bits. More threads than CPUs make the threads' pace uneven, so ranges
    change hands; 4,099 outputs (an odd count: a lone last row) make claims of many sizes."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 512, generator=gen).to(dtype)
    w = torch.randn(4099, 512, generator=gen).to(dtype)
    b = torch.randn(4099, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append([kernels.linear_few_rows(x[: rows + 1], w, b) for rows in range(3) for _ in range(3)])
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))


def test_linear_few_rows_rejects_bad_shapes_and_dtypes(kernels):
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(RuntimeError, match=r"must share K, got x \[2, 32\] and weight \[8, 64\]"):
        kernels.linear_few_rows(x[:, :32].contiguous(), w, None)
    with pytest.raises(RuntimeError, match="bias must be \\[8\\], got \\[7\\]"):
        kernels.linear_few_rows(x, w, torch.zeros(7))
    with pytest.raises(RuntimeError, match="got x Float, weight BFloat16"):
        kernels.linear_few_rows(x, w.bfloat16(), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_grouped_equals_one_call_per_group(kernels, dtype):
    """A step's experts in one parallel region give each group's linear_few_rows bit for bit, whatever
    the groups' shapes (odd outputs, a K tail, rows past one tile) and however the threads split them."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(1, 64, 301), (3, 37, 13), (9, 128, 96), (1, 64, 1), (2, 64, 1000)]  # rows, K, N
    xs = [torch.randn(rows, k, generator=gen).to(dtype) for rows, k, _ in shapes]
    ws = [torch.randn(n, k, generator=gen).to(dtype) for _, k, n in shapes]
    for got, x, w in zip(kernels.linear_grouped(xs, ws), xs, ws, strict=True):
        assert torch.equal(got, kernels.linear_few_rows(x, w, None))
    assert kernels.linear_grouped([], []) == []
    with pytest.raises(
        RuntimeError, match=r"must share K, got x \[3, 37\] and weight \[301, 64\] in group 1"
    ):
        kernels.linear_grouped(xs[:2], [ws[0], ws[0]])
    with pytest.raises(RuntimeError, match="2 inputs for 1 weights"):
        kernels.linear_grouped(xs[:2], ws[:1])


def test_projection_layers_use_the_kernel_for_few_rows_only(kernels):
    """Bound to the kernels, a layer's few-row input goes through linear_few_rows and a larger one through
    PyTorch's GEMM (each result bit for bit that path's)."""
    layer = RowParallelLinear(64, 48, bias=True, tp=TPContext())
    gen = torch.Generator().manual_seed(0)
    layer.weight.data = torch.randn(48, 64, generator=gen)
    layer.bias.data = torch.randn(48, generator=gen)
    layer.kernels = LayerKernels(cpu=kernels)
    few, many = torch.randn(FEW_ROWS_MAX, 64, generator=gen), torch.randn(FEW_ROWS_MAX + 1, 64, generator=gen)
    assert torch.equal(layer(few), kernels.linear_few_rows(few, layer.weight, layer.bias))
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize(
    "dtype, quantization", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int4")]
)
def test_decode_layers_equal_the_module_path(model_dirs, arch, dtype, quantization):
    """A decode-only step's layers as one C++ call (kernels/csrc/decode_layers_cpu.cpp) run the modules'
    kernels in their order: tokens and logprobs equal bit for bit, with one sequence and with several (a
    decode batch over different context lengths), with Qwen3's q/k norm, Qwen2's qkv bias and Llama's tied
    head, float and packed weights."""
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (5, 23, 61)]
    kwargs = {"dtype": dtype, "quantization": quantization, "max_model_len": 256, "kv_cache_memory": "32MiB"}
    params = SamplingParams(temperature=0.0, logprobs=5, ignore_eos=True, max_tokens=12)
    fused, modules = decode_layers_on_and_off(model_dirs[arch], prompts, params, **kwargs)
    assert fused == modules


def test_each_cpu_gets_its_own_build():
    """The kernels are compiled with -march=native: a build made on a CPU with other flags must not be
    loaded (its AVX-512 instructions would crash an AVX2 machine), so the build directory is keyed by the
    CPU's model and flags, the same for every core of one CPU."""
    core = "processor\t: {n}\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 {extra}\n\n"
    two_cores = core.format(n=0, extra="") + core.format(n=1, extra="")
    assert cpu_digest(two_cores) == cpu_digest(core.format(n=0, extra=""))
    assert cpu_digest(two_cores) != cpu_digest(core.format(n=0, extra="avx512f avx512_vnni"))
    assert cpu_digest(two_cores) != cpu_digest(two_cores.replace("AMD EPYC", "Intel Xeon"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_is_the_function_rounded_once(kernels, dtype):
    """GELU's tanh form against its exact value (float64, as x sigmoid(2u): 1 + tanh(u) cancels where
    tanh(u) nears -1, which is where PyTorch's own 16-bit results drift by several ulps). The kernel's float32
    work: u to within a few ulps, which the exponential turns into |2u| times that relative error of the
    result; then one rounding to the dtype (half its epsilon). Where e^(-2u) passes float32's range the
    kernel's exp is infinite and the result 0, where the exact one is below |x| times float32's smallest
    normal. Extremes (an overflowing exp, zeros,
    infinities, NaN) as PyTorch's."""
    x = (torch.randn(37, 3072, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    xd = x.double()
    two_u = 2 * (2 / torch.pi) ** 0.5 * (xd + 0.044715 * xd**3)
    exact = xd * torch.sigmoid(two_u)
    finfo = torch.finfo(dtype)
    fp32_part = (two_u.abs() + 4) * 4 * torch.finfo(torch.float32).eps
    half_ulp = 0.0 if dtype == torch.float32 else finfo.eps / 2
    flushed = xd.abs() * torch.finfo(torch.float32).smallest_normal
    bound = (half_ulp + fp32_part) * exact.abs() + flushed + finfo.smallest_normal * finfo.eps
    error = (kernels.gelu_tanh(x).double() - exact).abs()
    assert (error <= bound).all(), (error / bound).max().item()
    edges = torch.tensor([-200.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 200.0, float("inf"), float("nan")])
    torch.testing.assert_close(kernels.gelu_tanh(edges), F.gelu(edges, approximate="tanh"), equal_nan=True)


def test_an_error_inside_a_decode_team_reaches_the_caller_and_the_team_ends(model_dirs, kernels):
    """An op that refuses its input inside a step led on a team (kernels/csrc/decode_team.h) raises from
    the one call with its own message, the team's threads leave its region with it, and the next step
    leads a new team: here a KV slot past the cache, which store_kv_ refuses after the first projection's
    job ran on both threads."""
    llm = LLM(str(model_dirs["qwen3"]), device="cpu", num_threads=2, max_model_len=64, kv_cache_memory="1MiB")
    model = llm.engine.runner.model.model
    x = model.embed_tokens(torch.tensor([5]))
    cos, sin = model.rotary.lookup(torch.tensor([0]))
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    before = kernels.decode_teams_led()
    with pytest.raises(
        RuntimeError, match=r"store_kv_: slot 1000000 of token 0 is outside the cache's \d+ slots"
    ):
        model.decode_layers.forward(x, cos, sin, torch.tensor([10**6]), tables, lens)
    out, _ = model.decode_layers.forward(x, cos, sin, torch.tensor([0]), tables, lens)
    assert torch.isfinite(out).all() and kernels.decode_teams_led() == before + 2


def test_a_decode_step_leads_a_team_only_where_its_projections_stay_on_the_kernels(model_dirs, kernels):
    """Packed weights without --deterministic hand more than 8 rows of 16-bit x to ATen's GEMM, which inside
    a team's region would run on one thread: a step of 9 rows runs without a team, a step of one row with."""
    llm = LLM(
        str(model_dirs["qwen3"]), device="cpu", num_threads=2, dtype="bfloat16", quantization="int4",
        max_model_len=64, kv_cache_memory="4MiB",
    )  # fmt: skip
    assert not llm.engine.config.deterministic
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    before = kernels.decode_teams_led()
    llm.generate([[5 + i, 6, 7] for i in range(9)], params, use_tqdm=False)
    assert kernels.decode_teams_led() == before
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert kernels.decode_teams_led() == before + 2
