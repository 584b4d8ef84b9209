"""Weight-only quantization: a linear layer's weights held as 8- or 4-bit integers, activations in the
model's dtype.

A `PackedWeight` stands where a layer's [out_features, in_features] float weight would. Its input features
come in groups (of `group_size`, or a whole row for per-channel int8), each group with a float16 scale s,
and at 4 bits a float16 min m: w = s * q (8 bits, q in [-127, 127]) or w = s * q + m (4 bits, q in [0, 15]).
This is GGUF's layout for Q8_0, Q4_0 and Q4_1 split into planes (4-bit weights in blocks of 32, byte j of a
block holding weight j in its low nibble and 16 + j in its high one), so those files load without passing
through floats, and one C++ kernel (kernels/csrc/linear_quantized_cpu.cpp) runs every kind.

Loading goes through `assign(destination, source)`: a float source is quantized into a packed destination
(Hugging Face checkpoints with quantization int8/int4), a packed one copied plane by plane (GGUF as it
ships), or dequantized into a float destination (a fused projection whose GGUF parts differ in type).

Once loaded, on a CPU whose kernel has AVX512-VNNI, a 16-bit model's 4-bit weights in groups of 32 and 8-bit
weights with one scale a row have their rows interleaved 16 at a time (`interleave_`): the kernel's layout for
a few rows of x, whose loop then takes two thirds of the instructions a weight byte at 4 bits and about half at
8 (docs/performance.md, Measurements behind choices in the code). `dequantize` reads either layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from nanovllm.common.errors import ConfigError
from nanovllm.worker.layers.block_fp8 import BlockFp8Weight, Cuts
from nanovllm.worker.model_config import FP8_BLOCK

BLOCK = 32  # weights per 4-bit block; every group is a whole number of blocks
INTERLEAVED_ROWS = 16  # rows a tile of an interleaved weight holds (kInterleavedRows in the C++ kernel)


@dataclass(frozen=True)
class QuantScheme:
    """How one layer's weights are stored."""

    name: str  # int8, int4, the GGUF type it came from (Q8_0, Q4_0, Q4_1), or fp8 (a BlockFp8Weight)
    bits: int  # 8 or 4
    group_size: int | None  # input features per scale (fp8: the block's side); None: one scale per row


