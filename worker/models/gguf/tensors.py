"""A GGUF file's tensors served as they ship (quantization=auto): which layers keep their Q8_0 / Q4_0 /
Q4_1 blocks (as PackedWeights, split into planes), the rest as float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.common.errors import UnsupportedModelError
from nanovllm.common.logging import get_logger
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, QuantScheme
from nanovllm.worker.models.gguf.layout import hf_tensor_name, open_reader, unpermute_rotary_rows

log = get_logger(__name__)


# GGUF tensor types served as they ship (4-bit ones with a min: Q4_0's is -8 times its scale), and the
# float types loaded as float; any other type runs only dequantized (quantization=none).
GGUF_SCHEMES = {
    "Q8_0": QuantScheme("Q8_0", 8, 32),
    "Q4_0": QuantScheme("Q4_0", 4, 32),
    "Q4_1": QuantScheme("Q4_1", 4, 32),
}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def gguf_quant_plan(gguf_path: Path, fused: dict[str, tuple[str, Any]]) -> QuantPlan:
    """The layers that keep their GGUF tensors packed, by layer prefix. `fused` is the model's
    packed_modules_mapping: a fused layer (qkv_proj, gate_up_proj) is packed when all its parts share one
    type, and dequantized to float otherwise (logged)."""
    parts: dict[str, dict[str, str]] = {}  # layer prefix -> {checkpoint tensor: type}
    for tensor in open_reader(gguf_path).tensors:
        kind = tensor.tensor_type.name
        name = hf_tensor_name(tensor.name)
        if kind not in GGUF_SCHEMES and kind not in _FLOAT_TYPES:
            raise UnsupportedModelError(
                f"{gguf_path}: tensor {tensor.name} ({name}) is stored as {kind}; nanovllm runs "
                f"{', '.join(GGUF_SCHEMES)} tensors as they ship, and float ones: serve this file with "
                f"quantization=none (dequantized) or int8/int4 (requantized)"
            )
        if not name.endswith(".weight"):
            continue
        layer = name.removesuffix(".weight")
        for part, (fused_name, _) in fused.items():
            layer = layer.replace(f".{part}", f".{fused_name}") if layer.endswith(f".{part}") else layer
        parts.setdefault(layer, {})[name] = kind
    by_layer: dict[str, QuantScheme] = {}
    for layer, kinds in parts.items():
        distinct = set(kinds.values())
        if len(distinct) == 1 and distinct <= GGUF_SCHEMES.keys():
            by_layer[layer] = GGUF_SCHEMES[distinct.pop()]
        elif distinct & GGUF_SCHEMES.keys():
            log.info("gguf_layer_dequantized", layer=layer, types=sorted(distinct))
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


def gguf_tensors(gguf_path: Path, config: dict[str, Any] | Any) -> Any:
    """Every tensor of the file under transformers' names: Q8_0 / Q4_0 / Q4_1 as PackedWeights over their
    own scales and mins, float types as float32 (q/k rows un-permuted either way, see
    unpermute_rotary_rows). `config` is the model's ModelConfig."""
    import gguf
    import torch

    for tensor in open_reader(gguf_path).tensors:
        kind = tensor.tensor_type.name
        rows = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
        heads = next((n for key, n in rows.items() if key in tensor.name), None)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if kind in GGUF_SCHEMES:
            planes = _planes(np.asarray(tensor.data).reshape(shape[0], -1), kind)
            if heads is not None:
                planes = [None if p is None else unpermute_rotary_rows(p, heads) for p in planes]
            qweight, scales, mins = (
                None if p is None else torch.from_numpy(np.ascontiguousarray(p)) for p in planes
            )
            value: Any = PackedWeight.of_planes(GGUF_SCHEMES[kind], 32, qweight, scales, mins)
        else:
            values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            values = values.reshape(shape)
            if heads is not None:
                values = unpermute_rotary_rows(values, heads)
            value = torch.from_numpy(np.array(values))  # a copy: the file mapping is read-only
        yield hf_tensor_name(tensor.name), GGUFTensor(tensor.name, value)


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
