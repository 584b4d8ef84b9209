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

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.worker.config import ModelConfig, MoeSpec
from nanovllm.worker.layers.linear import linear
from nanovllm.worker.layers.loadable import LoadableTensor
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, assign, make_weight

# Checkpoint projections of expert e, and where each goes: gate and up are w13's two halves, down is w2.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


def _per_expert(weights: list[nn.Parameter | PackedWeight]) -> nn.ParameterList | nn.ModuleList:
    if isinstance(weights[0], PackedWeight):
        return nn.ModuleList(weights)
    return nn.ParameterList(weights)


class Experts(nn.Module):
    """Each expert's weights: w13[e] [2 I, H] (gate rows, then up rows) and w2[e] [H, I], I being this
    rank's share of the expert's intermediate features."""

    def __init__(
        self, spec: MoeSpec, hidden_size: int, tp: TPContext, quant: QuantPlan | None, prefix: str
    ) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate = tp.shard(spec.intermediate_size, "moe_intermediate_size")
        size, experts = self.intermediate, range(spec.num_experts)
        self.w13 = _per_expert(
            [make_weight(2 * size, hidden_size, quant, f"{prefix}.{e}.w13", True) for e in experts]
        )
        self.w2 = _per_expert(
            [make_weight(hidden_size, size, quant, f"{prefix}.{e}.w2", True) for e in experts]
        )
        for weight in (*self.w13, *self.w2):
            weight.weight_loader = self.weight_loader

    def weight_loader(
        self, weight: nn.Parameter | PackedWeight, loaded: LoadableTensor, shard_id: object = None
    ) -> None:
        """One expert's w13 or w2; shard_id: the checkpoint projection (one of EXPERT_PROJECTIONS)."""
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if shard_id == "down_proj":
            assign(weight, loaded.narrow(1, start, size))
        else:
            half = EXPERT_PROJECTIONS.index(shard_id)  # type: ignore[arg-type]
            assign(weight.narrow(0, half * size, size), loaded.narrow(0, start, size))


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
        # See DecoderForCausalLM.bind_kernels.
        self.cpu_kernels: ModuleType | None = None
        self.triton_kernels: ModuleType | None = None
        self.batch_invariant = False

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight, None, self.cpu_kernels, self.triton_kernels, self.batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        probs = F.softmax(self._linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        # (token, slot) pairs grouped by expert, tokens in order within each group.
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=spec.num_experts).tolist()
        out = torch.zeros_like(x)
        kernels = self.triton_kernels or self.cpu_kernels
        begin = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[begin : begin + count]
            begin += count
            tokens = pairs // spec.top_k
            gate_up = self._linear(x.index_select(0, tokens), self.experts.w13[expert])
            if kernels is not None:
                hidden = kernels.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                hidden = F.silu(gate).mul_(up)
            y = self._linear(hidden, self.experts.w2[expert]) * weights[pairs, None]
            out.index_add_(0, tokens, y)
        return self.tp.all_reduce(out)
