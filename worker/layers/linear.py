"""Linear layers split across tensor-parallel ranks (Megatron style).

Each weight carries a `weight_loader(param, loaded, shard_id)` that copies this rank's slice of a
checkpoint tensor into it, so loaders never need to know how a layer is partitioned. A weight is a float
parameter, a PackedWeight (weight-only quantization, worker/layers/quantization.py) or a BlockFp8Weight
(a block-FP8 checkpoint's bytes, worker/layers/block_fp8.py); `assign` loads any from any it can hold.
A layer also says, before its weight is allocated, where each of its parts comes from on every rank
(`Cuts`: the same slices its loader reads), so that a block-FP8 weight is held only where they cut at the
checkpoint's blocks on every rank, and built dequantized (the same on every rank) where they do not.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.cpu_kernels import FEW_ROWS_MAX
from nanovllm.worker.layers.block_fp8 import BlockFp8Weight, Cut, Cuts
from nanovllm.worker.layers.kernels import PYTORCH, LayerKernels
from nanovllm.worker.layers.loadable import LoadableTensor, read_float, set_weight_loader
from nanovllm.worker.layers.lora import LoRAWeights, Part
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, assign, make_weight


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight | BlockFp8Weight,
    bias: torch.Tensor | None,
    kernels: LayerKernels = PYTORCH,
) -> torch.Tensor:
    """x @ weight.T + bias. On the C++ CPU kernels when bound: a float weight when x has few rows (a small
    decode batch, a speculative verification), where PyTorch's GEMM is far slower than reading the
    weights once; a packed weight at every size. Without them a packed weight is dequantized per call.
    kernels.deterministic: every row's sums in one order whatever the number of rows (the C++ kernels at
    every size, or the Triton matmul of kernels/triton_layers.py), so a row's result never depends on the
    rows beside it; PyTorch's GEMM picks its blocking, and so its order, by the number of rows. A block-FP8
    weight runs on its Triton kernel (batch-invariant too), or is dequantized per call before the kernels
    are bound (a GPU's activation peak, the FP8 KV cache's calibration)."""
    cpu_kernels, triton_kernels, deterministic = kernels.cpu, kernels.triton, kernels.deterministic
    if isinstance(weight, BlockFp8Weight):
        if kernels.block_fp8 is not None and x.dim() == 2:
            return kernels.block_fp8.linear_block_fp8(x, weight.weight, weight.scale, weight.block, bias)
        weight = weight.dequantize(x.dtype)
    if isinstance(weight, PackedWeight):
        if cpu_kernels is not None and x.dim() == 2:
            return cpu_kernels.linear_quantized(
                x,
                weight.qweight,
                weight.scales,
                weight.mins,
                weight.bits,
                weight.group_size,
                bias,
                deterministic,
                weight.interleaved,
                kernels.exact_quantized,
            )
        weight = weight.dequantize(x.dtype)
    if deterministic and triton_kernels is not None:
        return triton_kernels.linear(x, weight, bias)
    if cpu_kernels is not None and x.dim() == 2 and (deterministic or x.shape[0] <= FEW_ROWS_MAX):
        return cpu_kernels.linear_few_rows(x, weight, bias)
    return F.linear(x, weight, bias)


def _part(tp: TPContext, rank: int, name: str = "") -> str:
    """A part's name in messages, with its rank where there are several."""
    return f"rank {rank}'s {name}".rstrip() if tp.size > 1 else name


class ParallelLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPContext,
        quant: QuantPlan | None = None,
        prefix: str = "",
        cuts: Cuts | None = None,
    ) -> None:
        """`cuts`: where the weight's parts come from on every rank (None: one checkpoint tensor whole)."""
        super().__init__()
        self.tp = tp
        self.kernels = PYTORCH  # see DecoderForCausalLM.bind_kernels
        self.lora: LoRAWeights | None = None  # set by DecoderForCausalLM.enable_lora
        self.weight = make_weight(out_features, in_features, quant, prefix, linear=True, cuts=cuts)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def lora_parts(self) -> list[Part]:
        """The parts of the output an adapter adapts apart, in order (worker/layers/lora.py)."""
        return [(None, 0, self.weight.shape[0])]

    def lora_whole(self, shard: object) -> tuple[int, int]:
        """(input, output) features of output part `shard` before tensor parallelism cut them: an adapter
        gives that part's A as [r, input] and B as [output, r]."""
        return self.weight.shape[1], self.weight.shape[0]

    def lora_shard(
        self, shard: object, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of part `shard`'s whole A and B, cut as the weights are: B's rows where the
        output is split, A's columns where the input is (then each rank adds its partial delta before the
        all-reduce, which sums them)."""
        return a, b

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.kernels)
        if self.lora is not None:
            self.lora.add_to(y, x, self._lora_matmul, self.kernels)
        return y

    def _lora_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight, None, self.kernels)


class ColumnParallelLinear(ParallelLinear):
    """Output features split across ranks; no communication in forward."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPContext,
        quant: QuantPlan | None = None,
        prefix: str = "",
        cuts: Cuts | None = None,
    ) -> None:
        size = tp.shard(out_features, "output features")
        if cuts is None:  # each rank's rows of one tensor
            rows = [Cut(_part(tp, r), 0, r * size, size) for r in range(tp.size)]
            cuts = Cuts(rows, [Cut("", 0, 0, in_features)])
        super().__init__(in_features, size, bias, tp, quant, prefix, cuts)

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        size = param.shape[0]
        assign(param, loaded.narrow(0, self.tp.rank * size, size))

    def lora_whole(self, shard: object) -> tuple[int, int]:
        return self.weight.shape[1], self.weight.shape[0] * self.tp.size

    def lora_shard(
        self, shard: object, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.weight.shape[0]
        return a, b.narrow(0, self.tp.rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate+up)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPContext,
        quant: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        self.output_sizes = output_sizes
        rows = [cut for rank in range(tp.size) for cut in self._row_cuts(replace(tp, rank=rank))]
        cuts = Cuts(rows, [Cut("", 0, 0, in_features)])
        super().__init__(in_features, sum(output_sizes), bias, tp, quant, prefix, cuts)

    def _row_cuts(self, tp: TPContext) -> list[Cut]:
        """Rank tp.rank's rows of each part, as weight_loader reads them."""
        cuts = []
        for index, size in enumerate(self.output_sizes):
            shard, offset = size // tp.size, sum(self.output_sizes[:index]) // tp.size
            cuts.append(Cut(_part(tp, tp.rank, f"part {index}"), offset, tp.rank * shard, shard))
        return cuts

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        index = int(shard_id)  # type: ignore[call-overload]  # gate/up: 0 or 1
        shard = self.output_sizes[index] // self.tp.size
        offset = sum(self.output_sizes[:index]) // self.tp.size
        assign(param.narrow(0, offset, shard), loaded.narrow(0, self.tp.rank * shard, shard))

    def lora_parts(self) -> list[Part]:
        offsets = [sum(self.output_sizes[:i]) // self.tp.size for i in range(len(self.output_sizes))]
        return [
            (i, offset, size // self.tp.size)
            for i, (offset, size) in enumerate(zip(offsets, self.output_sizes))
        ]

    def lora_whole(self, shard: object) -> tuple[int, int]:
        return self.weight.shape[1], self.output_sizes[int(shard)]  # type: ignore[call-overload]  # 0 or 1

    def lora_shard(
        self, shard: object, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.output_sizes[int(shard)] // self.tp.size  # type: ignore[call-overload]  # 0 or 1
        return a, b.narrow(0, self.tp.rank * size, size)


class QKVParallelLinear(ParallelLinear):
    """q, k and v projections fused; heads (not features) are what gets split across ranks, and KV heads
    are replicated when there are fewer of them than ranks. Column-parallel: no communication."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPContext,
        quant: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        self.first_kv_head, self.num_kv_heads = tp.kv_heads(num_kv_heads)
        self.total_num_kv_heads = num_kv_heads
        out_features = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rows = []
        for rank in range(tp.size):  # as weight_loader reads them
            kv_start = replace(tp, rank=rank).kv_heads(num_kv_heads)[0] * head_dim
            rows += [
                Cut(_part(tp, rank, "q"), 0, rank * q_size, q_size),
                Cut(_part(tp, rank, "k"), q_size, kv_start, kv_size),
                Cut(_part(tp, rank, "v"), q_size + kv_size, kv_start, kv_size),
            ]
        cuts = Cuts(rows, [Cut("", 0, 0, hidden_size)])
        super().__init__(hidden_size, out_features, bias, tp, quant, prefix, cuts)

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        kv_start = self.first_kv_head * self.head_dim
        offset, size, start = {
            "q": (0, q_size, self.tp.rank * q_size),
            "k": (q_size, kv_size, kv_start),
            "v": (q_size + kv_size, kv_size, kv_start),
        }[shard_id]  # type: ignore[index]
        assign(param.narrow(0, offset, size), loaded.narrow(0, start, size))

    def lora_parts(self) -> list[Part]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [("q", 0, q_size), ("k", q_size, kv_size), ("v", q_size + kv_size, kv_size)]

    def lora_whole(self, shard: object) -> tuple[int, int]:
        heads = self.num_heads * self.tp.size if shard == "q" else self.total_num_kv_heads
        return self.weight.shape[1], heads * self.head_dim

    def lora_shard(
        self, shard: object, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if shard == "q":
            size = self.num_heads * self.head_dim
            return a, b.narrow(0, self.tp.rank * size, size)
        return a, b.narrow(0, self.first_kv_head * self.head_dim, self.num_kv_heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x)


class RowParallelLinear(ParallelLinear):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPContext,
        quant: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        size = tp.shard(in_features, "input features")
        columns = [Cut(_part(tp, r), 0, r * size, size) for r in range(tp.size)]  # each rank's of one tensor
        cuts = Cuts([Cut("", 0, 0, out_features)], columns)
        super().__init__(size, out_features, bias, tp, quant, prefix, cuts)

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        if param is self.bias:  # added once, on rank 0
            if self.tp.rank == 0:
                param.data.copy_(read_float(loaded))
            else:
                param.data.zero_()
            return
        size = param.shape[1]
        assign(param, loaded.narrow(1, self.tp.rank * size, size))

    def lora_whole(self, shard: object) -> tuple[int, int]:
        return self.weight.shape[1] * self.tp.size, self.weight.shape[0]

    def lora_shard(
        self, shard: object, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.weight.shape[1]
        return a.narrow(1, self.tp.rank * size, size), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self._project(x))


def interleave_packed_weights(model: nn.Module) -> int:
    """Interleave the rows of every packed `weight` that can (4 bits in groups of 32, 8 bits with one scale a
    row: PackedWeight.interleave_), the projections', the embedding's and the head's, for the CPU kernel with
    AVX512-VNNI and 16-bit x; once the weights are loaded (loading, sharding and LoRA's shapes read the rows'
    layout). The experts (`w13`, `w2`) keep theirs. Returns how many were (a tied weight once)."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, PackedWeight) and weight.can_interleave:
            weight.interleave_()
            count += 1
    return count
