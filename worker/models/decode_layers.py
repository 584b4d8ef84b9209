"""A decode-only step's decoder layers in one C++ call (kernels/csrc/decode_layers_cpu.cpp): the model's own
weights, KV caches and (a hybrid model's) state rows handed over once, when the CPU kernels are bound. The
same kernels run in the same order as the modules', so the step's result is the same bit for bit; only
Python's dispatch is saved."""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

import torch

from nanovllm.kernels.cpu_kernels import FEW_ROWS_MAX
from nanovllm.worker.layers.kernels import LayerKernels
from nanovllm.worker.layers.linear import ParallelLinear
from nanovllm.worker.layers.moe import SparseMoeBlock
from nanovllm.worker.layers.quantization import PackedWeight


def _projection(
    kernels: ModuleType,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None,
    layer_kernels: LayerKernels,
) -> object:
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
            layer_kernels.deterministic,
            weight.interleaved,
            layer_kernels.exact_quantized,
        )
    return kernels.Projection(weight, None, None, None, 0, 0, bias, FEW_ROWS_MAX, layer_kernels.deterministic)


def _linear(kernels: ModuleType, layer: ParallelLinear, layer_kernels: LayerKernels) -> object:
    weight = cast("torch.Tensor | PackedWeight", layer.weight)  # block FP8 is held on the Triton backend only
    return _projection(kernels, weight, layer.bias, layer_kernels)


def _mlp(kernels: ModuleType, mlp: Any, layer_kernels: LayerKernels) -> dict[str, object]:
    """The layer weights' arguments for a dense MLP (gate_up, down) or a sparse layer's experts and shared
    expert (moe)."""
    if isinstance(mlp, SparseMoeBlock):
        experts = mlp.experts
        # parameters (float experts) or PackedWeights
        w13 = cast("list[torch.Tensor | PackedWeight]", list(experts.w13))
        w2 = cast("list[torch.Tensor | PackedWeight]", list(experts.w2))
        shared = mlp.shared_expert
        moe = kernels.SparseMoe(
            _projection(kernels, mlp.gate.weight, None, layer_kernels),
            [_projection(kernels, w, None, layer_kernels) for w in w13],
            [_projection(kernels, w, None, layer_kernels) for w in w2],
            mlp.spec.top_k,
            mlp.spec.norm_topk_prob,
            shared_gate_up=None if shared is None else _linear(kernels, shared.gate_up_proj, layer_kernels),
            shared_down=None if shared is None else _linear(kernels, shared.down_proj, layer_kernels),
            shared_gate=None
            if shared is None
            else _projection(kernels, mlp.shared_expert_gate.weight, None, layer_kernels),
        )
        return {"gate_up": None, "down": None, "moe": moe}
    return {
        "gate_up": _linear(kernels, mlp.gate_up_proj, layer_kernels),
        "down": _linear(kernels, mlp.down_proj, layer_kernels),
        "moe": None,
    }


def build_decode_layers(model: torch.nn.Module, kernels: ModuleType, layer_kernels: LayerKernels) -> Any:
    """kernels.DecodeLayers over the layers of `model` (a DecoderModel; its classes go untyped here, as
    decoder.py imports this module), or None while the KV caches are not allocated. layer_kernels: the
    choices worker/layers/linear.py's `linear` reads (deterministic, exact_quantized)."""
    decoder_layers: list[Any] = list(cast(torch.nn.ModuleList, model.layers))
    if any(layer.self_attn.attn.k_cache.numel() == 0 for layer in decoder_layers):
        return None
    layers = []
    for layer in decoder_layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            kernels.DecoderLayerWeights(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                None if attn.qk_norm is None else attn.qk_norm.weight,
                _linear(kernels, attn.qkv_proj, layer_kernels),
                _linear(kernels, attn.o_proj, layer_kernels),
                k_cache=attn.attn.k_cache,
                v_cache=attn.attn.v_cache,
                k_scale=None if attn.attn.kv_scales is None else attn.attn.kv_scales.key,
                v_scale=None if attn.attn.kv_scales is None else attn.attn.kv_scales.value,
                **_mlp(kernels, mlp, layer_kernels),
            )
        )
    first = decoder_layers[0]
    attn = first.self_attn
    return kernels.DecodeLayers(
        layers, attn.num_heads, attn.num_kv_heads, attn.head_dim, first.input_layernorm.eps, attn.attn.scale
    )


def build_hybrid_decode_layers(
    model: torch.nn.Module, kernels: ModuleType, layer_kernels: LayerKernels
) -> Any:
    """kernels.HybridDecodeLayers over a hybrid model's layers (worker/models/qwen3_5.py's HybridModel),
    or None while the KV caches or state rows are not allocated."""
    decoder_layers: list[Any] = list(cast(torch.nn.ModuleList, model.layers))
    layers = []
    for layer in decoder_layers:
        linear = attention = None
        if layer.is_full_attention:
            attn = layer.self_attn
            if attn.attn.k_cache.numel() == 0:
                return None
            scales = attn.attn.kv_scales
            attention = kernels.GatedAttentionWeights(
                _linear(kernels, attn.qkv_proj, layer_kernels),
                _linear(kernels, attn.o_proj, layer_kernels),
                attn.qk_norm.weight,
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.rotary_dim,
                attn.attn.scale,
                attn.attn.k_cache,
                attn.attn.v_cache,
                k_scale=None if scales is None else scales.key,
                v_scale=None if scales is None else scales.value,
            )
        else:
            mixer = layer.linear_attn
            if mixer.conv_state.numel() == 0:
                return None
            linear = kernels.LinearAttentionWeights(
                _linear(kernels, mixer.in_proj, layer_kernels),
                _linear(kernels, mixer.out_proj, layer_kernels),
                mixer.conv1d.weight,
                mixer.A_log,
                mixer.dt_bias,
                mixer.norm.weight,
                mixer.conv_state,
                mixer.recurrent_state,
                mixer.split_sizes,
                mixer.num_key_heads,
                mixer.num_heads,
                mixer.key_dim,
                mixer.value_dim,
                mixer.norm.eps,
            )
        layers.append(
            kernels.HybridLayerWeights(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                linear,
                attention,
                **_mlp(kernels, layer.mlp, layer_kernels),
            )
        )
    return kernels.HybridDecodeLayers(layers, decoder_layers[0].input_layernorm.eps)