class PackedWeight(nn.Module):
    """A quantized [out_features, in_features] weight: the planes `qweight` (int8 [N, K] at 8 bits, uint8
    [N, K / 2] at 4), `scales` and, at 4 bits, `mins` (float16 [N, K / group_size]). With `interleaved`
    the same planes hold tiles of 16 rows: a tile's bytes [K / 8][16 rows][4 bytes] at 4 bits (each row's 8
    weights of 4 bytes side by side), its scales and mins [K / 32][16 rows]; [K / 4][16 rows][4 bytes] at 8
    bits, whose one scale a row stays in place. A tile is 16 consecutive rows of each plane, so whole tiles
    narrow as rows do."""

    # registered buffers (nn.Module's __getattr__ types them as Tensor | Module)
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    interleaved: bool = False

    def __init__(self, out_features: int, in_features: int, scheme: QuantScheme, layer: str) -> None:
        super().__init__()
        group = scheme.group_size or in_features
        if group % BLOCK or in_features % group:
            raise ConfigError(
                f"quantization {scheme.name}: layer {layer} has {in_features} input features, which groups "
                f"of {group} do not divide (a group must be a multiple of {BLOCK} that divides them)"
            )
        self.scheme, self.group_size = scheme, group
        if scheme.bits == 8:
            qweight = torch.empty(out_features, in_features, dtype=torch.int8)
        else:
            qweight = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        groups = (out_features, in_features // group)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", torch.empty(groups, dtype=torch.float16))
        self.register_buffer("mins", torch.empty(groups, dtype=torch.float16) if scheme.bits == 4 else None)

    @classmethod
    def of_planes(
        cls,
        scheme: QuantScheme,
        group_size: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
    ) -> PackedWeight:
        """A PackedWeight over existing planes (views are kept, not copied)."""
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.scheme, packed.group_size = scheme, group_size
        packed.register_buffer("qweight", qweight)
        packed.register_buffer("scales", scales)
        packed.register_buffer("mins", mins)
        return packed

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.qweight.shape[0], self.scales.shape[1] * self.group_size])

    @property
    def nbytes(self) -> int:
        return sum(
            p.numel() * p.element_size() for p in (self.qweight, self.scales, self.mins) if p is not None
        )

    @property
    def can_interleave(self) -> bool:
        """4 bits in groups of 32 or 8 bits with one scale a row, whole tiles of rows, not interleaved yet."""
        rows, features = self.shape
        group = BLOCK if self.bits == 4 else features
        return self.group_size == group and rows % INTERLEAVED_ROWS == 0 and not self.interleaved

    def interleave_(self) -> PackedWeight:
        """Reorder the planes into tiles of 16 rows (the class docstring's layout), in place of the rows."""
        if not self.can_interleave:
            raise RuntimeError(f"{self.extra_repr()}: only 4 bits in groups of {BLOCK} or 8 bits with one scale a "
                               f"row, in whole tiles of {INTERLEAVED_ROWS} rows, interleave, once")  # fmt: skip
        self.qweight = _interleave(self.qweight, 4)  # a row's 8 weights at 4 bits, 4 at 8: 4 bytes
        if self.mins is not None:  # 4 bits: a scale and a min a group
            self.scales = _interleave(self.scales, 1)
            self.mins = _interleave(self.mins, 1)
        self.interleaved = True
        return self

    def _row_planes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """qweight, scales and mins in the rows' own layout (a copy when interleaved)."""
        if not self.interleaved:
            return self.qweight, self.scales, self.mins
        qweight = _interleave(self.qweight, 4, undo=True)
        if self.mins is None:  # 8 bits: the scales stayed in place
            return qweight, self.scales, None
        return qweight, _interleave(self.scales, 1, undo=True), _interleave(self.mins, 1, undo=True)

    def _check_rows_layout(self, what: str) -> None:
        if self.interleaved:
            raise RuntimeError(f"{self.extra_repr()}: {what} needs the rows' own layout; this weight is "
                               "interleaved for the CPU kernel, after loading")  # fmt: skip

    def narrow(self, dim: int, start: int, length: int) -> PackedWeight:
        """Rows (dim 0; whole tiles when interleaved) or input features (dim 1, whole groups only, the rows'
        layout only) as views of these planes."""
        if dim == 0:
            if self.interleaved and (start % INTERLEAVED_ROWS or length % INTERLEAVED_ROWS):
                raise RuntimeError(f"{self.extra_repr()}: rows [{start}, {start + length}) split tiles of "
                                   f"{INTERLEAVED_ROWS}; an interleaved weight narrows along whole tiles")  # fmt: skip
            rows = PackedWeight.of_planes(
                self.scheme,
                self.group_size,
                self.qweight.narrow(0, start, length),
                self.scales.narrow(0, start, length),
                None if self.mins is None else self.mins.narrow(0, start, length),
            )
            rows.interleaved = self.interleaved
            return rows
        self._check_rows_layout("narrow")
        if start % self.group_size or length % self.group_size:
            raise ConfigError(
                f"quantization {self.scheme.name}: input features [{start}, {start + length}) split groups of "
                f"{self.group_size}; tensor parallelism must shard quantized weights along whole groups"
            )
        per_byte = 8 // self.bits
        g0, groups = start // self.group_size, length // self.group_size
        return PackedWeight.of_planes(
            self.scheme,
            self.group_size,
            self.qweight.narrow(1, start // per_byte, length // per_byte),
            self.scales.narrow(1, g0, groups),
            None if self.mins is None else self.mins.narrow(1, g0, groups),
        )

    def copy_(self, source: PackedWeight) -> PackedWeight:
        self._check_rows_layout("copy_")
        source._check_rows_layout("copy_")
        if source.bits != self.bits or source.group_size != self.group_size or source.shape != self.shape:
            raise ConfigError(
                f"cannot load a {source.scheme.name} weight {tuple(source.shape)} in groups of {source.group_size} "
                f"into a {self.scheme.name} one {tuple(self.shape)} in groups of {self.group_size}"
            )
        for mine, theirs in zip(self._planes(), source._planes()):
            if mine is not None:
                assert theirs is not None  # the same bits: the same planes
                mine.copy_(theirs)
        return self

    def quantize_(self, weight: torch.Tensor) -> PackedWeight:
        """Fill these planes from a float weight of the same shape, rounding each to the nearest level."""
        self._check_rows_layout("quantize_")
        if weight.shape != self.shape:
            raise ConfigError(f"a float weight {tuple(weight.shape)} does not fit {tuple(self.shape)}")
        rows, features = weight.shape
        w = weight.to(self.scales.device, torch.float32).view(rows, -1, self.group_size)
        if self.bits == 8:
            scales = (w.abs().amax(dim=2) / 127).half()
            q = _divide(w, scales).round().clamp(-127, 127).to(torch.int8)
            self.qweight.copy_(q.view(rows, features))
        else:
            low, high = w.amin(dim=2), w.amax(dim=2)
            scales, mins = ((high - low) / 15).half(), low.half()
            q = _divide(w - mins.float().unsqueeze(2), scales).round().clamp(0, 15).to(torch.uint8)
            halves = q.view(rows, -1, 2, BLOCK // 2)  # per block: weights 0-15, then 16-31
            self.qweight.copy_((halves[:, :, 0] | (halves[:, :, 1] << 4)).view(rows, -1))
            assert self.mins is not None  # 4 bits
            self.mins.copy_(mins)
        self.scales.copy_(scales)
        return self

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight (or just `rows` of it), computed as the kernel computes it: s * q exactly, then
        + m rounded once, in float32, then rounded to `dtype`."""
        qweight, scales, mins = self._row_planes()
        if rows is not None:
            qweight, scales = qweight[rows], scales[rows]
            mins = None if mins is None else mins[rows]
        n = qweight.shape[0]
        if self.bits == 8:
            q = qweight.float()
        else:
            blocks = qweight.view(n, -1, BLOCK // 2)
            q = torch.stack([blocks & 0x0F, blocks >> 4], dim=2).view(n, -1).float()
        w = q.view(n, -1, self.group_size) * scales.float().unsqueeze(2)
        if mins is not None:
            w = w + mins.float().unsqueeze(2)
        return w.view(n, -1).to(dtype)

    def _planes(self) -> list[torch.Tensor | None]:
        return [self.qweight, self.scales, self.mins]

    def extra_repr(self) -> str:
        rows = ", rows interleaved" if self.interleaved else ""
        return f"{self.scheme.name}, shape={tuple(self.shape)}, group_size={self.group_size}{rows}"


def _interleave(plane: torch.Tensor, unit: int, undo: bool = False) -> torch.Tensor:
    """A [rows, width] plane, `unit` elements a column, as tiles of 16 rows with each tile's rows and columns
    swapped ([width / unit][16 rows][unit]); `undo` swaps them back."""
    rows, width = plane.shape
    tiles, columns = rows // INTERLEAVED_ROWS, width // unit
    if undo:
        shape = (tiles, columns, INTERLEAVED_ROWS, unit)
    else:
        shape = (tiles, INTERLEAVED_ROWS, columns, unit)
    return plane.view(shape).transpose(1, 2).contiguous().view(rows, width)


def _divide(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w / s per group, with an all-zero group (s = 0) giving q = 0."""
    s = scales.float().unsqueeze(2)
    return torch.where(s == 0, torch.zeros_like(w), w / torch.where(s == 0, torch.ones_like(s), s))


def assign(
    destination: torch.Tensor | PackedWeight | BlockFp8Weight,
    source: torch.Tensor | PackedWeight | BlockFp8Weight,
) -> None:
    """Load `source` into `destination` (a parameter or a slice of one), whatever each is stored as."""
    if isinstance(destination, BlockFp8Weight):
        if not isinstance(source, BlockFp8Weight):
            raise ConfigError(
                f"layer {destination.name} is held in block FP8, but a checkpoint tensor for it is not "
                "(its scales are missing, or quantization_config.modules_to_not_convert names it by another "
                "name); serve it dequantized with --quantization none"
            )
        destination.copy_(source)
    elif isinstance(destination, PackedWeight):
        if isinstance(source, BlockFp8Weight):
            destination.quantize_(source.dequantize(torch.float32))
        elif isinstance(source, PackedWeight):
            destination.copy_(source)
        else:
            destination.quantize_(source)
    elif isinstance(source, (PackedWeight, BlockFp8Weight)):
        destination.copy_(source.dequantize(destination.dtype))
    else:
        destination.copy_(source)


FP8_SCHEME = QuantScheme("fp8", 8, FP8_BLOCK)


@dataclass(frozen=True)
class QuantPlan:
    """Which layers a model builds with packed weights: `by_layer` names them (a GGUF file's quantized
    tensors, by layer prefix such as "model.layers.0.mlp.down_proj"), or `every_linear` applies to every
    projection and `head` to the LM head (int8 / int4 of a float checkpoint); `block_fp8` names the
    projections a block-FP8 checkpoint's bytes are held for (FP8_SCHEME) where their parts cut at its
    blocks, and `make_weight` records in `dequantized` those it built as float weights instead, each with
    why (for the start log). The input embedding takes the head's scheme when it is the head (`tied`);
    otherwise it stays in the model's dtype: a token reads one of its rows, so packing it would save memory
    only, and its error would reach every layer's input."""

    by_layer: dict[str, QuantScheme] | None = None
    every_linear: QuantScheme | None = None
    head: QuantScheme | None = None
    tied: bool = False
    block_fp8: Callable[[str], bool] | None = None
    dequantized: dict[str, str] = field(default_factory=dict)  # filled as the model is built

    def scheme(self, prefix: str, linear: bool) -> QuantScheme | None:
        if self.block_fp8 is not None:
            return FP8_SCHEME if linear and self.block_fp8(prefix) else None
        if self.by_layer is not None:
            return self.by_layer.get(prefix)
        if linear:
            return self.every_linear
        return self.head if prefix == "lm_head" or self.tied else None


def make_weight(
    out_features: int,
    in_features: int,
    plan: QuantPlan | None,
    prefix: str,
    linear: bool,
    cuts: Cuts | None = None,
) -> nn.Parameter | PackedWeight | BlockFp8Weight:
    """The weight a layer named `prefix` holds: packed or block FP8 when the plan says so, else a float
    parameter in the default dtype. `cuts`: where its parts come from (whole when None); block FP8 is held
    only where they cut at the checkpoint's blocks."""
    scheme = plan.scheme(prefix, linear) if plan is not None else None
    if plan is not None and scheme is FP8_SCHEME:
        cuts = cuts or Cuts.whole(out_features, in_features)
        why = cuts.misfit(out_features, in_features, FP8_BLOCK)
        if why is None:
            return BlockFp8Weight(out_features, in_features, FP8_BLOCK, prefix)
        plan.dequantized[prefix] = why
    elif scheme is not None:
        return PackedWeight(out_features, in_features, scheme, prefix)
    return nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
