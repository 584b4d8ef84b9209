"""A GGUF file's tensors served as they ship (quantization=auto): which layers keep their Q8_0 / Q4_0 /
Q4_1 blocks (as PackedWeights, split into planes); float tensors and those of any other type the gguf
package dequantizes (the K-quants, Q5_0, ...) are loaded as float, one tensor at a time. A mixture-of-experts projection's
3-D tensor is split into one weight per expert: each expert's rows are a contiguous run of its blocks.
What llama.cpp's converter changed in a tensor is undone either way (Llama's q/k rows here, Qwen3.5's
changes in qwen35.py); blocks after the model's layers (Qwen3.5's multi-token prediction) are not read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.common.errors import UnsupportedModelError
from nanovllm.common.logging import get_logger
from nanovllm.worker.layers.moe import expert_weight_prefix
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, QuantScheme
from nanovllm.worker.model_config import HYBRID_ARCHITECTURES
from nanovllm.worker.models.gguf.layout import (
    hf_tensor_names,
    open_reader,
    rotary_rows_heads,
    tensor_part,
    unpermute_rotary_rows,
)
from nanovllm.worker.models.gguf.qwen35 import Qwen35Tensors

log = get_logger(__name__)


# GGUF tensor types served as they ship (4-bit ones with a min: Q4_0's is -8 times its scale), and the
# float types loaded as float; any other type is dequantized as it loads.
GGUF_SCHEMES = {
    "Q8_0": QuantScheme("Q8_0", 8, 32),
    "Q4_0": QuantScheme("Q4_0", 4, 32),
    "Q4_1": QuantScheme("Q4_1", 4, 32),
}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


# An expert's checkpoint tensor: model.layers.N.mlp.experts.<e>.<projection>.weight.
_EXPERT = re.compile(r"(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<projection>\w+)\.weight$")


def _layer_of(name: str, fused: dict[str, tuple[str, Any]]) -> str:
    """The quantization plan's name for the layer that checkpoint weight `name` goes into."""
    expert = _EXPERT.fullmatch(name)
    if expert is not None:
        return expert_weight_prefix(expert["experts"], int(expert["e"]), expert["projection"])
    layer = name.removesuffix(".weight")
    for part, (fused_name, _) in fused.items():
        layer = layer.replace(f".{part}", f".{fused_name}") if layer.endswith(f".{part}") else layer
    return layer


def _converter_changes(config: Any) -> Qwen35Tensors | None:
    """What undoes llama.cpp's changes to the tensors of a model with ModelConfig `config`, beyond Llama's
    rotary rows (rotary_rows_heads), or None when there are none."""
    return Qwen35Tensors(config.hybrid) if config.architecture in HYBRID_ARCHITECTURES else None


# A Qwen3.5 multi-token prediction block's own tensors (qwen35.py) and the checkpoint's names for them.
_MTP_TENSORS = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}


def _mtp_block(gguf_name: str, config: Any) -> bool:
    """Whether a tensor is of the block after the model's layers (Qwen3.5's multi-token prediction)."""
    return tensor_part(gguf_name)[0] == config.num_hidden_layers


def _served(gguf_name: str, config: Any, mtp: bool = False) -> bool:
    """False for a tensor of a block after the model's layers, but the multi-token prediction block's own
    with `mtp` (its copies of the embedding and the head, which some converters write, are the model's)."""
    block, part = tensor_part(gguf_name)
    if block is None or block < config.num_hidden_layers:
        return True
    return (
        mtp
        and block == config.num_hidden_layers
        and not part.startswith(("nextn.embed", "nextn.shared_head_head"))
    )


def has_mtp_block(gguf_path: Path, config: Any) -> bool:
    """Whether the file holds a multi-token prediction block (its `nextn.eh_proj`) after the layers."""
    return any(
        tensor.name == f"blk.{config.num_hidden_layers}.nextn.eh_proj.weight"
        for tensor in open_reader(gguf_path).tensors
    )


