"""Mixture-of-experts MLP (Qwen3-MoE), computed once per expert over the tokens that chose it.

A router scores every expert per token; each token takes its top_k experts, weighted by their softmax
probabilities (float32, renormalised over the k when the checkpoint asks). Tokens are then grouped by
expert and each chosen expert runs its SwiGLU MLP once over its group, as vLLM's fused MoE does, so an
expert no token chose is never read: one decode stream reads its k experts' weights, not all of them.

Each expert's two weights (w13: gate and up stacked, w2: down) are float parameters or, with int8/int4
quantization, PackedWeights, and go through the same `linear` as every projection.

Rounding follows transformers' Qwen3MoeSparseMoeBlock: the router's logits in the model's dtype, the
weights rounded to it after the softmax, each expert's output times its weight in the dtype, and the
outputs added into the token's sum in ascending expert order. Tensor parallelism splits every expert's
intermediate features across ranks (gate/up by rows, down by columns), then one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.common.errors import ConfigError
from nanovllm.kernels.cpu_kernels import FEW_ROWS_MAX
from nanovllm.worker.layers.kernels import PYTORCH
from nanovllm.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear, linear
from nanovllm.worker.layers.loadable import LoadableTensor, set_weight_loader
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, assign, make_weight
from nanovllm.worker.model_config import ModelConfig, MoeSpec

# Checkpoint projections of expert e, and where each goes: gate and up are w13's two halves, down is w2.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


def expert_weight_prefix(experts_prefix: str, expert: int, projection: str) -> str:
    """The quantization plan's name for the weight of `expert` that a checkpoint projection (one of
    EXPERT_PROJECTIONS) goes into: `experts_prefix`.<expert>.w13 (gate, up) or .w2 (down)."""
    return f"{experts_prefix}.{expert}.{'w2' if projection == 'down_proj' else 'w13'}"


def _expert_weights(
    count: int, out_features: int, in_features: int, quant: QuantPlan | None, prefix: str, projection: str
) -> nn.ModuleList | torch.Tensor:
    """`count` experts' weights of the one that `projection` goes into (see expert_weight_prefix): a list
    of PackedWeights, or for float weights one [count, out, in] tensor. A layer's experts share one
    quantization scheme."""
    first = make_weight(out_features, in_features, quant, expert_weight_prefix(prefix, 0, projection), True)
    if isinstance(first, PackedWeight):
        # a layer's experts share one quantization scheme: the rest are packed too
        rest = (
            cast(PackedWeight, make_weight(out_features, in_features, quant, name, True))
            for name in (expert_weight_prefix(prefix, e, projection) for e in range(1, count))
        )
        return nn.ModuleList([first, *rest])
    return torch.empty(count, out_features, in_features)


class Experts(nn.Module):
    """Each expert's weights: w13[e] [2 I, H] (gate rows, then up rows) and w2[e] [H, I], I being this
    rank's share of the expert's intermediate features.

    Float weights are stored stacked, w13_stacked [E, 2 I, H] and w2_stacked [E, H, I] (the Triton path's
    grouped matmul reads every expert from one base), and w13[e], w2[e] are parameters viewing their rows,
    which the checkpoint loads through; packed weights (int8/int4) are one PackedWeight per expert."""

    w13_stacked: torch.Tensor | None
    w2_stacked: torch.Tensor | None
    w13: nn.ModuleList | nn.ParameterList
    w2: nn.ModuleList | nn.ParameterList

    def __init__(
        self, spec: MoeSpec, hidden_size: int, tp: TPContext, quant: QuantPlan | None, prefix: str
    ) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate = tp.shard(spec.intermediate_size, "moe_intermediate_size")
        size, count = self.intermediate, spec.num_experts
        w13 = _expert_weights(count, 2 * size, hidden_size, quant, prefix, "gate_proj")
        w2 = _expert_weights(count, hidden_size, size, quant, prefix, "down_proj")
        self.w13_stacked = self.w2_stacked = None
        if isinstance(w13, nn.ModuleList) and isinstance(w2, nn.ModuleList):
            self.w13, self.w2 = w13, w2
            for weight in (*self.w13, *self.w2):
                set_weight_loader(weight, self.weight_loader)
        elif isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
            self._view_stacked(w13, w2)
        else:
            raise ConfigError(
                f"{prefix}: an expert's gate/up and down projections must both be packed or not"
            )

    def _view_stacked(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13_stacked, self.w2_stacked = w13, w2
        self.w13 = nn.ParameterList(nn.Parameter(row, requires_grad=False) for row in w13)
        self.w2 = nn.ParameterList(nn.Parameter(row, requires_grad=False) for row in w2)
        for weight in (*self.w13, *self.w2):
            set_weight_loader(weight, self.weight_loader)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Experts:
        # .to() and friends would convert each expert's view on its own, cutting it from the stacked tensor.
        if self.w13_stacked is None:
            return super()._apply(fn, recurse)
        assert self.w2_stacked is not None  # stacked together
        self._view_stacked(fn(self.w13_stacked), fn(self.w2_stacked))
        return self

    def weight_loader(
        self, weight: nn.Parameter | PackedWeight, loaded: LoadableTensor, shard_id: object = None
    ) -> None:
        """One expert's w13 or w2; shard_id: the checkpoint projection (one of EXPERT_PROJECTIONS)."""
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if shard_id == "down_proj":
            assign(weight, loaded.narrow(1, start, size))
        else:
            half = EXPERT_PROJECTIONS.index(shard_id)
            assign(weight.narrow(0, half * size, size), loaded.narrow(0, start, size))


