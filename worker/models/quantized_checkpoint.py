"""Checkpoints quantized before they shipped (config.json's `quantization_config`, read into
worker/model_config.py's CheckpointQuantization), turned into the tensors the loader fills the model with.

- Block FP8 (Qwen's published `-FP8` checkpoints): each quantized `X.weight` is float8_e4m3fn with a
  `X.weight_scale_inv` holding one float32 per 128 x 128 block (the edge blocks partial); the weight is
  byte x scale. With `packed` (where the Triton block-FP8 kernel runs) a matrix is read as a BlockFp8Weight over its bytes and
  scales, which a projection held in block FP8 keeps as they are and any other weight dequantizes;
  without, it is byte x scale computed in float32 (one rounding, as anyone dequantizing it computes it) and
  then stored in the serving dtype like any float checkpoint's, or requantized by `--quantization int8|int4`.
- AWQ (GEMM packing) and GPTQ, 4 bits: `X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`) stand for
  `X.weight` = s (q - z) in groups of input features. They are repacked into this engine's int4
  PackedWeight (w = s q + m, with m = -s z rounded to float16: exact where s z fits float16's 11 bits, as
  it always does for GPTQ's symmetric z = 8, and counted where it does not), or dequantized exactly
  (s (q - z) fits float32) when the engine holds float weights.

Everything else in the file (embeddings, norms, the head, the layers the config lists in
modules_to_not_convert) is read as it ships. Every inconsistency fails at start naming the tensor.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator

import torch

from nanovllm.common.errors import ConfigError
from nanovllm.worker.layers.block_fp8 import BlockFp8Weight
from nanovllm.worker.layers.loadable import LoadableTensor
from nanovllm.worker.layers.quantization import BLOCK, PackedWeight, QuantScheme
from nanovllm.worker.model_config import CheckpointQuantization

FP8_SCALE = "_scale_inv"  # X.weight's block scales are X.weight_scale_inv
INT4_PLANES = ("qweight", "qzeros", "scales")  # every AWQ / GPTQ layer's; GPTQ's g_idx besides
# AWQ's GEMM packing puts output columns 0-7 of an int32 into its nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7:
# column c is in nibble AWQ_NIBBLE[c].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # the 8 nibbles of an int32, lowest first
# A decoder layer's projection (an expert's, Qwen3.5's in_proj_qkv, ...): what the engine holds packed for an
# int4 checkpoint.
_PROJECTION = re.compile(r"\.layers\.\d+\..*proj\w*\.weight$")


class QuantizedCheckpoint:
    """The reader of one quantized checkpoint: `tensors` turns the file's tensors into the model's; the ones
    the model read (a multimodal checkpoint's vision tower and MTP head are not) are counted for the start
    log (`summary`)."""

    def __init__(self, quantization: CheckpointQuantization, packed: bool, source: str) -> None:
        """`packed`: AWQ / GPTQ layers become int4 PackedWeights, block-FP8 matrices BlockFp8Weights (else
        float32, dequantized)."""
        self.quantization, self.packed, self.source = quantization, packed, source
        self.quantized: set[str] = set()  # weights read quantized
        self.unquantized: set[str] = set()  # matrices read as they ship
        self.groups = self.rounded_mins = 0  # int4 groups repacked, and those whose min rounds in float16

    def tensors(self, stream: Iterable[tuple[str, LoadableTensor]]) -> Iterator[tuple[str, LoadableTensor]]:
        named = dict(stream)
        if self.quantization.method == "fp8":
            yield from self._fp8(named)
        else:
            yield from self._int4(named)

    def summary(self) -> dict[str, object]:
        """What was loaded, for the worker's start log."""
        q = self.quantization
        fields: dict[str, object] = {"format": q.method, "quantized_weights": len(self.quantized)}
        if q.method == "fp8":
            held = (
                "float8_e4m3fn with float32 block scales, run by the Triton kernel, in every projection whose "
                "parts all ship in block FP8 and cut at its blocks on every rank; the rest dequantized to the "
                "dtype at load"
                if self.packed
                else "dequantized to the dtype at load (held as FP8 only where the Triton kernel runs: the Triton "
                "backend, CUDA)"
            )
            fields |= {"block": [q.group_size, q.group_size], "held_as": held}
        else:
            held = f"int4 in groups of {q.group_size}" if self.packed else "dequantized to the dtype at load"
            fields |= {"group_size": q.group_size, "held_as": held}
            if self.packed:
                fields["mins_rounded_to_float16"] = f"{self.rounded_mins} of {self.groups} groups"
        # by module, layer and expert numbers as *
        modules = Counter(
            re.sub(r"\.\d+\.", ".*.", name.removesuffix(".weight")) for name in self.unquantized
        )
        fields["unquantized"] = dict(sorted(modules.items()))
        return fields

    def _fp8(self, named: dict[str, LoadableTensor]) -> Iterator[tuple[str, LoadableTensor]]:
        scales = {
            name.removesuffix(FP8_SCALE): named.pop(name) for name in list(named) if name.endswith(FP8_SCALE)
        }
        for name, tensor in named.items():
            scale = scales.pop(name, None)
            if scale is None:
                yield name, self._as_shipped(name, tensor)
                continue
            module = name.rpartition(".")[0]
            if not self.quantization.converts(module):
                raise ConfigError(
                    f"checkpoint tensor {name} in {self.source} has block scales ({name}{FP8_SCALE}), but "
                    f"quantization_config.modules_to_not_convert lists {module}"
                )
            yield (
                name,
                BlockFp8Tensor(tensor, scale, self.quantization.group_size, self.quantized, self.packed),
            )
        if scales:
            orphan = next(iter(scales))
            raise ConfigError(
                f"checkpoint tensor {orphan}{FP8_SCALE} in {self.source} scales no tensor {orphan}"
            )

    def _int4(self, named: dict[str, LoadableTensor]) -> Iterator[tuple[str, LoadableTensor]]:
        layers: dict[str, dict[str, LoadableTensor]] = {}
        for name in list(named):
            module, _, plane = name.rpartition(".")
            if plane in (*INT4_PLANES, "g_idx"):
                layers.setdefault(module, {})[plane] = named.pop(name)
        for module, planes in layers.items():
            missing = [plane for plane in INT4_PLANES if plane not in planes]
            if missing:
                raise ConfigError(
                    f"checkpoint tensor {module}.{missing[0]} is missing from {self.source}: a "
                    f"{self.quantization.method} layer has {', '.join(INT4_PLANES)}"
                )
            yield f"{module}.weight", Int4Tensor(module, planes, self)
        for name, tensor in named.items():
            if self.packed and _PROJECTION.search(name):
                raise ConfigError(
                    f"checkpoint tensor {name} in {self.source} is not quantized, but this engine holds every "
                    f"projection of a {self.quantization.method} checkpoint as int4: serve it dequantized with "
                    "--quantization none"
                )
            yield name, self._as_shipped(name, tensor)

    def _as_shipped(self, name: str, tensor: LoadableTensor) -> LoadableTensor:
        if name.endswith(".weight") and len(tensor.shape) >= 2:
            return UnscaledTensor(tensor, self.source, self.unquantized)
        return tensor


class UnscaledTensor:
    """A tensor read as it ships, refused if it is float8 (a quantized weight whose scales are missing)."""

    def __init__(self, tensor: LoadableTensor, source: str, read: set[str]) -> None:
        """`read`: where its name goes once it is read."""
        self._tensor, self._source, self._read = tensor, source, read
        self.name, self.shape = tensor.name, tensor.shape

    def read(self) -> torch.Tensor | PackedWeight | BlockFp8Weight:
        return self._checked(self._tensor.read())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | PackedWeight | BlockFp8Weight:
        return self._checked(self._tensor.narrow(dim, start, length))

    def _checked(
        self, value: torch.Tensor | PackedWeight | BlockFp8Weight
    ) -> torch.Tensor | PackedWeight | BlockFp8Weight:
        self._read.add(self.name)
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConfigError(
                f"checkpoint tensor {self.name} in {self._source} is {value.dtype} without its block scales: "
                f"{self.name}{FP8_SCALE} is missing"
            )
        return value


class BlockFp8Tensor:
    """A block-FP8 weight [..., N, K] (scale [..., ceil(N / block), ceil(K / block)]) read as float32, each
    byte times its block's scale, or with `held` a matrix as a BlockFp8Weight over its bytes and scales.
    `narrow` reads only the slice's bytes and blocks."""

    def __init__(
        self, weight: LoadableTensor, scale: LoadableTensor, block: int, read: set[str], held: bool = False
    ) -> None:
        """`read`: where its name goes once it is read."""
        self._weight, self._scale, self._block, self._read = weight, scale, block, read
        self.name, self.shape = weight.name, weight.shape
        self._held = held and len(weight.shape) == 2  # stacked experts are never held
        blocks = (*weight.shape[:-2], *(-(-size // block) for size in weight.shape[-2:]))
        if len(weight.shape) < 2 or tuple(scale.shape) != blocks:
            raise ConfigError(
                f"checkpoint tensor {scale.name}: a {tuple(weight.shape)} weight in blocks of {block} x {block} "
                f"has scales {list(blocks)}, got {list(scale.shape)}"
            )

    def read(self) -> torch.Tensor | BlockFp8Weight:
        if self._held:
            self._read.add(self.name)
            return BlockFp8Weight.of(
                _bytes(self._weight.read()), _float(self._scale.read()), self._block, self.name
            )
        return self._dequantize(_float(self._weight.read()), _float(self._scale.read()), 0, 0)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | BlockFp8Weight:
        dim %= len(self.shape)
        if dim < len(self.shape) - 2:  # a leading (expert) dimension: the same slice of the scales
            weight = _float(self._weight.narrow(dim, start, length))
            return self._dequantize(weight, _float(self._scale.narrow(dim, start, length)), 0, 0)
        first, last = start // self._block, (start + length - 1) // self._block
        scale = _float(self._scale.narrow(dim, first, last - first + 1))
        offset = start - first * self._block
        row, column = (offset, 0) if dim == len(self.shape) - 2 else (0, offset)
        if self._held:
            self._read.add(self.name)
            # ends inside a block that goes on past the slice (see BlockFp8Weight.copy_)
            inside = (start + length) % self._block != 0 and start + length < self.shape[dim]
            return BlockFp8Weight.of(
                _bytes(self._weight.narrow(dim, start, length)), scale, self._block, self.name, (row, column),
                (inside, False) if dim == 0 else (False, inside),
            )  # fmt: skip
        return self._dequantize(_float(self._weight.narrow(dim, start, length)), scale, row, column)

    def _dequantize(self, weight: torch.Tensor, scale: torch.Tensor, row: int, column: int) -> torch.Tensor:
        """weight x its blocks' scales, in float32; (row, column): where `weight` starts in the first block."""
        self._read.add(self.name)
        scale = scale.repeat_interleave(self._block, dim=-2).repeat_interleave(self._block, dim=-1)
        rows, columns = weight.shape[-2:]
        return weight * scale[..., row : row + rows, column : column + columns]


def _bytes(value: torch.Tensor | PackedWeight | BlockFp8Weight) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"a block-FP8 weight must be float8_e4m3fn, got {getattr(value, 'dtype', value)}")
    return value


def _float(value: torch.Tensor | PackedWeight | BlockFp8Weight) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ConfigError("a block-FP8 weight or scale read as a packed weight")
    return value.float()


class Int4Tensor:
    """An AWQ or GPTQ layer's planes read as its [N, K] weight: an int4 PackedWeight (its reader's `packed`)
    or float32, w = s (q - z) exactly."""

    def __init__(self, module: str, planes: dict[str, LoadableTensor], reader: QuantizedCheckpoint) -> None:
        self._planes, self._reader = planes, reader
        self.name = f"{module}.weight"
        q = reader.quantization
        rows, columns = planes["qweight"].shape
        # AWQ packs 8 output columns into an int32 ([K, N / 8]), GPTQ 8 input features ([K / 8, N])
        n, k = (columns * 8, rows) if q.method == "awq" else (columns, rows * 8)
        self.shape = torch.Size([n, k])
        groups = (k // q.group_size, n)
        wanted = {"scales": groups, "qzeros": (groups[0], n // 8)}
        for plane, shape in wanted.items():
            if k % q.group_size or tuple(planes[plane].shape) != shape:
                raise ConfigError(
                    f"checkpoint tensor {module}.{plane}: a {q.method} weight of {k} input features and {n} "
                    f"outputs in groups of {q.group_size} has {plane} {list(shape)}, got {list(planes[plane].shape)}"
                )

    def read(self) -> torch.Tensor | PackedWeight:
        q = self._reader.quantization
        self._reader.quantized.add(self.name)
        levels, zeros, scales = self._unpack()  # [N, K], [N, G], [N, G]
        group_of = self._group_of_features()
        if not self._reader.packed:
            columns = torch.arange(self.shape[1]) // q.group_size if group_of is None else group_of
            return (levels - zeros[:, columns]).float() * scales.float()[:, columns]
        if group_of is not None:
            raise ConfigError(
                f"checkpoint tensor {self.name.removesuffix('.weight')}.g_idx: desc_act puts input features in "
                f"activation order, which this engine's int4 groups (runs of {q.group_size} features) cannot "
                "hold; serve it dequantized with --quantization none"
            )
        scheme = QuantScheme(q.method, 4, q.group_size)
        mins = -(scales.float() * zeros)
        half = mins.half()
        self._reader.groups += mins.numel()
        self._reader.rounded_mins += int((half.float() != mins).sum())
        # this engine's 4-bit layout: in each block of 32 features, byte j holds feature j in its low nibble and
        # feature 16 + j in its high one (worker/layers/quantization.py)
        halves = levels.to(torch.uint8).contiguous().view(self.shape[0], -1, 2, BLOCK // 2)
        qweight = (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(self.shape[0], -1)
        return PackedWeight.of_planes(
            scheme, q.group_size, qweight.contiguous(), scales.half().contiguous(), half
        )

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | PackedWeight:
        return self.read().narrow(dim, start, length)

    def _unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The levels q [N, K], zeros z [N, G] (int32) and scales s [N, G] (in their stored dtype)."""
        q = self._reader.quantization
        qweight, qzeros = self._int32("qweight"), self._int32("qzeros")
        scales = _float_plane(self._planes["scales"].read()).t()
        if q.method == "awq":
            order = list(AWQ_NIBBLE)
            levels = _nibbles(qweight)[:, :, order].reshape(self.shape[1], -1).t()
            zeros = _nibbles(qzeros)[:, :, order].reshape(qzeros.shape[0], -1).t()
        else:
            levels = _nibbles(qweight.t()).reshape(
                self.shape[0], -1
            )  # [N, K / 8, 8]: feature 8 r + i in nibble i
            zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1).t() + q.zero_offset
        return levels, zeros, scales

    def _group_of_features(self) -> torch.Tensor | None:
        """GPTQ's g_idx (each input feature's group) where it is not runs of group_size features in order."""
        if "g_idx" not in self._planes:
            return None
        g_idx = _int_plane(self._planes["g_idx"].read()).long()
        in_order = torch.arange(self.shape[1]) // self._reader.quantization.group_size
        if g_idx.shape != in_order.shape:
            raise ConfigError(
                f"checkpoint tensor {self.name.removesuffix('.weight')}.g_idx: {self.shape[1]} "
                f"input features, got {list(g_idx.shape)}"
            )
        return None if torch.equal(g_idx, in_order) else g_idx

    def _int32(self, plane: str) -> torch.Tensor:
        return _int_plane(self._planes[plane].read())


def _int_plane(value: torch.Tensor | PackedWeight | BlockFp8Weight) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
        raise ConfigError(
            f"an int4 checkpoint's packed plane must be int32, got {getattr(value, 'dtype', value)}"
        )
    return value.to(torch.int32)


def _float_plane(value: torch.Tensor | PackedWeight | BlockFp8Weight) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ConfigError("an int4 checkpoint's scales must be floats")
    return value


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., C] int32 -> [..., C, 8]: each int32's 8 nibbles, lowest first."""
    return (packed.unsqueeze(-1) >> _SHIFTS) & 0xF
