"""A block-FP8 weight held as it ships (Qwen's `-FP8` checkpoints): float8_e4m3fn bytes [N, K] and one
float32 scale per `block` x `block` tile, [ceil(N / block), ceil(K / block)], the edge tiles partial; the
weight is byte x scale. The Triton path runs its projections on these bytes
(kernels/triton_block_fp8.py); elsewhere the checkpoint's weights are dequantized as they load
(worker/models/quantized_checkpoint.py).

A held weight keeps each block's one scale, so every block of it must take whole blocks of one checkpoint
tensor: each part (a fused projection's q, k, v or gate, up; a tensor-parallel rank's slice) must start
at a multiple of the block and end at one or at the weight's end, and its slice of the checkpoint tensor
must start at a block or lie inside one. A layer says where its parts come from (`Cut`s) before its weight
is allocated, and `misfit` tells why they do not cut at blocks, so that the quantization plan builds a
float weight (dequantized at load) instead (worker/layers/quantization.py `make_weight`).

A checkpoint's tensors reach the loader as `BlockFp8Weight` views too (`narrow`: a tensor-parallel rank's
slice, which may start inside a block: `first_row`, `first_column` say where). Copying one into a held
weight (`copy_`) keeps the bytes and scales as they are, and checks the same rule on the slices it is
given: a layer whose loader cut otherwise than its `Cut`s said is refused by name there. A view
dequantizes into a float weight anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.common.errors import ConfigError


@dataclass(frozen=True)
class Cut:
    """One part of a layer's weight along one dimension on one tensor-parallel rank: its `length` rows (or
    input features) at `here` in that rank's weight are those at `there` in the checkpoint tensor. `part`
    names it in messages ("k", "rank 1's k", "" for a whole weight on one rank)."""

    part: str
    here: int
    there: int
    length: int


@dataclass(frozen=True)
class Cuts:
    """Where every part of a layer's [out_features, in_features] weight comes from, on every rank."""

    rows: list[Cut]
    columns: list[Cut]

    @staticmethod
    def whole(out_features: int, in_features: int) -> Cuts:
        """A weight that is one checkpoint tensor whole."""
        return Cuts([Cut("", 0, 0, out_features)], [Cut("", 0, 0, in_features)])

    def misfit(self, out_features: int, in_features: int, block: int) -> str | None:
        """Why these parts cannot keep their checkpoint tensors' `block`-wide scale blocks, or None."""
        return _misfit(self.rows, out_features, block, "output rows") or _misfit(
            self.columns, in_features, block, "input features"
        )


def _misfit(cuts: list[Cut], size: int, block: int, what: str) -> str | None:
    for cut in cuts:
        end, last = cut.here + cut.length, cut.there + cut.length - 1
        where = f"{cut.part} {what} [{cut.here}, {end}) of {size}".lstrip()
        if cut.here % block:
            return f"{where} start inside a {block}-wide block"
        if end % block and end != size:
            return f"{where} end inside a {block}-wide block that the next part shares"
        if cut.there % block and cut.there // block != last // block:
            return (
                f"{where} come from [{cut.there}, {last + 1}) of the checkpoint tensor, which starts inside "
                f"a {block}-wide block and spans several"
            )
    return None


class BlockFp8Weight(nn.Module):
    """An [out_features, in_features] weight as float8_e4m3fn `weight` bytes and float32 `scale` blocks."""

    # registered buffers (nn.Module's __getattr__ types them as Tensor | Module)
    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, out_features: int, in_features: int, block: int, name: str) -> None:
        """`name`: the layer's, for errors."""
        super().__init__()
        self.block, self.name = block, name
        self.first_row = self.first_column = 0
        self.open_end = (False, False)  # a narrowed part that ends inside a block with more of it after
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        blocks = (-(-out_features // block), -(-in_features // block))
        self.register_buffer("scale", torch.empty(blocks, dtype=torch.float32))

    @classmethod
    def of(
        cls,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: int,
        name: str,
        first: tuple[int, int] = (0, 0),
        open_end: tuple[bool, bool] = (False, False),
    ) -> BlockFp8Weight:
        """A BlockFp8Weight over existing bytes and scales (views are kept, not copied); `first`: where the
        bytes start in their first block (row, column)."""
        held = cls.__new__(cls)
        nn.Module.__init__(held)
        held.block, held.name = block, name
        held.first_row, held.first_column = first
        held.open_end = open_end
        held.register_buffer("weight", weight)
        held.register_buffer("scale", scale)
        return held

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return (
            self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()
        )

    def narrow(self, dim: int, start: int, length: int) -> BlockFp8Weight:
        """Rows (dim 0) or input features (dim 1) [start, start + length) with the blocks they lie in."""
        dim %= 2
        origin = (self.first_row, self.first_column)[dim]
        first, last = (origin + start) // self.block, (origin + start + length - 1) // self.block
        offsets = [self.first_row, self.first_column]
        offsets[dim] = (origin + start) % self.block
        ends_inside = (origin + start + length) % self.block != 0
        open_end = list(self.open_end)
        open_end[dim] = open_end[dim] or (ends_inside and start + length < self.shape[dim])
        return BlockFp8Weight.of(
            self.weight.narrow(dim, start, length),
            self.scale.narrow(dim, first, last - first + 1),
            self.block,
            self.name,
            (offsets[0], offsets[1]),
            (open_end[0], open_end[1]),
        )

    def copy_(self, source: BlockFp8Weight) -> BlockFp8Weight:
        """This weight's bytes and scales from `source`'s, which must fill whole blocks of it."""
        if source.shape != self.shape or source.block != self.block:
            raise ConfigError(
                f"checkpoint tensor {source.name} {list(source.shape)} in blocks of {source.block} does not fit "
                f"layer {self.name}'s block-FP8 weight {list(self.shape)} in blocks of {self.block}"
            )
        for dim, what in enumerate(("output rows", "input features")):
            # each block of this weight takes one block of the source: this part starts at a block and
            # ends at one or at the weight's end; the source's starts at a block or lies in one
            start, open_end = (self.first_row, self.first_column)[dim], self.open_end[dim]
            source_start = (source.first_row, source.first_column)[dim]
            if start or open_end or (source_start and source.scale.shape[dim] > 1):
                where = (
                    f"layer {self.name}'s part of {self.shape[dim]} {what} (from {source.name}) "
                    f"{'starts' if start else 'ends'} inside a {self.block}-wide block"
                    if start or open_end
                    else f"checkpoint tensor {source.name}'s slice of {self.shape[dim]} {what} starts "
                    f"{source_start} into a {self.block}-wide block and spans several"
                )
                raise ConfigError(
                    f"block FP8: {where}, and the Triton kernel reads each {self.block} x {self.block} block "
                    f"with one scale; the layer's cuts should have had it built dequantized (a bug: "
                    f"--quantization none serves the checkpoint dequantized)"
                )
        self.weight.copy_(source.weight)
        self.scale.copy_(source.scale)
        return self

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as byte x scale, computed in float32 (one rounding), then rounded to `dtype`."""
        scale = self.scale.repeat_interleave(self.block, dim=0).repeat_interleave(self.block, dim=1)
        rows, columns = self.shape
        scale = scale[self.first_row : self.first_row + rows, self.first_column : self.first_column + columns]
        return (self.weight.float() * scale).to(dtype)

    def extra_repr(self) -> str:
        return f"float8_e4m3fn, shape={tuple(self.shape)}, block={self.block}"
