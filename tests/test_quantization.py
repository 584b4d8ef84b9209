"""Weight-only quantization: the kernel against the float kernel on the dequantized weights, PackedWeight's
quantize / narrow / load rules, GGUF tensors served as they ship, and the engine's fidelity.

Fidelity is vLLM's top-5 rule, here between the same model quantized and not (both float32): each
prompt's two greedy sequences are walked side by side, and at the first position where they differ each
engine's token must be in the other's top-5 there; up to it the quantized top-5 logprobs stay within
LOGPROB_TOL of the float ones."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import ConfigError
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.layers.embedding import ParallelLMHead
from nanovllm.worker.layers.kernels import LayerKernels
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, QuantScheme, assign
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.models.gguf.cache import embedded_model_path
from nanovllm.worker.models.gguf.tensors import gguf_quant_plan, gguf_tensors
from tests.helpers import (
    QUANTIZED_LOGPROB_TOL,
    QUANTIZED_TOP_GAP,
    chat_prompts,
    greedy_with_logprobs,
    teacher_forced_logits,
    top5_rule,
)

NO_DOTS = "this CPU has neither AVX512-VNNI nor AVX2, so the kernel has no integer dot path to test"
SCHEMES = {
    "int8": QuantScheme("int8", 8, None),
    "Q8_0": QuantScheme("Q8_0", 8, 32),
    "int4-32": QuantScheme("int4", 4, 32),
    "int4-64": QuantScheme("int4", 4, 64),
    "int4-128": QuantScheme("int4", 4, 128),
}


def _packed(scheme: str, rows: int, features: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, features, generator=gen) * 0.05
    return PackedWeight(rows, features, SCHEMES[scheme], "test").quantize_(weight), weight


def _run(
    kernels, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, exact: bool = False
) -> torch.Tensor:
    return kernels.linear_quantized(
        x,
        packed.qweight,
        packed.scales,
        packed.mins,
        packed.bits,
        packed.group_size,
        bias,
        False,
        False,
        exact,
    )


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_the_float_kernel_on_dequantized_weights(kernels, scheme, dtype) -> None:
    """With `exact` (the engine's --exact-quantized-matmuls), bit for bit wherever the weights are
    dequantized in registers (up to 8 rows) or cached panels (up to 64 rows of float32 x): x widened, the
    exact dequantized weight, the same summation order, one rounding to dtype. 16-bit x above 8 rows runs
    PyTorch's 16-bit GEMM on the weight in x's dtype. Without `exact` x takes the integer dots where the
    build has them (the next tests)."""
    packed, _ = _packed(scheme, 70, 256)
    dequantized = packed.dequantize(torch.float32)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(70, generator=gen).to(dtype)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 40):
        x = torch.randn(rows, 256, generator=gen).to(dtype)
        if dtype == torch.float32 or rows <= 8:
            expected = kernels.linear_few_rows(x.float(), dequantized, bias.float()).to(dtype)
        else:
            expected = F.linear(x, packed.dequantize(dtype), bias)
        assert torch.equal(_run(kernels, x, packed, bias, exact=True), expected), (scheme, dtype, rows)


def _dot_rows(dtype: torch.dtype) -> tuple[int, ...]:
    """Rows of x the integer dots take (not batch_invariant): up to 8 of 16-bit x, 64 of float32 x, in tiles
    of 8 rows."""
    return (*range(1, 9), 17, 64) if dtype == torch.float32 else tuple(range(1, 9))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_dots_stay_within_the_activation_rounding_bound(kernels, scheme, dtype) -> None:
    """With AVX512-VNNI or AVX2, up to 8 rows of 16-bit x and 64 of float32 x are quantized to int8 in
    blocks of 32 (scale d = the block's max |x| / 127) and meet the weights in integer dot products. Each x
    moves by at most d / 2, so
    an output moves by at most the sum over blocks of d / 2 * sum |w| from the exact product (plus the
    output's own rounding to dtype). Several shapes end in a partial 64-byte chunk, and 37 weight rows
    leave partial tiles."""
    if not kernels.linear_quantized_int8_dots():
        pytest.skip(NO_DOTS)
    gen = torch.Generator().manual_seed(2)
    group = SCHEMES[scheme].group_size or 32
    for features in (f for f in (96, 160, 192, 384, 576, 640) if f % group == 0):
        packed, _ = _packed(scheme, 37, features)
        weight = packed.dequantize(torch.float64)
        bias = torch.randn(37, generator=gen).to(dtype)
        for rows in _dot_rows(dtype):
            x = (torch.randn(rows, features, generator=gen) * torch.rand(rows, features, generator=gen)).to(
                dtype
            )
            exact = x.double() @ weight.T + bias.double()
            step = x.double().view(rows, -1, 32).abs().amax(-1) / 127  # [rows, blocks]
            weight_mass = weight.abs().view(37, -1, 32).sum(-1)  # [37, blocks]
            bound = (step / 2) @ weight_mass.T * 1.0001 + exact.abs() * 2.0**-8 + 1e-6
            error = (_run(kernels, x, packed, bias).double() - exact).abs()
            assert (error <= bound).all(), (scheme, dtype, features, rows, (error / bound).max().item())
            # and the quantization is there: the result is not the exact product rounded
            if rows == 1 and features >= 160:
                assert not torch.equal(_run(kernels, x, packed, bias), exact.to(dtype))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_dots_are_the_product_of_the_quantized_x(kernels, scheme, dtype) -> None:
    """Tighter than the bound above: the integer sums are exact, so each output is x's int8 quantization
    (q = round(x * (127 / max|x|)) per block of 32, in float32 as the kernel rounds it, times max|x| / 127)
    against the weights, plus at 4 bits each group's min times x summed over the group, and the bias; up to
    float32's rounding of the scaled partial sums (at most one rounding a term: K x 2^-24 of the products'
    mass) and the output's rounding to dtype (half its epsilon, relative). A lane given another block's
    scale, a nibble from the wrong half or a partial chunk read past its row moves an output by a whole
    product, far past that. Per-channel int8 with VNNI sums the weights offset by 128 (the instruction takes
    unsigned bytes) and takes x's share of the offset back once, after the sum, so its products' mass is that
    of |w| + 128 weight steps."""
    if not kernels.linear_quantized_int8_dots():
        pytest.skip(NO_DOTS)
    gen = torch.Generator().manual_seed(3)
    for features in (f for f in (96, 160, 192, 384, 576, 640) if f % (SCHEMES[scheme].group_size or 32) == 0):
        packed, _ = _packed(scheme, 37, features)
        weight = packed.dequantize(torch.float64)
        bias = torch.randn(37, generator=gen).to(dtype)
        for rows in _dot_rows(dtype):
            x = torch.randn(rows, features, generator=gen).to(dtype)
            blocks = x.float().view(rows, -1, 32)
            amax = blocks.abs().amax(-1, keepdim=True)
            q = torch.round(
                blocks * (torch.full_like(amax, 127.0) / amax)
            )  # a true division, as the kernel's
            quantized = (q.double() * (amax / 127).double()).view(rows, features)
            terms = quantized.abs() @ weight.abs().T
            if packed.bits == 4:
                group = packed.group_size
                mins = packed.mins.double()
                expected = quantized @ (weight - mins.repeat_interleave(group, dim=1)).T
                expected += x.double().view(rows, -1, group).sum(-1) @ mins.T
                terms += x.double().abs().view(rows, -1, group).sum(-1) @ mins.abs().T
            else:
                expected = quantized @ weight.T
                if packed.group_size == features:  # one scale a row
                    terms += quantized.abs().sum(-1, keepdim=True) * 128 * packed.scales.double().view(1, -1)
            expected += bias.double()
            bound = features * 2.0**-24 * terms + torch.finfo(dtype).eps / 2 * expected.abs() + 1e-7
            error = (_run(kernels, x, packed, bias).double() - expected).abs()
            assert (error <= bound).all(), (scheme, dtype, features, rows, (error / bound).max().item())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_rows_is_the_weights_dequantize_bit_for_bit(kernels, scheme, dtype) -> None:
    """The C++ lookup of a packed embedding's rows (kernels' dequantize_rows) equals PackedWeight.dequantize of
    the same rows bit for bit, repeated and out-of-order rows included, interleaved rows too; a row
    outside the weight is refused by number."""
    packed, _ = _packed(scheme, 48, 256, seed=3)
    rows = torch.tensor([47, 0, 5, 5, 31, 16])
    want = packed.dequantize(dtype, rows=rows)
    args = (packed.qweight, packed.scales, packed.mins, packed.bits, packed.group_size)
    assert torch.equal(kernels.dequantize_rows(*args, rows, dtype), want)
    assert kernels.dequantize_rows(*args, rows[:0], dtype).shape == (0, 256)
    if packed.can_interleave and kernels.linear_quantized_interleaved():
        packed.interleave_()
        interleaved = (packed.qweight, packed.scales, packed.mins, packed.bits, packed.group_size)
        assert torch.equal(kernels.dequantize_rows(*interleaved, rows, dtype, True), want)
    with pytest.raises(RuntimeError, match="row 48 is outside the weight's 48 rows"):
        kernels.dequantize_rows(*args, torch.tensor([3, 48]), dtype)


@pytest.mark.parametrize("scheme", ["int4-32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interleaved_rows_compute_the_rows_layouts_product(kernels, scheme, dtype) -> None:
    """4-bit weights in groups of 32 and 8-bit weights with one scale a row, with their rows interleaved 16
    at a time (the layout an engine's weights take where the integer dots run: AVX512-VNNI or AVX2): the same integer sums
    as the rows' own layout, scaled and added in another order (at 8 bits each block's sum exact, the +128
    offset taken back inside it), so every output within float32's rounding of the scaled partial sums of
    the two (K x 2^-24 of the products' mass each, as the tests above hold them) and the output's rounding;
    prefill sizes dequantize to the same float weight, so the GEMM's result is the same bit for bit. The
    planes dequantize as before; whole tiles of rows narrow, other cuts and loading into them are refused."""
    if not kernels.linear_quantized_interleaved():
        pytest.skip(NO_DOTS)
    gen = torch.Generator().manual_seed(5)
    for features in (96, 1024):
        packed, _ = _packed(scheme, 48, features)
        group = packed.group_size
        mins = None if packed.mins is None else packed.mins.clone()
        rows_layout = PackedWeight.of_planes(
            packed.scheme, group, packed.qweight.clone(), packed.scales.clone(), mins
        )
        weight = packed.dequantize(torch.float64)
        packed.interleave_()
        assert packed.interleaved and not torch.equal(packed.qweight, rows_layout.qweight)
        assert torch.equal(packed.dequantize(torch.float32), rows_layout.dequantize(torch.float32))
        bias = torch.randn(48, generator=gen).to(dtype)
        for rows in (1, 2, 5, 8, 20, 70):
            x = torch.randn(rows, features, generator=gen).to(dtype)
            magnitude = x.double().abs()  # x's int8 rounding moves it by at most 1/254 of its block's largest
            terms = magnitude @ weight.abs().T
            if mins is not None:
                terms += magnitude.view(rows, -1, 32).sum(-1) @ mins.double().abs().T
            else:  # the rows' layout sums the weights offset by 128 steps, and takes x's share back after
                terms += magnitude.sum(-1, keepdim=True) * 128 * rows_layout.scales.double().view(1, -1)
            for invariant in (False, True):
                args = (packed.bits, group, bias, invariant)
                expected = kernels.linear_quantized(x, rows_layout.qweight, rows_layout.scales, mins, *args)
                got = kernels.linear_quantized(x, packed.qweight, packed.scales, packed.mins, *args, True)
                if rows > (64 if dtype == torch.float32 else 8) and not invariant:  # the GEMM
                    assert torch.equal(got, expected), (features, rows)
                    continue
                bound = 2 * (
                    features * 2.0**-24 * 1.02 * terms + torch.finfo(dtype).eps / 2 * expected.double().abs()
                )
                error = (got.double() - expected.double()).abs()
                assert (error <= bound + 1e-7).all(), (
                    features,
                    rows,
                    invariant,
                    (error / bound).max().item(),
                )
    tiles = packed.narrow(0, 16, 32)
    assert tiles.interleaved
    assert torch.equal(
        tiles.dequantize(torch.float32), rows_layout.narrow(0, 16, 32).dequantize(torch.float32)
    )
    with pytest.raises(RuntimeError, match=r"rows \[0, 8\) split tiles of 16"):
        packed.narrow(0, 0, 8)
    with pytest.raises(RuntimeError, match="interleaved"):
        packed.narrow(1, 0, 32)
    with pytest.raises(RuntimeError, match="interleaved"):
        assign(tiles, rows_layout.narrow(0, 16, 32))
    with pytest.raises(RuntimeError, match="4 bits in groups of 32 or 8 bits with one scale a row"):
        kernels.linear_quantized(
            x, packed.qweight, packed.scales, packed.mins, packed.bits, group, None, False, True, True
        )


def test_an_interleaved_head_gives_the_logits_of_its_first_ids(kernels) -> None:
    """The LM head's logits of its first `vocab` ids (MTP's draft vocabulary) from an int8 head with rows
    interleaved, which narrows along whole tiles of 16 rows only: the tiles holding them multiplied and the
    rest cut off, equal to the whole vocabulary's first columns bit for bit at any count."""
    if not kernels.linear_quantized_interleaved():
        pytest.skip(NO_DOTS)
    head = ParallelLMHead(64, 96, TPContext(), QuantPlan(head=SCHEMES["int8"]), "lm_head")
    assert isinstance(head.weight, PackedWeight)
    head.weight.quantize_(torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 0.05)
    head.weight.interleave_()
    head.kernels = LayerKernels(cpu=kernels)
    hidden = torch.randn(3, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = head(hidden)
    for vocab in (1, 16, 20, 37, 64):
        first = head(hidden, vocab)
        assert first.shape == (3, vocab) and torch.equal(first, whole[:, :vocab]), vocab


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sized_inputs_go_through_a_gemm(kernels, dtype) -> None:
    """Above 64 rows (8 with 16-bit x) the weight is dequantized once to x's dtype and PyTorch's GEMM
    runs: its own summation order, so close to the register and panel paths' result rather than equal."""
    packed, _ = _packed("int4-32", 48, 256)
    x = torch.randn(100, 256).to(dtype)
    torch.testing.assert_close(_run(kernels, x, packed), F.linear(x, packed.dequantize(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_neighbours(kernels, dtype) -> None:
    """So a sequence decodes the same alone as in a small batch, and a speculative verification row equals
    the decode step it replaces: also with the integer dots, which quantize each row of x on its own."""
    packed, _ = _packed("int4-32", 96, 128)
    x = torch.randn(20, 128).to(dtype)
    alone = torch.cat([_run(kernels, x[i : i + 1], packed) for i in range(len(x))])
    for rows in (2, 4, 5, 8) if dtype != torch.float32 else (2, 4, 5, 20):  # 16-bit: GEMM above 8 rows
        assert torch.equal(_run(kernels, x[:rows], packed), alone[:rows]), rows


@pytest.mark.parametrize("scheme", ["int8", "int4-32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_result_does_not_depend_on_the_thread_count(kernels, scheme, dtype) -> None:
    """A few rows of x read the weights once, each thread its own range of weight rows and a thread done
    early the rest of another's from the far end (kernels/csrc/parallel_rows.h): the same bits whichever
    thread computes an output. More threads than CPUs make the threads' pace uneven, so ranges change
    hands; 4,099 weight rows end in a partial tile. x takes the integer dots where the CPU has them, and
    the registers when exact."""
    packed, _ = _packed(scheme, 4099, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append(
                [_run(kernels, x[: rows + 1], packed, exact=exact) for rows in range(3) for exact in (0, 1)]
            )
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))


@pytest.mark.parametrize("scheme", ["Q8_0", "int8", "int4-32", "int4-128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batch_invariant_rows_equal_each_row_alone_at_every_row_count(kernels, scheme, dtype) -> None:
    """batch_invariant (--deterministic): one kernel at every row count, decode to prefill sizes (never the
    GEMM), so every row equals that row alone, bit for bit. On a CPU with integer dots it is the integer
    dots in tiles of 8 rows (and at up to 8 rows exactly what the default mode runs, so a deterministic
    decode step costs what a default one does); with `exact`, or on a CPU without them, the registers and
    the panels. 130 rows: full tiles and a partial one; 37 weight rows: partial tiles."""
    packed, _ = _packed(scheme, 37, 256)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(37, generator=gen).to(dtype)
    x = torch.randn(130, 256, generator=gen).to(dtype)

    for exact in (False, True):

        def run(rows: torch.Tensor, invariant: bool, exact: bool = exact) -> torch.Tensor:
            args = (packed.bits, packed.group_size, bias, invariant, False, exact)
            return kernels.linear_quantized(rows, packed.qweight, packed.scales, packed.mins, *args)

        alone = torch.cat([run(x[i : i + 1], True) for i in range(len(x))])
        for rows in (2, 5, 8, 9, 17, 64, 65, 130):
            assert torch.equal(run(x[:rows], True), alone[:rows]), (scheme, dtype, exact, rows)
        if not exact and kernels.linear_quantized_int8_dots():
            assert torch.equal(run(x[:8], False), alone[:8])  # the default mode's decode kernel


def test_torch_fallback_computes_the_same_product(kernels) -> None:
    """Without the C++ kernels (another device, no compiler) a packed weight is dequantized per call."""
    packed, _ = _packed("int4-64", 64, 128)
    x = torch.randn(3, 128)
    torch.testing.assert_close(
        F.linear(x, packed.dequantize(torch.float32)), _run(kernels, x, packed, exact=True)
    )


def test_kernel_rejects_inconsistent_planes(kernels) -> None:
    packed, _ = _packed("int4-32", 8, 64)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="mins are required at 4 bits"):
        kernels.linear_quantized(x, packed.qweight, packed.scales, None, 4, 32, None)
    with pytest.raises(RuntimeError, match="group_size 48 must be a multiple of 32"):
        kernels.linear_quantized(x, packed.qweight, packed.scales, packed.mins, 4, 48, None)
    int8, _ = _packed("Q8_0", 8, 64)
    with pytest.raises(RuntimeError, match="qweight must be int8 at 8 bits"):
        kernels.linear_quantized(x, int8.qweight.view(torch.uint8), int8.scales, None, 8, 32, None)


# --------------------------------------------------------------------------- PackedWeight


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantization_rounds_each_weight_to_its_nearest_level(scheme) -> None:
    packed, weight = _packed(scheme, 32, 256)
    error = (packed.dequantize(torch.float32) - weight).abs().view(32, -1, packed.group_size)
    scale = packed.scales.float().unsqueeze(2)
    # half a level, plus the float16 rounding of the min (4 bits), which moves every level of its group
    slack = 0.0 if packed.mins is None else packed.mins.float().abs().unsqueeze(2) * 2**-11
    assert (error <= scale / 2 * 1.0001 + slack + 1e-9).all()


def test_narrowing_splits_rows_freely_and_features_only_along_groups() -> None:
    packed, _ = _packed("int4-64", 16, 256)
    full = packed.dequantize(torch.float32)
    assert torch.equal(packed.narrow(0, 4, 8).dequantize(torch.float32), full[4:12])
    assert torch.equal(packed.narrow(1, 64, 128).dequantize(torch.float32), full[:, 64:192])
    with pytest.raises(ConfigError, match=r"input features \[32, 160\) split groups of 64"):
        packed.narrow(1, 32, 128)


def test_assign_quantizes_copies_and_dequantizes() -> None:
    packed, weight = _packed("Q8_0", 8, 64)
    fresh = PackedWeight(8, 64, SCHEMES["Q8_0"], "test")
    assign(fresh, weight)  # float into packed: quantized
    assert torch.equal(fresh.qweight, packed.qweight) and torch.equal(fresh.scales, packed.scales)
    other = PackedWeight(8, 64, SCHEMES["Q8_0"], "test")
    assign(other, fresh)  # packed into packed: copied
    assert torch.equal(other.dequantize(torch.float32), packed.dequantize(torch.float32))
    target = torch.empty(8, 64)
    assign(target, packed)  # packed into float: dequantized
    assert torch.equal(target, packed.dequantize(torch.float32))
    with pytest.raises(ConfigError, match="cannot load a Q8_0 weight"):
        assign(PackedWeight(8, 64, SCHEMES["int4-32"], "test"), packed)


# --------------------------------------------------------------------------- GGUF as it ships


def _tiny_config(architecture: str = "LlamaForCausalLM") -> SimpleNamespace:
    """What gguf_tensors and gguf_quant_plan read of a ModelConfig, for the tiny files' blocks 0 to 3."""
    return SimpleNamespace(
        architecture=architecture, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4
    )


def _tiny_gguf(
    path: Path, kinds: dict[str, str], shape: tuple[int, ...] = (48, 64), arch: str = "llama"
) -> dict[str, np.ndarray]:
    """A GGUF file holding one tensor of torch shape `shape` per (llama.cpp name: type); returns gguf's
    own dequantization of each."""
    writer = gguf.GGUFWriter(str(path), arch)
    rng = np.random.default_rng(0)
    expected = {}
    for name, kind in kinds.items():
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        expected[name] = gguf.quants.dequantize(data, qtype).reshape(shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_gguf_blocks_become_planes_that_dequantize_as_gguf_does(tmp_path: Path) -> None:
    kinds = {"blk.0.ffn_down.weight": "Q4_0", "blk.0.ffn_up.weight": "Q4_1", "blk.0.ffn_gate.weight": "Q8_0"}
    expected = _tiny_gguf(tmp_path / "tiny.gguf", kinds)
    config = _tiny_config()
    tensors = dict(gguf_tensors(tmp_path / "tiny.gguf", config))
    for name, kind in kinds.items():
        hf_name = {"ffn_down": "mlp.down_proj", "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj"}
        key = f"model.layers.0.{hf_name[name.split('.')[2]]}.weight"
        packed = tensors[key].read()
        assert isinstance(packed, PackedWeight) and packed.scheme.name == kind
        assert np.array_equal(packed.dequantize(torch.float32).numpy(), expected[name]), kind
    plan = gguf_quant_plan(tmp_path / "tiny.gguf", config, DecoderForCausalLM.packed_modules_mapping)
    # gate (Q8_0) and up (Q4_1) fuse into one layer of two types: dequantized; down is served as shipped
    assert plan.by_layer == {"model.layers.0.mlp.down_proj": QuantScheme("Q4_0", 4, 32)}


@pytest.mark.parametrize("up", ["Q8_0", "Q4_1"])
def test_gguf_expert_tensors_become_one_packed_weight_per_expert(tmp_path: Path, up: str) -> None:
    """A Qwen3-MoE layer's three 3-D expert tensors (6 experts x [48, 64] each): every expert gets its
    own PackedWeight over its rows' blocks, equal to gguf's dequantization of its slice. When gate and up
    differ in type, the expert's fused w13 is dequantized, and its w2 with it (an expert's weights are
    packed together or not at all)."""
    kinds = {
        "blk.0.ffn_gate_exps.weight": "Q8_0",
        "blk.0.ffn_up_exps.weight": up,
        "blk.0.ffn_down_exps.weight": "Q4_0",
    }
    expected = _tiny_gguf(tmp_path / "moe.gguf", kinds, shape=(6, 48, 64), arch="qwen3moe")
    config = _tiny_config("Qwen3MoeForCausalLM")
    tensors = dict(gguf_tensors(tmp_path / "moe.gguf", config))
    projections = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    assert len(tensors) == 3 * 6
    for name, kind in kinds.items():
        for expert in range(6):
            packed = tensors[
                f"model.layers.0.mlp.experts.{expert}.{projections[name.split('.')[2]]}.weight"
            ].read()
            assert isinstance(packed, PackedWeight) and packed.scheme.name == kind
            assert np.array_equal(packed.dequantize(torch.float32).numpy(), expected[name][expert]), kind
    plan = gguf_quant_plan(tmp_path / "moe.gguf", config, DecoderForCausalLM.packed_modules_mapping)
    if up == "Q8_0":
        assert plan.by_layer == {
            **{f"model.layers.0.mlp.experts.{e}.w13": QuantScheme("Q8_0", 8, 32) for e in range(6)},
            **{f"model.layers.0.mlp.experts.{e}.w2": QuantScheme("Q4_0", 4, 32) for e in range(6)},
        }
    else:
        assert plan.by_layer == {}


def test_gguf_types_not_served_as_they_ship_load_dequantized(tmp_path: Path) -> None:
    """Q5_0 (as the K-quants): not in the plan, loaded as float32 equal to gguf's own dequantization."""
    expected = _tiny_gguf(
        tmp_path / "q5.gguf", {"blk.3.attn_output.weight": "Q5_0", "blk.3.ffn_up.weight": "Q8_0"}
    )
    config = _tiny_config()
    plan = gguf_quant_plan(tmp_path / "q5.gguf", config, DecoderForCausalLM.packed_modules_mapping)
    assert plan.by_layer == {"model.layers.3.mlp.gate_up_proj": QuantScheme("Q8_0", 8, 32)}
    value = dict(gguf_tensors(tmp_path / "q5.gguf", config))["model.layers.3.self_attn.o_proj.weight"].read()
    assert value.dtype == torch.float32 and np.array_equal(
        value.numpy(), expected["blk.3.attn_output.weight"]
    )


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_dir: Path) -> Path:
    return embedded_model_path()


@pytest.mark.slow
def test_gguf_q4_1_logits_equal_the_dequantized_model(smollm2_gguf: Path, kernels) -> None:
    """The same weights through two kernels, the quantized one exact (--exact-quantized-matmuls): decode
    steps (few rows: linear_quantized's register path against linear_few_rows on the float32 copy) are
    bit-identical; prefill (PyTorch's GEMM against the panel path, summing in another order) within 1e-3 of
    logits up to ~20."""
    kwargs = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": "64MiB"}
    shipped = LLM(str(smollm2_gguf), exact_quantized_matmuls=True, **kwargs)
    dequantized = LLM(str(smollm2_gguf), quantization="none", **kwargs)
    packed = [m for m in shipped.engine.runner.model.modules() if isinstance(m, PackedWeight)]
    assert {m.scheme.name for m in packed} == {"Q4_1", "Q8_0"}
    prompts = chat_prompts(Path(shipped.config.model))[:2]
    for chunk in (1, 1000):
        ours = teacher_forced_logits(shipped, prompts, chunk)
        theirs = teacher_forced_logits(dequantized, prompts, chunk)
        for a, b in zip(ours, theirs):
            if chunk == 1:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_q4_1_with_the_integer_dots_keeps_the_top5_rule_against_the_dequantized_model(
    smollm2_gguf: Path, smollm2_dir: Path, dtype: str
) -> None:
    """Decode steps take the integer dots by default (AVX512-VNNI or AVX2; x quantized to int8 in blocks of
    32; in float32 because the projections are 4-bit): no longer bit-equal to the dequantized model, held to
    the top-5 rule instead, within the dots' tolerance in either dtype (QUANTIZED_LOGPROB_TOL's bfloat16
    entry: x's int8 rounding is what moves them, up to 2.5 nats seen). Whole chats are not asserted equal:
    bfloat16 logits of 2 to 32 come in steps of 1/64 to 1/8, so near-ties are common and the dots' moves
    part them (seen on the AVX2 EPYC: 0 of 4 chats equal for 24 tokens, parting where the dequantized
    model's top two were 0, 0.13, 0.13 and 0.19 nats apart; on the AVX-512 EPYC 2 or more)."""
    kwargs = {"dtype": dtype, "max_model_len": 256, "kv_cache_memory": "64MiB"}
    prompts = chat_prompts(smollm2_dir)
    llm = LLM(str(smollm2_gguf), **kwargs)
    assert (
        llm.engine.runner.exact_quantized
        is not llm.engine.runner.sampler.cpu_kernels.linear_quantized_int8_dots()
    )
    shipped = greedy_with_logprobs(llm, prompts, 24)
    plain = greedy_with_logprobs(LLM(str(smollm2_gguf), quantization="none", **kwargs), prompts, 24)
    assert top5_rule(f"Q4_1 {dtype}", plain, shipped, QUANTIZED_TOP_GAP) <= QUANTIZED_LOGPROB_TOL["bfloat16"]


def test_gguf_q4_1_holds_under_110_mb_and_names_paris(smollm2_gguf: Path) -> None:
    llm = LLM(str(smollm2_gguf), max_model_len=256, kv_cache_memory="64MiB")
    model = llm.engine.runner.model
    packed = {id(m): m for m in model.modules() if isinstance(m, PackedWeight)}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        m.nbytes for m in packed
    )
    assert weight_bytes <= 110e6, weight_bytes
    prompt = chat_prompts(Path(llm.config.model))[0]  # What is the capital of France?
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in out["text"]


# --------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_int8_keeps_the_top5_rule_on_random_models(model_dirs, arch) -> None:
    rng = random.Random(29)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 7, 30, 90)]
    kwargs = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": "32MiB"}
    plain = greedy_with_logprobs(LLM(str(model_dirs[arch]), **kwargs), prompts, 24)
    llm = LLM(str(model_dirs[arch]), quantization="int8", **kwargs)
    packed = {name for name, m in llm.engine.runner.model.named_modules() if isinstance(m, PackedWeight)}
    assert sum(".layers." in name for name in packed) == 2 * 4  # qkv, o, gate_up, down of each layer
    tied = llm.engine.runner.model.config.tie_word_embeddings  # the embedding is packed as the head is
    assert packed - {n for n in packed if ".layers." in n} == {
        "model.embed_tokens.weight" if tied else "lm_head.weight"
    }
    assert llm.engine.runner.exact_quantized  # float32 x with 8-bit weights: not the integer dots
    quantized = greedy_with_logprobs(llm, prompts, 24)
    assert top5_rule(arch, plain, quantized, QUANTIZED_TOP_GAP) <= QUANTIZED_LOGPROB_TOL["float32"]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_keeps_the_top5_rule_on_smollm2(smollm2_dir: Path, dtype: str) -> None:
    """In bfloat16 both engines round activations to 16 bits, and the int8 one (where the CPU has
    AVX512-VNNI or AVX2) also quantizes each decode row of x to int8 for the integer dots."""
    prompts = chat_prompts(smollm2_dir)
    kwargs = {"dtype": dtype, "max_model_len": 256, "kv_cache_memory": "64MiB"}
    plain = greedy_with_logprobs(LLM(str(smollm2_dir), **kwargs), prompts, 24)
    quantized = greedy_with_logprobs(LLM(str(smollm2_dir), quantization="int8", **kwargs), prompts, 24)
    assert top5_rule("SmolLM2", plain, quantized, QUANTIZED_TOP_GAP) <= QUANTIZED_LOGPROB_TOL[dtype]
    if dtype == "float32":  # in bfloat16 (seen: 0 of 4 chats the same for 24 tokens) near-ties part sooner
        assert sum(a["token_ids"] == b["token_ids"] for a, b in zip(plain, quantized)) >= len(prompts) // 2


def test_int4_runs_every_architecture_close_to_float(model_dirs) -> None:
    """int4 in groups of 32 is not held to the top-5 rule on these random Gaussian weights (16 levels for a
    Gaussian group: several percent of error per projection); its argmax stays in float's top-5 at most
    positions of a teacher-forced prompt. The bound sits between chance and a correct engine: chance is 5 of
    the 512-token vocabulary (1%), where a layout bug lands (nibbles swapped: 1-3%, measured 2026-11-26 on
    the AVX2 EPYC), and a correct engine keeps 91-95%. A bug of one rounding step (every group's min one
    level high: 84-94%) is within int4's own error here; the per-weight rounding tests above catch it."""
    prompt = list(range(3, 100))
    kwargs = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": "32MiB"}
    for arch, path in model_dirs.items():
        plain = teacher_forced_logits(LLM(str(path), **kwargs), [prompt], 1000)[0]
        quantized = teacher_forced_logits(LLM(str(path), quantization="int4", **kwargs), [prompt], 1000)[0]
        in_top5 = (plain.topk(5, dim=-1).indices == quantized.argmax(-1, keepdim=True)).any(-1)
        assert in_top5.float().mean() >= 0.75, arch


# --------------------------------------------------------------------------- bad input


def test_unknown_quantization_and_bad_group_sizes_fail_at_start(qwen3_dir: Path) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of auto, none, int8, int4, got 'int3'"):
        EngineConfig(model=str(qwen3_dir), quantization="int3")
    with pytest.raises(
        ConfigError, match="quantization_group_size must be a positive multiple of 32, got 48"
    ):
        EngineConfig(model=str(qwen3_dir), quantization="int4", quantization_group_size=48)
    # 128 is a valid size, but the random model's projections have 64 input features
    with pytest.raises(ConfigError, match=r"layer model.layers.0.self_attn.qkv_proj has 64 input features"):
        LLM(str(qwen3_dir), quantization="int4", quantization_group_size=128, kv_cache_memory="32MiB")
