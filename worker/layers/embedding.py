"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.worker.layers.linear import linear
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.loader import CheckpointTensor


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.shard_size = tp.shard(vocab_size, "vocab_size")
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; each rank computes its vocabulary slice, then they are gathered."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.cpu_kernels: ModuleType | None = None  # see DecoderForCausalLM.bind_kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.tp.all_gather_last_dim(linear(hidden, self.weight, None, self.cpu_kernels))