def _mtp_names(gguf_name: str, shape: tuple[int, ...], config: Any) -> list[str]:
    """The checkpoint's `mtp.*` name of a multi-token prediction block's tensor."""
    part = tensor_part(gguf_name)[1]
    if part in _MTP_TENSORS:
        return [_MTP_TENSORS[part]]
    layer = f"model.layers.{config.num_hidden_layers}."
    return [name.replace(layer, "mtp.layers.0.", 1) for name in hf_tensor_names(gguf_name, shape)]


def gguf_quant_plan(gguf_path: Path, config: Any, fused: dict[str, tuple[str, Any]]) -> QuantPlan:
    """The layers that keep their GGUF tensors packed, by layer prefix, for a model of ModelConfig
    `config`. `fused` is the model's packed_modules_mapping: a fused layer (qkv_proj, gate_up_proj, an
    expert's w13, Qwen3.5's in_proj) is packed when all its parts share one type, and dequantized to float
    otherwise (logged); an expert's w13 and w2 are packed together or not at all; a tensor whose quantized
    blocks cannot be put in Hugging Face's order is dequantized (logged)."""
    parts: dict[str, dict[str, str]] = {}  # layer prefix -> {checkpoint tensor: type}
    dequantized: dict[str, int] = {}  # types loaded dequantized (K-quants, ...): tensors of each
    changes = _converter_changes(config)
    for tensor in open_reader(gguf_path).tensors:
        if not _served(tensor.name, config):
            continue
        kind = tensor.tensor_type.name
        names = hf_tensor_names(tensor.name, tuple(int(d) for d in reversed(tensor.shape)))
        if kind not in GGUF_SCHEMES and kind not in _FLOAT_TYPES:
            dequantized[kind] = dequantized.get(kind, 0) + len(names)
        why = changes.unpackable(tensor_part(tensor.name)[1]) if changes is not None else None
        if kind in GGUF_SCHEMES and why is not None:
            log.info("gguf_tensor_dequantized", tensor=tensor.name, type=kind, reason=why)
            kind = f"{kind} dequantized"
        for name in names:
            if name.endswith(".weight"):
                parts.setdefault(_layer_of(name, fused), {})[name] = kind
    by_layer: dict[str, QuantScheme] = {}
    for layer, kinds in parts.items():
        distinct = set(kinds.values())
        if len(distinct) == 1 and distinct <= GGUF_SCHEMES.keys():
            by_layer[layer] = GGUF_SCHEMES[distinct.pop()]
        elif distinct & GGUF_SCHEMES.keys():
            log.info("gguf_layer_dequantized", layer=layer, types=sorted(distinct))
    for layer in [name for name in by_layer if name.endswith((".w13", ".w2"))]:
        stem = layer.rpartition(".")[0]
        if (f"{stem}.w13" in by_layer) != (f"{stem}.w2" in by_layer):
            log.info("gguf_layer_dequantized", layer=layer, types=sorted(parts[layer].values()))
            by_layer.pop(layer)
    if dequantized:
        log.info(
            "gguf_types_dequantized_at_load", tensors=dequantized, served_as_they_ship=list(GGUF_SCHEMES)
        )
    return QuantPlan(by_layer=by_layer)


