"""Qwen3.5 and Qwen3.5-MoE as llama.cpp ships them (`general.architecture` qwen35, qwen35moe): the
configuration their metadata holds, and what llama.cpp's converter does to their tensors, undone.

The converter (its Qwen3_5TextModel / Qwen3_5MoeTextModel, by way of Qwen3NextModel) writes:

- the layer kinds as `full_attention_interval` (every n-th layer full attention; newer llama.cpp may write
  `attention.recurrent_layers` instead, one flag per layer), the linear layers' shape as `ssm.*` keys
  (`group_count` key heads, `time_step_rank` value heads, `state_size` the key head's width, `inner_size`
  all value heads' width, `conv_kernel`), the rotated dimensions as `rope.dimension_count` (and the
  multimodal RoPE sections, which turn text positions as plain RoPE, so they are not read);
- a multi-token prediction block, when the checkpoint has one, appended after the layers
  (`nextn_predict_layers`): `mtp.layers.0.*` as that block's layer tensors, `mtp.fc` as `nextn.eh_proj`,
  its norms as `nextn.enorm`, `nextn.hnorm` and `nextn.shared_head_norm` (1 + w, as every norm);
  served as the checkpoint's `mtp.*` with speculative_method=mtp (tensors.py), skipped otherwise;
- the convolution's [channels, 1, taps] weight squeezed to [channels, taps];
- A_log as `ssm_a` = -exp(A_log): read back as log(-ssm_a), computed in float64 and rounded to float32:
  A_log, or float32 rounding from it, whose float32 exp is almost always ssm_a's value again
  (the decay is llama.cpp's to float32 rounding; docs/models.md has the counts);
- every zero-centred RMSNorm (all of them but the linear layers' gated norm, `ssm_norm`) as 1 + w, the
  weight llama.cpp multiplies by: read back as that minus 1, which rounds nothing for 1 + w in [0.5, 2]
  (the engine adds the 1 back as it loads: the file's value, the checkpoint's 1 + w in float32);
- where the linear layers have more value heads than key heads, the value heads reordered from grouped by
  key head ([k0's v0..v(r-1), k1's ...], Hugging Face's order, which this engine computes in) to tiled
  ([every key head's v0, every key head's v1, ...], which ggml's broadcasting wants): the value rows of
  `attn_qkv` and `ssm_conv1d`, the rows of `attn_gate`, `ssm_beta` and `ssm_alpha`, the entries of `ssm_a`
  and `ssm_dt`, the columns of `ssm_out`. Put back here: a quantized tensor's rows are its planes' rows;
  `ssm_out`'s columns move in whole blocks when a value head spans whole 32-column blocks (the published
  models' 128) and the tensor is dequantized otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from nanovllm.common.errors import UnsupportedModelError
from nanovllm.worker.model_config import FULL_ATTENTION, LINEAR_ATTENTION, HybridSpec

HYBRID_GGUF_ARCHITECTURES = ("qwen35", "qwen35moe")
# The weights of a quantized block: columns move as whole blocks or not at all.
_BLOCK = 32
# The RMSNorms stored as 1 + w (their llama.cpp names within blk.N, and the final one).
_ZERO_CENTRED = frozenset(
    {
        "attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm",
        "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
    }
)  # fmt: skip


def hybrid_config(arch: str, get: Callable[..., Any], layers: int) -> dict[str, Any]:
    """The config.json fields of the linear layers and the layer kinds, from the `<arch>.*` metadata
    (`get(key, default)` reads one and fails naming it when it is absent and has no default)."""
    flags = get("attention.recurrent_layers", ())  # one flag per block, or one for all
    if isinstance(flags, bool):
        flags = [flags] * layers
    if flags:
        if len(flags) < layers:
            raise UnsupportedModelError(
                f"GGUF {arch}.attention.recurrent_layers has {len(flags)} flags for {layers} layers"
            )
        layer_types = [LINEAR_ATTENTION if flag else FULL_ATTENTION for flag in flags[:layers]]
    else:
        interval = int(get("full_attention_interval", 4))  # llama.cpp's default, as its loader's
        if interval < 1:
            raise UnsupportedModelError(f"GGUF {arch}.full_attention_interval={interval} must be at least 1")
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    value_heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if inner % value_heads:
        raise UnsupportedModelError(
            f"GGUF {arch}.ssm.inner_size={inner} does not split into {arch}.ssm.time_step_rank={value_heads} "
            "value heads"
        )
    return {
        "layer_types": layer_types,
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
    }


def _tiled_rows(key_heads: int, value_heads: int, width: int) -> np.ndarray:
    """For each row of value heads of `width` rows in Hugging Face's grouped order, the row of the file's
    tiled order that holds it: value head r of key head k is head r * key_heads + k there."""
    per_key = value_heads // key_heads
    heads = (np.arange(per_key)[None, :] * key_heads + np.arange(key_heads)[:, None]).reshape(-1)
    return (heads[:, None] * width + np.arange(width)[None, :]).reshape(-1)


@dataclass(frozen=True)
class Qwen35Tensors:
    """Undoes the converter's changes to one file's tensors (the module docstring lists them)."""

    hybrid: HybridSpec

    def _value_rows(self, width: int) -> np.ndarray:
        h = self.hybrid
        return _tiled_rows(h.num_key_heads, h.num_value_heads, width)

    def _reordered(self) -> bool:
        return self.hybrid.num_value_heads != self.hybrid.num_key_heads

    def rows(self, part: str) -> np.ndarray | None:
        """The file's row for each row in Hugging Face's order of the tensor `part` (its llama.cpp name
        within the block), or None where the order is the same."""
        if not self._reordered():
            return None
        h = self.hybrid
        if part in ("attn_qkv", "ssm_conv1d"):  # q and k as they are, then the value heads
            keys = 2 * h.num_key_heads * h.key_head_dim
            return np.concatenate([np.arange(keys), keys + self._value_rows(h.value_head_dim)])
        if part == "attn_gate":
            return self._value_rows(h.value_head_dim)
        if part in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
            return self._value_rows(1)
        return None

    def columns(self, part: str) -> np.ndarray | None:
        """As `rows`, for the tensor's columns (ssm_out's inputs are the value heads)."""
        if part != "ssm_out" or not self._reordered():
            return None
        return self._value_rows(self.hybrid.value_head_dim)

    def unpackable(self, part: str) -> str | None:
        """Why a quantized tensor cannot be served as it ships, or None where it can: a norm's or ssm_a's
        values change (llama.cpp keeps them in float32 anyway), and ssm_out's columns may move within
        blocks."""
        if part in _ZERO_CENTRED or part == "ssm_a":
            return "its values change as it loads (1 + w, -exp(A_log))"
        if self.columns(part) is not None and self.hybrid.value_head_dim % _BLOCK:
            return (
                f"its columns move by value heads of {self.hybrid.value_head_dim}, within blocks of {_BLOCK}"
            )
        return None

    def planes(self, part: str, planes: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """A quantized tensor's (qweight, scales, mins) planes in Hugging Face's order (one `unpackable`
        lets through)."""
        rows, columns = self.rows(part), self.columns(part)
        if rows is not None:
            planes = [None if p is None else p[rows] for p in planes]
        if columns is not None:
            blocks = self._value_rows(self.hybrid.value_head_dim // _BLOCK)
            planes = [None if p is None else _move_blocks(p, blocks) for p in planes]
        return planes

    def dense(self, gguf_name: str, part: str, value: np.ndarray) -> np.ndarray:
        """A float tensor as the Hugging Face checkpoint holds it."""
        rows, columns = self.rows(part), self.columns(part)
        if rows is not None:
            value = value[rows]
        if columns is not None:
            value = value[:, columns]
        if part == "ssm_conv1d":  # squeezed by the converter: [channels, 1, taps] as transformers keeps it
            return value.reshape(value.shape[0], 1, -1)
        if part in _ZERO_CENTRED:
            return value - np.float32(1)
        if part == "ssm_a":
            if not (value < 0).all():
                raise UnsupportedModelError(
                    f"GGUF tensor {gguf_name} holds {value.max()}: llama.cpp's ssm_a is -exp(A_log), below 0"
                )
            return np.log(-value.astype(np.float64)).astype(np.float32)
        return value


def _move_blocks(plane: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """A plane's rows with their blocks (each a run of equal width: bytes, a scale, a min) reordered."""
    rows = plane.shape[0]
    return plane.reshape(rows, len(blocks), -1)[:, blocks].reshape(rows, -1)
