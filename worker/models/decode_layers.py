"""A decode-only step's decoder layers in one C++ call (kernels/csrc/decode_layers_cpu.cpp): the model's own
weights and KV caches handed over once, when the CPU kernels are bound. The same kernels run in the same
order as the modules', so the step's result is the same bit for bit; only Python's dispatch is saved."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from nanovllm.kernels.cpu_kernels import FEW_ROWS_MAX
from nanovllm.worker.layers.linear import ParallelLinear
from nanovllm.worker.layers.quantization import PackedWeight


def _projection(kernels: ModuleType, layer: ParallelLinear, batch_invariant: bool) -> object:
    weight, bias = layer.weight, layer.bias
    if isinstance(weight, PackedWeight):
        return kernels.Projection(
            None,
            weight.qweight,
            weight.scales,
            weight.mins,
            weight.bits,
            weight.group_size,
            bias,
            FEW_ROWS_MAX,
            batch_invariant,
        )
    return kernels.Projection(weight, None, None, None, 0, 0, bias, FEW_ROWS_MAX, batch_invariant)


def build_decode_layers(model: nn.Module, kernels: ModuleType, batch_invariant: bool) -> object | None:
    """kernels.DecodeLayers over the layers of `model` (a DecoderModel: decoder.py imports this module), or
    None while the KV caches are not allocated. batch_invariant: as worker/layers/linear.py's `linear`."""
    if any(layer.self_attn.attn.k_cache.numel() == 0 for layer in model.layers):
        return None
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            kernels.DecoderLayerWeights(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                None if attn.qk_norm is None else attn.qk_norm.weight,
                _projection(kernels, attn.qkv_proj, batch_invariant),
                _projection(kernels, attn.o_proj, batch_invariant),
                _projection(kernels, mlp.gate_up_proj, batch_invariant),
                _projection(kernels, mlp.down_proj, batch_invariant),
                attn.attn.k_cache,
                attn.attn.v_cache,
            )
        )
    first = model.layers[0]
    attn = first.self_attn
    return kernels.DecodeLayers(
        layers, attn.num_heads, attn.num_kv_heads, attn.head_dim, first.input_layernorm.eps, attn.attn.scale
    )
