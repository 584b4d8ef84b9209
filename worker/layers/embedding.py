"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.common.errors import ConfigError
from nanovllm.worker.layers.kernels import PYTORCH
from nanovllm.worker.layers.linear import linear
from nanovllm.worker.layers.loadable import LoadableTensor, set_weight_loader
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import INTERLEAVED_ROWS, PackedWeight, QuantPlan, assign, make_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TPContext,
        quant: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.shard_size = tp.shard(vocab_size, "vocab_size")
        self.vocab_start = tp.rank * self.shard_size
        self.dtype = torch.get_default_dtype()  # built in the runner's dtype context: the model's
        # a plan holds block FP8 for projections only (linear=True)
        self.weight = cast(
            "nn.Parameter | PackedWeight",
            make_weight(self.shard_size, hidden_size, quant, prefix, linear=False),
        )
        set_weight_loader(self.weight, self.weight_loader)
        # The C++ CPU kernels when bound (DecoderForCausalLM.bind_kernels): a packed weight's rows in one call.
        self.kernels = PYTORCH

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        vocab_size = self.shard_size * self.tp.size
        if loaded.shape[0] != vocab_size:
            raise ConfigError(
                f"checkpoint tensor {loaded.name} has {loaded.shape[0]} rows; the config's vocab_size is {vocab_size}"
            )
        assign(param, loaded.narrow(0, self.vocab_start, self.shard_size))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        weight, cpu = self.weight, self.kernels.cpu
        if not isinstance(weight, PackedWeight):
            return F.embedding(ids, weight)
        if cpu is not None:
            rows = cpu.dequantize_rows(
                weight.qweight, weight.scales, weight.mins, weight.bits, weight.group_size, ids.flatten(),
                self.dtype, weight.interleaved,
            )  # fmt: skip
        else:
            rows = weight.dequantize(self.dtype, rows=ids.flatten())
        return rows.view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = self._lookup(local.clamp(0, self.shard_size - 1)) * in_shard.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; each rank computes its vocabulary slice, then they are gathered."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TPContext,
        quant: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp, quant, prefix)

    def forward(self, hidden: torch.Tensor, vocab: int = 0) -> torch.Tensor:
        """The logits of every token id, or of the first `vocab` ids only (one rank: the rows are a view)."""
        if vocab and self.tp.size == 1:
            return self._first_rows_logits(hidden, vocab)
        if vocab:
            return self._first_ids_logits(hidden, vocab)
        logits = linear(hidden, self.weight, None, self.kernels)
        return self.tp.all_gather_last_dim(logits)

    def _first_ids_logits(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
        """The logits of the first `vocab` token ids over several ranks: each rank multiplies the rows of
        its slice below `vocab` (none on ranks whose slice starts past it), padded to rank 0's count for the
        gather, which the padding is then cut out of."""
        width = min(vocab, self.shard_size)
        counts = [min(width, max(0, vocab - rank * self.shard_size)) for rank in range(self.tp.size)]
        here = counts[self.tp.rank]
        logits = hidden.new_zeros(hidden.shape[0], width, dtype=hidden.dtype)
        if here:
            logits[:, :here] = self._first_rows_logits(hidden, here)
        gathered = self.tp.all_gather_last_dim(logits)
        return torch.cat([gathered[:, r * width : r * width + n] for r, n in enumerate(counts) if n], dim=-1)

    def _first_rows_logits(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """hidden times the first `rows` rows of this rank's weight; an interleaved weight narrows along whole
        tiles of rows, so it multiplies up to the tile's end and the extra logits are cut off."""
        weight, whole = self.weight, rows
        if isinstance(weight, PackedWeight) and weight.interleaved:
            whole = -(-rows // INTERLEAVED_ROWS) * INTERLEAVED_ROWS  # the rows are whole tiles: within them
        logits = linear(hidden, weight.narrow(0, 0, whole), None, self.kernels)
        return logits if whole == rows else logits[:, :rows].contiguous()

    def token_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Row i's logit of token `token_ids[i]` (float32 [rows]), from that token's row of the head alone:
        a reranker's few logits without the whole vocabulary's. Computed in float32; each rank adds the
        tokens in its slice of the vocabulary."""
        local = token_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        rows = self._lookup(local.clamp(0, self.shard_size - 1)).float()
        logits = (hidden.float() * rows).sum(dim=-1) * in_shard
        return self.tp.all_reduce(logits)
