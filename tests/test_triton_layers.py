"""The fused Triton layer kernels (kernels/triton_layers.py) against the PyTorch layers they replace, and
the kernels a decode layer launches on the CUDA path. On a CPU the kernels run in Triton's interpreter
(tests/conftest.py turns it on); on a GPU, compiled."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm import LLM, SamplingParams
from nanovllm.kernels import triton_layers
from nanovllm.worker.layers.norm import HeadRMSNorm, RMSNorm
from nanovllm.worker.layers.rotary import RotaryEmbedding, apply_rotary
from nanovllm.worker.models.decoder import DecoderLayer
from nanovllm.worker.step import StepStats

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_rounded_alike(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float) -> None:
    """Both compute in fp32 and round where the other rounds. Their fp32 operations differ (a division by
    a square root for a multiply by a reciprocal square root; a GPU's approximate square root and
    division are within 2 ulps each), so an fp32 result is a few ulps off over a chain of four or so
    operations, and in 16-bit that can flip each of the two roundings to the dtype on the way: two ulps
    of the dtype at the size `scale` of the values rounded."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(out.dtype).eps
    slack = 8 * eps if out.dtype == torch.float32 else 2 * eps
    assert ((out.float() - ref.float()).abs() <= slack * scale).all()
    if out.dtype != torch.float32:
        assert (out == ref).float().mean() > 0.98  # they do round at the same places


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_and_residual_add(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(7, hidden, generator=gen).to(DEVICE, dtype) for _ in range(2))
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.weight.data = (1 + torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    ref = norm(x)
    _assert_rounded_alike(triton_layers.rms_norm(x, norm.weight, norm.eps), ref, ref.abs())
    ref_out, ref_sum = norm.add_and_norm(x.clone(), residual.clone())
    out, summed = x.clone(), residual.clone()
    triton_layers.add_rms_norm_(out, summed, norm.weight, norm.eps)
    assert torch.equal(summed, ref_sum)  # one addition, rounded once by both
    _assert_rounded_alike(out, ref_out, ref_out.abs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_zero_centred_norm_multiplies_by_its_float32_weight_and_rounds_once(dtype):
    """Qwen3.5's norms (weight_offset 1: the weight 1 + w kept in float32): the row normalised in float32,
    times the weight in float32, rounded once, as RMSNorm's PyTorch path (_fp32_norm) and transformers."""
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(7, 96, generator=gen).to(DEVICE, dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-6, weight_offset=1.0).to(DEVICE)
    norm.weight.data = (1 + torch.randn(96, generator=gen) / 4).to(DEVICE)
    assert norm.weight.dtype == torch.float32
    ref = norm(x)
    _assert_rounded_alike(triton_layers.rms_norm(x, norm.weight, norm.eps), ref, ref.abs())
    ref_out, ref_sum = norm.add_and_norm(x.clone(), residual.clone())
    out, summed = x.clone(), residual.clone()
    triton_layers.add_rms_norm_(out, summed, norm.weight, norm.eps)
    assert torch.equal(summed, ref_sum)
    _assert_rounded_alike(out, ref_out, ref_out.abs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gate_up = torch.randn(5, 2 * 200, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate).mul_(up)
    _assert_rounded_alike(triton_layers.silu_and_mul(gate_up), ref, up.abs())


def _assert_stored(k_cache, v_cache, slots, ref_k, ref_v, scale) -> None:
    """k and v in their slots of the caches (k rounded alike), nothing where a slot is negative, and every
    other slot left zero."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    stored = slots >= 0
    _assert_rounded_alike(flat_k[slots[stored]], ref_k[stored], scale)
    assert torch.equal(flat_v[slots[stored]], ref_v[stored])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[stored]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 2, 80), (16, 8, 128)])
def test_qk_norm_rope_store(dtype, qk_norm, heads, kv_heads, head_dim):
    """Qwen3's q/k norm (or none), RoPE and the KV store, against HeadRMSNorm, apply_rotary and an
    index_copy into the cache; a negative slot stores nothing."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    tokens, block_size, num_blocks = 9, 4, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    norm = HeadRMSNorm(heads, kv_heads, head_dim, 1e-6).to(DEVICE, dtype)
    norm.weight.data = (1 + torch.randn(heads + kv_heads, head_dim, generator=gen)).to(DEVICE, dtype)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, dtype).to(DEVICE)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    slots[4] = -1
    cos, sin = rotary.lookup(positions)

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    rotated = apply_rotary(norm(qk) if qk_norm else qk, cos, sin)
    ref_q, ref_k = rotated.split([heads, kv_heads], dim=1)
    ref_v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)

    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    weight = norm.weight if qk_norm else None
    q = triton_layers.qk_norm_rope_store(
        qkv, heads, kv_heads, head_dim, weight, norm.eps, cos, sin, k_cache, v_cache, slots
    )
    # The size of what is rounded: a normalised head's entries are at most sqrt(head_dim), times its weight.
    scale = norm.weight.abs().amax() * head_dim**0.5 if qk_norm else qk.abs().amax()
    _assert_rounded_alike(q, ref_q, scale)
    _assert_stored(k_cache, v_cache, slots, ref_k, ref_v, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim", [(4, 2, 16, 8), (8, 2, 256, 64)])
def test_qk_norm_rope_store_gated_partial(dtype, heads, kv_heads, head_dim, rotary_dim):
    """Qwen3.5's gated attention: each q head followed by its output gate in the row, a zero-centred q/k
    norm (its float32 1 + w, rounded once), RoPE on the first rotary_dim of each head, against the module
    path's ops (HeadRMSNorm, apply_rotary on the slice, the rest passed); the gates are neither read as q
    nor stored."""
    gen = torch.Generator().manual_seed(heads * rotary_dim)
    tokens, block_size, num_blocks = 7, 4, 8
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    norm = HeadRMSNorm(heads, kv_heads, head_dim, 1e-6, weight_offset=1.0).to(DEVICE)
    norm.weight.data = (1 + torch.randn(heads + kv_heads, head_dim, generator=gen) / 4).to(DEVICE)
    assert norm.weight.dtype == torch.float32
    rotary = RotaryEmbedding(rotary_dim, 512, 10000.0, dtype).to(DEVICE)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    slots[2] = -1
    cos, sin = rotary.lookup(positions)

    q, _ = qkv[:, : 2 * heads * head_dim].view(tokens, heads, 2 * head_dim).split(head_dim, dim=-1)
    k, ref_v = qkv[:, 2 * heads * head_dim :].view(tokens, 2 * kv_heads, head_dim).chunk(2, dim=1)
    qk = norm(torch.cat([q, k], dim=1))
    qk = torch.cat([apply_rotary(qk[..., :rotary_dim], cos, sin), qk[..., rotary_dim:]], dim=-1)
    ref_q, ref_k = qk.split([heads, kv_heads], dim=1)

    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    got_q = triton_layers.qk_norm_rope_store(
        qkv, heads, kv_heads, head_dim, norm.weight, norm.eps, cos, sin, k_cache, v_cache, slots, gated=True
    )
    scale = norm.weight.abs().amax() * head_dim**0.5
    _assert_rounded_alike(got_q, ref_q, scale)
    _assert_stored(k_cache, v_cache, slots, ref_k, ref_v, scale)


class _Launches(TorchDispatchMode):
    """Counts what would launch a GPU kernel: every ATen op that is not a view or an allocation (each
    launches at least one), and every Triton kernel call (`triton_run` wraps the kernels' run; what the
    interpreter does with torch inside one is not counted)."""

    FREE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "detach", "lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._inside_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside_triton and not func.is_view and name not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def triton_run(self, run):
        def counted(kernel, *args, **kwargs):
            if self._inside_triton:
                return run(kernel, *args, **kwargs)
            self.count += 1
            self._inside_triton = True
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self._inside_triton = False

        return counted


def test_decode_layer_launches_at_most_12_kernels(qwen3_dir, monkeypatch):
    """A decode step on the CUDA path's code (Triton attention and fused layers; graphs off, every launch
    visible): each Qwen3 layer launches at most 12 kernels (it launched about 21.5 before the fusions,
    measured on an H200)."""
    llm = LLM(
        str(qwen3_dir), dtype="float32", attention_backend="triton", kv_cache_memory="4MiB",
        max_model_len=64, enable_prefix_caching=False, enforce_eager=True,
    )  # fmt: skip
    engine = llm.engine
    for i in range(3):
        engine.add_request(
            str(i), [5 + i, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
    engine.step()  # the prefill
    layers = [m for m in engine.runner.model.modules() if isinstance(m, DecoderLayer)]
    stats, per_layer = step_launches(engine, layers, monkeypatch)
    assert stats.num_decode_tokens == 3 and stats.num_prefill_tokens == 0
    assert len(per_layer) == len(layers) >= 2
    assert max(per_layer) <= 12, per_layer


def step_launches(engine, layers: list[torch.nn.Module], monkeypatch) -> tuple[StepStats, list[int]]:
    """One engine step's stats and the kernels each of `layers` launched in it (_Launches' count), in the
    order the layers ran."""
    counter = _Launches()
    jit_type = type(triton_layers._rms_norm_kernel)  # JITFunction, or the interpreter's InterpretedFunction
    monkeypatch.setattr(jit_type, "run", counter.triton_run(jit_type.run))
    per_layer: list[int] = []
    starts: dict[int, int] = {}

    def before(module, args):
        starts[id(module)] = counter.count

    def after(module, args, output):
        per_layer.append(counter.count - starts[id(module)])

    hooks = [h for m in layers for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        with counter:
            stats = engine.step().stats
    finally:
        for hook in hooks:
            hook.remove()
    return stats, per_layer