class GGUFTensor:
    """One GGUF tensor for the loader: packed planes for a quantized type, float32 otherwise."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value
        self.shape = value.shape

    def read(self) -> Any:
        return self.value

    def narrow(self, dim: int, start: int, length: int) -> Any:
        return self.value.narrow(dim, start, length)


def gguf_tensors(gguf_path: Path, config: Any, packed: bool = True, mtp: bool = False) -> Any:
    """Every tensor of the file under transformers' names: Q8_0 / Q4_0 / Q4_1 as PackedWeights over their
    own scales and mins (unless not `packed`, or gguf_quant_plan dequantizes them), every other type as
    float32, dequantized (what the converter changed undone either way: Llama's q/k rows, see
    unpermute_rotary_rows, and Qwen3.5's, see qwen35.py; a 3-D expert tensor one tensor per expert), each
    float32 tensor in its own memory; with `mtp`, the multi-token prediction block as the checkpoint's
    `mtp.*`, dequantized (the head's layer is built in float: one layer). `config` is the model's
    ModelConfig."""
    import gguf
    import torch

    changes = _converter_changes(config)
    not_served = 0
    for tensor in open_reader(gguf_path).tensors:
        if not _served(tensor.name, config, mtp):
            not_served += 1
            continue
        head = _mtp_block(tensor.name, config)
        kind = tensor.tensor_type.name
        part = tensor_part(tensor.name)[1]
        heads = rotary_rows_heads(
            tensor.name, config.architecture, config.num_attention_heads, config.num_key_value_heads
        )
        shape = tuple(int(d) for d in reversed(tensor.shape))
        names = _mtp_names(tensor.name, shape, config) if head else hf_tensor_names(tensor.name, shape)
        rows = int(np.prod(shape[:-1]))
        unpackable = changes is not None and changes.unpackable(part) is not None
        if packed and not head and kind in GGUF_SCHEMES and not unpackable:
            planes = _planes(np.asarray(tensor.data).reshape(rows, -1), kind)
            if heads is not None:
                planes = [None if p is None else unpermute_rotary_rows(p, heads) for p in planes]
            if changes is not None:
                planes = changes.planes(part, planes)
            values: list[Any] = [
                _packed(kind, expert) for expert in zip(*(_split(p, len(names)) for p in planes))
            ]
        else:
            try:
                dense = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            except NotImplementedError as exc:
                raise UnsupportedModelError(
                    f"{gguf_path}: tensor {tensor.name} is stored as {kind}, which the gguf package cannot "
                    f"dequantize"
                ) from exc
            dense = dense.reshape(shape)
            if heads is not None:
                dense = unpermute_rotary_rows(dense, heads)
            if changes is not None:
                dense = changes.dense(tensor.name, part, dense)
            # a 3-D expert tensor: one expert (or an expert's gate, then its up) per run of rows
            pieces = list(dense.reshape(len(names), -1, shape[-1])) if len(names) > 1 else [dense]
            # row-major copies (not views of the read-only mapping; a column reorder leaves other strides)
            values = [torch.from_numpy(np.array(piece, order="C")) for piece in pieces]
        for name, value in zip(names, values):
            yield name, GGUFTensor(tensor.name, value)
    if not_served:
        reason = (
            "the MTP block's copies of the embedding and head"
            if mtp
            else "blocks after the model's layers (MTP)"
        )
        log.info("gguf_tensors_not_served", tensors=not_served, reason=reason)


def _packed(kind: str, planes: tuple[np.ndarray | None, ...]) -> PackedWeight:
    """One weight's (qweight, scales, mins) planes as a PackedWeight over tensors of their own memory."""
    import torch

    qweight, scales, mins = (None if p is None else torch.from_numpy(np.ascontiguousarray(p)) for p in planes)
    assert qweight is not None and scales is not None  # only mins may be absent (Q8_0)
    return PackedWeight.of_planes(GGUF_SCHEMES[kind], 32, qweight, scales, mins)


def _split(plane: np.ndarray | None, count: int) -> list[np.ndarray | None]:
    """A plane's rows cut into `count` equal runs: one per expert, or itself."""
    if plane is None or count == 1:
        return [plane] * count
    return list(plane.reshape(count, -1, *plane.shape[1:]))


def _planes(data: np.ndarray, kind: str) -> list[np.ndarray | None]:
    """A quantized tensor's [rows, blocks * block bytes] as the (qweight, scales, mins) planes."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, _BLOCK_BYTES[kind])
    scales = blocks[:, :, 0:2].copy().view(np.float16).reshape(rows, -1)
    if kind == "Q8_0":
        return [blocks[:, :, 2:].copy().view(np.int8).reshape(rows, -1), scales, None]
    if kind == "Q4_0":  # w = d * (q - 8) = d * q + (-8 d), exact in fp16 for every finite d below 8192
        mins = (scales.astype(np.float32) * -8).astype(np.float16)
        if not np.isfinite(mins).all():
            raise UnsupportedModelError("a Q4_0 block scale of 8192 or more cannot be served as it ships")
        return [blocks[:, :, 2:].reshape(rows, -1), scales, mins]
    mins = blocks[:, :, 2:4].copy().view(np.float16).reshape(rows, -1)
    return [blocks[:, :, 4:].reshape(rows, -1), scales, mins]
