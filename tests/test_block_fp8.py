"""Block-FP8 weights held as they ship on the Triton backend (worker/layers/block_fp8.py) and run by the
Triton kernel (kernels/triton_block_fp8.py); on a CPU the kernel runs in Triton's interpreter
(tests/conftest.py turns it on). The CPU's C++ backend dequantizes them at load, as
tests/test_fp8_checkpoints.py checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanovllm.common.errors import ConfigError
from nanovllm.kernels.triton_block_fp8 import linear_block_fp8
from nanovllm.worker.layers.block_fp8 import BlockFp8Weight
from nanovllm.worker.layers.linear import QKVParallelLinear, RowParallelLinear
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import QuantPlan, assign
from tests.helpers import greedy, hf_greedy
from tests.model_factory import build_model, write_block_fp8
from tests.quantized_checkpoints import loaded_with_start_log
from tests.top5 import assert_close, random_prompts, run_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 128
# A Qwen3 whose fused projections cut at multiples of 128 (q, k and v of 128 rows each; gate and up of 128),
# with partial edge blocks: 192 input features to qkv and gate_up, 192 output rows of o_proj and down_proj.
ALIGNED = {"hidden": 192, "heads": 1, "kv_heads": 1, "overrides": {"head_dim": 128, "intermediate_size": 128}}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41]]
MAX_NEW = 4
# float32 unit roundoff, and the 16-bit dtypes' (their outputs round once more)
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _random_block_fp8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float8_e4m3fn bytes [n, k], float32 scales per 128 x 128 block, and the weight they make, in float64
    (byte x scale is exact there: 4 significant bits times 24)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // BLOCK), -(-k // BLOCK), generator=gen) / 256 + 1e-3
    expanded = scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return weight, scale, weight.double() * expanded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 70])
def test_the_kernel_is_the_matmul_on_the_dequantized_weight(dtype, rows) -> None:
    """N = 200 and K = 320: partial edge blocks both ways; 70 rows: a partial second row tile. Against the
    exact product (float64 on the dequantized weight): the kernel sums K products, one scale multiply per
    block and the bias, each rounded once in float32, so it is within (K + 3) u sum |x w| (u = 2^-24, the
    classic bound of a float32 dot product), and a 16-bit output rounds once more: half an ulp of it, u16 |y|."""
    n, k = 200, 320
    weight, scale, exact_weight = _random_block_fp8(n, k, seed=rows)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    out = linear_block_fp8(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), BLOCK, bias.to(DEVICE)).cpu()
    assert out.dtype == dtype and out.shape == (rows, n)
    exact = x.double() @ exact_weight.T + bias.double()
    accumulation = (
        (k + 3) * UNIT[torch.float32] * (x.double().abs() @ exact_weight.abs().T + bias.double().abs())
    )
    rounding = 0.0 if dtype == torch.float32 else UNIT[dtype]
    bound = accumulation * (1 + rounding) + rounding * exact.abs()
    assert ((out.double() - exact).abs() <= bound).all()
    # a row's result is its own: alone it is the same bits
    alone = linear_block_fp8(x[-1:].to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), BLOCK, bias.to(DEVICE))
    assert torch.equal(alone.cpu(), out[-1:])


def test_the_kernel_refuses_scales_that_do_not_fit() -> None:
    weight, scale, _ = _random_block_fp8(200, 320, seed=0)
    with pytest.raises(
        ValueError, match=r"blocks of 128 has float32 scales \[2, 3\], got torch.float32 \[2, 2\]"
    ):
        linear_block_fp8(torch.zeros(1, 320), weight, scale[:, :2], BLOCK)


def test_a_shard_keeps_whole_blocks_or_is_refused_by_name() -> None:
    """Tensor parallelism's slices: rows [64, 128) of a 128-row block go whole into a 64-row weight (one block,
    its scale as it was) and dequantize as the float path does; input features [160, 320) start inside a
    block and span two, which one scale per held block cannot express. A float tensor for a held weight is
    refused too."""
    weight, scale, exact = _random_block_fp8(128, 320, seed=3)
    source = BlockFp8Weight.of(weight, scale, BLOCK, "model.layers.0.mlp.down_proj.weight")
    held = BlockFp8Weight(64, 320, BLOCK, "model.layers.0.mlp.down_proj")
    held.copy_(source.narrow(0, 64, 64))
    assert torch.equal(held.dequantize(torch.float32), exact[64:].float())  # byte x scale rounded once
    held = BlockFp8Weight(128, 160, BLOCK, "model.layers.0.mlp.down_proj")
    with pytest.raises(
        ConfigError, match=r"down_proj.weight's slice of 160 input features starts 32 into a 128"
    ):
        held.copy_(source.narrow(1, 160, 160))
    with pytest.raises(ConfigError, match=r"layer model.layers.0.mlp.down_proj is held in block FP8, but"):
        assign(held, torch.zeros(128, 160))  # a float tensor: its scales are missing


def test_a_projection_is_held_only_where_every_ranks_parts_cut_at_blocks() -> None:
    """The decision is made before the weight is allocated, from the layer's parts on every rank, so all
    ranks hold the same: at TP=2 a replicated 128-row KV head and 128-row q shards are held; down_proj's
    320 input features split at 160 are not (rank 1's slice starts 32 into a block and spans two), on rank 0
    too, and the plan says why."""
    plan = QuantPlan(block_fp8=lambda prefix: True)
    for rank in (0, 1):
        tp = TPContext(rank=rank, size=2)
        qkv = QKVParallelLinear(128, 128, 2, 1, False, tp, plan, "qkv_proj")
        assert isinstance(qkv.weight, BlockFp8Weight) and qkv.weight.shape == (384, 128)
        down = RowParallelLinear(320, 128, False, tp, plan, "down_proj")
        assert not isinstance(down.weight, BlockFp8Weight) and down.weight.shape == (128, 160)
    assert plan.dequantized == {
        "down_proj": "rank 1's input features [0, 160) of 160 come from [160, 320) of the checkpoint tensor, "
        "which starts inside a 128-wide block and spans several"
    }


@pytest.fixture(scope="module")
def aligned_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("block_fp8")
    return write_block_fp8(build_model("qwen3", root / "base", seed=5, **ALIGNED), root)


def test_the_triton_backend_holds_fp8_and_gives_the_dequantized_weights_tokens(aligned_fp8) -> None:
    """Every projection held as bytes (1 byte a weight) and float32 block scales, the start log saying so;
    float32 greedy tokens equal transformers' on the same weights dequantized."""
    fp8, dequantized = aligned_fp8
    llm, line = loaded_with_start_log(model=str(fp8), attention_backend="triton")
    held = [m for m in llm.engine.runner.model.modules() if isinstance(m, BlockFp8Weight)]
    assert len(held) == 8  # qkv, o, gate_up and down in each of 2 layers
    for m in held:
        assert m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float32
        assert m.nbytes == m.weight.numel() + 4 * -(-m.shape[0] // BLOCK) * -(-m.shape[1] // BLOCK)
    assert line["fp8_layers"] == 8 and line["fp8_bytes"] == sum(m.nbytes for m in held), line
    assert line["fp8_dequantized"] == {"count": 0, "first": {}}, line
    assert line["held_as"].startswith("float8_e4m3fn with float32 block scales, run by the Triton kernel")
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out["token_ids"] == hf_greedy(dequantized, prompt, MAX_NEW), prompt


def test_the_triton_backend_in_bfloat16_meets_the_top5_rule(aligned_fp8) -> None:
    """In bf16 the kernel multiplies the bytes' exact values and scales each block's float32 sum, where the
    dequantized path first rounds byte x scale to bf16 (2^-9 relative a weight): within the rounding the
    top-5 rule allows (tests/top5.py), against transformers in bf16 on the dequantized weights, as
    tests/test_fp8_checkpoints.py holds the dequantized C++ path. The projections are held as FP8 as in
    float32 (the plan does not depend on the dtype)."""
    fp8, dequantized = aligned_fp8
    prompts = random_prompts()[:3]  # of 1, 6 and 19 tokens: the interpreter is slow
    name, outcomes = run_case(
        "qwen3 fp8 held", fp8, "bfloat16", "triton", prompts, MAX_NEW, "16MiB", reference=dequantized
    )
    assert_close(name, "bfloat16", outcomes, min_exact=2)


def test_qwen3_5_holds_fp8_but_its_linear_attention_in_proj(tmp_path) -> None:
    """Qwen3.5 as published: in_proj_a and in_proj_b in 16 bits (listed), so the fused in_proj is dequantized
    at load; its out_proj, the gated attention's q+gate/k/v and o, and the MLPs held as FP8. One linear and
    one full-attention layer; float32 greedy tokens equal transformers' on the dequantized weights."""
    base = build_model(
        "qwen3_5", tmp_path / "base", num_layers=2, seed=5, hidden=192, heads=1, kv_heads=1,
        overrides={"head_dim": 128, "intermediate_size": 128, "full_attention_interval": 2},
    )  # fmt: skip
    listed = ("lm_head", "model.embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
    fp8, dequantized = write_block_fp8(base, tmp_path, listed)
    llm, line = loaded_with_start_log(model=str(fp8), attention_backend="triton", max_num_batched_tokens=16)
    held = {n for n, m in llm.engine.runner.model.named_modules() if isinstance(m, BlockFp8Weight)}
    assert held == {
        "model.layers.0.linear_attn.out_proj.weight",
        *(f"model.layers.{i}.mlp.{p}.weight" for i in (0, 1) for p in ("gate_up_proj", "down_proj")),
        "model.layers.1.self_attn.qkv_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
    }
    assert line["fp8_layers"] == len(held), line
    prompt = [5, 6, 7, 8, 9]
    (out,) = llm.generate([prompt], greedy(4), use_tqdm=False)
    assert out["token_ids"] == hf_greedy(dequantized, prompt, 4)


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="two ranks need two GPUs here, and Triton runs on a CPU only in its interpreter (set without one)",
)
def test_two_ranks_hold_their_shards_in_fp8(tmp_path) -> None:
    """TP=2 on the Triton path: each rank's q, k, v, gate and up rows and its o_proj and down_proj input
    features (128 of 256) are whole blocks, read as bytes with their scales; float32 greedy tokens equal
    transformers' on the dequantized weights. (A shard inside a block is refused as the single-rank
    parts are: test_a_shard_keeps_whole_blocks_or_is_refused_by_name.)"""
    base = build_model(
        "qwen3", tmp_path / "base", seed=5, hidden=256, heads=2, kv_heads=2,
        overrides={"head_dim": 128, "intermediate_size": 256},
    )  # fmt: skip
    fp8, dequantized = write_block_fp8(base, tmp_path)
    llm, line = loaded_with_start_log(
        model=str(fp8), attention_backend="triton", tensor_parallel_size=2, device="cpu"
    )
    try:
        assert line["fp8_layers"] == 8, line  # rank 0's
        prompt = [5, 6, 7, 8, 9]
        (out,) = llm.generate([prompt], greedy(4), use_tqdm=False)
        assert out["token_ids"] == hf_greedy(dequantized, prompt, 4)
    finally:
        llm.shutdown()


def test_the_cpu_backend_dequantizes_at_load(aligned_fp8, kernels) -> None:
    llm, line = loaded_with_start_log(model=str(aligned_fp8[0]), attention_backend="cpu_kernel", device="cpu")
    assert not any(isinstance(m, BlockFp8Weight) for m in llm.engine.runner.model.modules())
    assert line["held_as"].startswith("dequantized to the dtype at load"), line
    assert "fp8_layers" not in line


def test_a_fused_part_inside_a_block_is_dequantized_and_named(tmp_path) -> None:
    """k and v of 64 rows each: in the fused qkv projection k ends inside a 128-row block that v goes on in,
    whose scales differ, so qkv_proj is built as a float weight (dequantized at load) and the start log says
    which and why; o_proj, gate_up_proj and down_proj (128-wide) are held as FP8. Float32 greedy tokens
    equal transformers' on the dequantized weights."""
    base = build_model(
        "qwen3", tmp_path / "base", seed=5, hidden=128, heads=2, kv_heads=1, overrides={"head_dim": 64}
    )
    fp8, dequantized = write_block_fp8(base, tmp_path)
    llm, line = loaded_with_start_log(model=str(fp8), attention_backend="triton")
    model = llm.engine.runner.model
    held = {n.removesuffix(".weight") for n, m in model.named_modules() if isinstance(m, BlockFp8Weight)}
    layers = ("model.layers.0", "model.layers.1")
    assert held == {
        f"{i}.{p}" for i in layers for p in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    for layer in layers:
        weight = model.get_submodule(f"{layer}.self_attn.qkv_proj").weight
        assert isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32
    assert line["fp8_layers"] == 6, line
    assert line["fp8_dequantized"] == {
        "count": 2,
        "first": {
            f"{layer}.self_attn.qkv_proj": "k output rows [128, 192) of 256 end inside a 128-wide block "
            "that the next part shares"
            for layer in layers
        },
    }, line
    (out,) = llm.generate([PROMPTS[0]], greedy(MAX_NEW), use_tqdm=False)
    assert out["token_ids"] == hf_greedy(dequantized, PROMPTS[0], MAX_NEW)