class SharedExpert(nn.Module):
    """Qwen3.5-MoE's expert that every token runs: a SwiGLU MLP, split across ranks as a dense one."""

    def __init__(
        self, hidden_size: int, size: int, tp: TPContext, quant: QuantPlan | None, prefix: str
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [size, size], False, tp, quant, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(size, hidden_size, False, tp, quant, f"{prefix}.down_proj")


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None, prefix: str) -> None:
        super().__init__()
        spec = cfg.moe
        if spec is None:
            raise ValueError("SparseMoeBlock needs a ModelConfig with a MoeSpec")
        self.spec = spec
        self.tp = tp
        self.gate = Router(spec.num_experts, cfg.hidden_size)
        self.experts = Experts(spec, cfg.hidden_size, tp, quant, f"{prefix}.experts")
        self.shared_expert: SharedExpert | None = None
        if spec.shared_expert_intermediate_size:
            size = spec.shared_expert_intermediate_size
            self.shared_expert = SharedExpert(cfg.hidden_size, size, tp, quant, f"{prefix}.shared_expert")
            self.shared_expert_gate = Router(1, cfg.hidden_size)  # [1, hidden]: the token's gate logit
        self.kernels = PYTORCH  # see DecoderForCausalLM.bind_kernels

    def _linear(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
        return linear(x, weight, None, self.kernels)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top_k experts [T, k] and their weights [T, k] in x's dtype."""
        spec = self.spec
        probs = F.softmax(self._linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def experts_one_by_one(
        self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Each chosen expert's MLP over its tokens, one expert after another (the count per expert is read
        on the host: the CPU path, and the Triton one with quantized experts or --deterministic)."""
        top_k = chosen.shape[1]
        # Rows of (token, slot) pairs grouped by expert, in ascending expert order, tokens in order within
        # each group; row i is token token_of_row[i]'s input.
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.spec.num_experts).tolist()
        experts = [e for e, count in enumerate(counts) if count]
        sizes = [counts[e] for e in experts]
        token_of_row = order // top_k
        inputs = x.index_select(0, token_of_row).split(sizes)
        # parameters (float experts) or PackedWeights
        w13 = cast("list[torch.Tensor | PackedWeight]", [self.experts.w13[e] for e in experts])
        w2 = cast("list[torch.Tensor | PackedWeight]", [self.experts.w2[e] for e in experts])
        if self._grouped_on_cpu(max(sizes), w13):
            # A few rows per expert: every chosen expert's weights in one pass of the threads each, the
            # same sums as one call per expert (a one-stream decode step reads its 8 experts as one stream).
            cpu = self.kernels.cpu
            assert cpu is not None  # checked by _grouped_on_cpu
            gate_ups = cpu.linear_grouped(inputs, w13)
            acts = cpu.silu_and_mul(torch.cat(gate_ups)).split(sizes)
            ys = cpu.linear_grouped(acts, w2)
        else:
            ys = [
                self._linear(self._silu_and_mul(self._linear(xe, a)), b) for xe, a, b in zip(inputs, w13, w2)
            ]
        rows = torch.cat(ys).mul_(weights.flatten()[order, None])
        # A token's rows lie in ascending expert order (it is in a group at most once), so a stable sort by
        # token lines up each token's k outputs in that order; they are added one at a time, rounding after
        # each add as transformers' index_add_ per expert does (one index_add_ per expert, a sort and a
        # scatter each in PyTorch, made the block 4-5% slower at 1 and at 64 tokens).
        by_token = rows.index_select(0, token_of_row.argsort(stable=True)).view(-1, top_k, rows.shape[1])
        out = by_token[:, 0]
        for slot in range(1, top_k):
            out = out + by_token[:, slot]
        return out.contiguous()

    def _grouped_on_cpu(self, most_rows: int, w13: list[torch.Tensor | PackedWeight]) -> bool:
        """Whether linear_grouped computes the experts: the C++ kernels bound, float weights, and few
        enough rows that `linear` would take linear_few_rows for each (PyTorch's GEMM above)."""
        return (
            self.kernels.cpu is not None
            and self.kernels.triton is None
            and (self.kernels.deterministic or most_rows <= FEW_ROWS_MAX)
            and bool(w13)
            and not isinstance(w13[0], PackedWeight)
        )

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        kernels = self.kernels.triton or self.kernels.cpu
        if kernels is not None:
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @property
    def grouped(self) -> bool:
        """Whether the experts run as the grouped Triton kernels (float experts, the Triton kernels bound,
        not --deterministic), which never wait on the device; expert by expert, the counts are read on the
        host, which a CUDA graph cannot capture."""
        return (
            self.kernels.triton is not None
            and self.experts.w13_stacked is not None
            and not self.kernels.deterministic
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        experts = self.experts
        if self.grouped:
            from nanovllm.kernels.triton_moe import fused_experts  # Triton is imported only where it runs

            assert experts.w13_stacked is not None and experts.w2_stacked is not None  # checked by grouped
            out = fused_experts(x, experts.w13_stacked, experts.w2_stacked, chosen, weights)
        else:
            out = self.experts_one_by_one(x, chosen, weights)
        out = self.tp.all_reduce(out)
        if self.shared_expert is not None:  # as transformers: experts + sigmoid(gate) * shared, in the dtype
            shared = self.shared_expert
            shared_out = shared.down_proj(self._silu_and_mul(shared.gate_up_proj(x)))
            gate = self._linear(x, self.shared_expert_gate.weight)
            cpu = self.kernels.cpu
            out = out + (
                cpu.sigmoid_mul(shared_out, gate) if cpu is not None else torch.sigmoid(gate) * shared_out
            )
        return out
