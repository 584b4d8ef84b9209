"""Qwen3.5 (transformers' Qwen3_5ForCausalLM): a hybrid of Gated DeltaNet layers (linear attention over a
recurrent state per request) and gated full-attention layers (paged KV cache, as the other decoders).

The full-attention layers differ from Qwen3's in three ways: q_proj also yields a gate per channel
(interleaved per head as [q | gate]) that multiplies the attention's output through a sigmoid; RoPE turns
only the first `rotary_dim` dimensions of each head; the q/k norms, like every RMSNorm of the model but the
linear layers' output norm, are zero-centred (1 + w, folded into the weight as it loads).

A linear-attention layer projects q, k, v (through a causal depthwise convolution with SiLU), the output
gate z, and per value head the write strength b and the decay a; runs the gated delta rule
(worker/layers/gated_delta_rule.py) from the request's state; normalises each head's output and gates it
with SiLU(z). Its state (the convolution's last inputs and the recurrent state, whose shapes the model
declares: `Qwen3_5ForCausalLM.state_layout`) lives in per-request slots the model runner binds
(`conv_state`, `recurrent_state`); the step's StateBatch says which slot
each sequence has and which start from zero. Tensor parallelism splits key and value heads across ranks
as attention heads are split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.attention import AttentionBackend, AttentionMetadata, DecodeBatch, StateBatch
from nanovllm.worker.layers.attention import Attention
from nanovllm.worker.layers.block_fp8 import Cut
from nanovllm.worker.layers.embedding import VocabParallelEmbedding
from nanovllm.worker.layers.gated_delta_rule import causal_conv, causal_conv_step, chunked, recurrent_step
from nanovllm.worker.layers.kernels import PYTORCH, LayerKernels
from nanovllm.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanovllm.worker.layers.loadable import LoadableTensor, set_weight_loader
from nanovllm.worker.layers.lora import Part
from nanovllm.worker.layers.moe import SparseMoeBlock
from nanovllm.worker.layers.norm import HeadRMSNorm, RMSNorm
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import QuantPlan, assign
from nanovllm.worker.layers.rotary import RotaryEmbedding, apply_rotary
from nanovllm.worker.model_config import FULL_ATTENTION, HybridSpec, ModelConfig
from nanovllm.worker.models.decode_layers import build_hybrid_decode_layers
from nanovllm.worker.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP, DecoderModel


@dataclass(frozen=True)
class StateLayout:
    """One request's state on one rank: in each of `num_layers` linear-attention layers, the convolution's
    last inputs ([channels, K - 1], in the model's dtype) and the recurrent state ([value heads, key dim,
    value dim], in `recurrent_dtype`)."""

    num_layers: int
    conv: tuple[int, int]
    recurrent: tuple[int, int, int]
    recurrent_dtype: torch.dtype = torch.float32

    def bytes_per_slot(self, element_size: int) -> int:
        """One slot's bytes with the convolution's state at `element_size` (the model's dtype)."""
        recurrent = math.prod(self.recurrent) * self.recurrent_dtype.itemsize
        return self.num_layers * (math.prod(self.conv) * element_size + recurrent)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None, prefix: str) -> None:
        super().__init__()
        d = cfg.head_dim
        tp.shard(cfg.num_attention_heads, "num_attention_heads")
        # q_proj's rows are [q | gate] per head: as 2 * heads heads of head_dim, a rank's share of them
        # is its heads' q and gate.
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, 2 * cfg.num_attention_heads, cfg.num_key_value_heads, cfg.spec.qkv_bias,
            tp, quant, f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, cfg.spec.o_bias, tp, quant, f"{prefix}.o_proj"
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)
        self.qk_norm = HeadRMSNorm(self.num_heads, self.num_kv_heads, d, cfg.rms_norm_eps, weight_offset=1.0)
        self.head_dim = d
        assert cfg.hybrid is not None  # a hybrid model's config
        self.rotary_dim = cfg.hybrid.rotary_dim
        self.kernels = PYTORCH  # see Qwen3_5ForCausalLM.bind_kernels
        # On the Triton path (bound there too): the q/k norm, the partial RoPE and the K/V store as one
        # kernel (kernels/triton_layers.py's qk_norm_rope_store), and the output gate as one kernel reading
        # the gate in place.
        self.fused_qk_store: Callable[..., torch.Tensor] | None = None
        self.fused_gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens, d, heads = x.shape[0], self.head_dim, self.num_heads
        qkv = self.qkv_proj(x)
        q, gate = qkv[:, : 2 * heads * d].view(tokens, heads, 2 * d).split(d, dim=-1)
        attn = self.attn
        if self.fused_qk_store is not None and attn.k_cache.numel():
            q = self.fused_qk_store(
                qkv, heads, self.num_kv_heads, d, self.qk_norm.weight, self.qk_norm.eps, *rope, attn.k_cache,
                attn.v_cache, meta.slot_mapping, scales=attn.kv_scales, gated=True,
            )  # fmt: skip
            out = attn.attend_cached(q, meta)
        else:
            k, v = qkv[:, 2 * heads * d :].view(tokens, 2 * self.num_kv_heads, d).chunk(2, dim=1)
            qk = self.qk_norm(torch.cat([q, k], dim=1))
            rotate = (
                apply_rotary if self.kernels.cpu is None else self.kernels.cpu.rotary
            )  # the same roundings
            turned = rotate(qk[..., : self.rotary_dim], *rope)
            qk = torch.cat([turned, qk[..., self.rotary_dim :]], dim=-1)
            q, k = qk.split([heads, self.num_kv_heads], dim=1)
            out = attn(q, k, v.contiguous(), meta)
        cpu = self.kernels.cpu
        if self.fused_gate is not None:
            return self.o_proj(self.fused_gate(out, gate))
        gate = gate.reshape(tokens, heads * d)
        return self.o_proj(cpu.sigmoid_mul(out, gate) if cpu is not None else out * torch.sigmoid(gate))


def _split_rows(whole_sizes: list[int], tp: TPContext) -> list[tuple[int, int, int]]:
    """(offset here, offset in the checkpoint, rows) of this rank's share of each consecutive part."""
    parts, here, there = [], 0, 0
    for size in whole_sizes:
        local = size // tp.size
        parts.append((here, there + tp.rank * local, local))
        here, there = here + local, there + size
    return parts


class LinearAttentionInProj(MergedColumnParallelLinear):
    """q, k, v, z, b and a in one matmul. The checkpoint holds q, k and v as one tensor (in_proj_qkv,
    loaded as shard "qkv"), z, b and a as three (shards 3, 4, 5); so does a LoRA adapter."""

    def weight_loader(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        if shard_id != "qkv":
            super().weight_loader(param, loaded, shard_id)
            return
        for here, there, rows in _split_rows(self.output_sizes[:3], self.tp):
            assign(param.narrow(0, here, rows), loaded.narrow(0, there, rows))

    def _row_cuts(self, tp: TPContext) -> list[Cut]:
        """q, k and v from one tensor (in_proj_qkv), at their offsets in it; z, b and a as merged parts."""
        merged = super()._row_cuts(tp)
        qkv = [
            Cut(f"{cut.part} ({name} of in_proj_qkv)", here, there, rows)
            for name, cut, (here, there, rows) in zip("qkv", merged, _split_rows(self.output_sizes[:3], tp))
        ]
        return [*qkv, *merged[3:]]

    def lora_parts(self) -> list[Part]:
        """in_proj_qkv's part: this rank's q, k and v, which lie together here."""
        parts = super().lora_parts()
        return [("qkv", 0, sum(size for _, _, size in parts[:3])), *parts[3:]]

    def lora_whole(self, shard: object) -> tuple[int, int]:
        if shard == "qkv":
            return self.weight.shape[1], sum(self.output_sizes[:3])
        return super().lora_whole(shard)

    def lora_shard(
        self, shard: object, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if shard != "qkv":
            return super().lora_shard(shard, a, b)
        return a, torch.cat(
            [b.narrow(0, there, rows) for _, there, rows in _split_rows(self.output_sizes[:3], self.tp)]
        )


class GatedRMSNorm(nn.Module):
    """Each head's output normalised (fp32, rounded to the dtype), times the weight, times SiLU(gate).
    On PyTorch on every backend: its row-wise rms_norm takes each head's sum of squares in the order
    transformers' mean does, and so equals transformers' in bf16; a C++ row kernel summing in sequence
    differed in about 2 of 100,000 outputs by a bf16 step, which on a random model's flat distributions moved
    greedy tokens (tests/test_qwen3_5.py::test_bf16_meets_the_top5_rule). The CPU decode step's kernel
    (gated_rms_norm) sums in PyTorch's order and equals this bit for bit. Each row is normalised on its
    own, so a head's result does not depend on the step's other rows (--deterministic)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        # On the Triton path, kernels/triton_gated_delta.py's one kernel with these roundings (bound by
        # Qwen3_5ForCausalLM.bind_kernels); its sums follow the GPU's order, not PyTorch's.
        self.fused: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [rows, dim]; gate [tokens, heads * dim] (rows = tokens x heads), as the projection gives it."""
        if self.fused is not None:
            return self.fused(x, gate, self.weight, self.eps)
        normed = F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.reshape(x.shape).float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None, prefix: str) -> None:
        super().__init__()
        assert cfg.hybrid is not None  # a hybrid model's config
        h: HybridSpec = cfg.hybrid
        self.tp = tp
        self.num_key_heads = tp.shard(h.num_key_heads, "linear_num_key_heads")
        self.num_heads = tp.shard(h.num_value_heads, "linear_num_value_heads")
        self.key_dim, self.value_dim = h.key_head_dim, h.value_head_dim
        key_size, value_size = h.num_key_heads * h.key_head_dim, h.num_value_heads * h.value_head_dim
        self.conv_sizes = [key_size, key_size, value_size]
        sizes = [*self.conv_sizes, value_size, h.num_value_heads, h.num_value_heads]
        self.in_proj = LinearAttentionInProj(cfg.hidden_size, sizes, False, tp, quant, f"{prefix}.in_proj")
        self.split_sizes = [sum(sizes[:3]) // tp.size, *(s // tp.size for s in sizes[3:])]
        channels = self.split_sizes[0]
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(channels, h.conv_kernel_size), requires_grad=False)
        set_weight_loader(self.conv1d.weight, self._load_conv)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        set_weight_loader(self.A_log, self._load_per_head)
        set_weight_loader(self.dt_bias, self._load_per_head)
        self.norm = GatedRMSNorm(h.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_size, cfg.hidden_size, False, tp, quant, f"{prefix}.out_proj")
        # Bound by the model runner to this layer's share of the state slots: [slots, channels, K - 1] in the
        # model's dtype and [slots, heads, key dim, value dim] in fp32.
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)
        # Bound by Qwen3_5ForCausalLM.bind_kernels: the gates on the C++ CPU kernels, the state work on
        # kernels.gated_delta (a decode step's convolution and recurrent step on the state rows in place).
        self.kernels = PYTORCH
        # Prompt chunks token by token through the decode step's own arithmetic: under --deterministic, so a
        # token's result does not depend on how its prompt was cut into steps (the chunked form's sums follow
        # its 64-token blocks, which start where the chunk does), and on Triton without a chunked kernel for
        # prompts (kernels.gated_delta_prompts), where PyTorch's chunked form's many small ops per sequence
        # would each be a launch.
        self.prompts_token_by_token = False

    def _load_conv(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        for here, there, rows in _split_rows(self.conv_sizes, self.tp):
            part = loaded.narrow(0, there, rows)
            assert isinstance(part, torch.Tensor)  # a convolution's weight is never packed
            assign(param.narrow(0, here, rows), part.reshape(rows, -1))

    def _load_per_head(self, param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
        assign(param, loaded.narrow(0, self.tp.rank * self.num_heads, self.num_heads))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [T, channels] as q, k [T, key heads, dk] and v [T, heads, dv]."""
        key_size = self.num_key_heads * self.key_dim
        q, k, v = mixed.split([key_size, key_size, self.num_heads * self.value_dim], dim=-1)
        tokens = mixed.shape[0]
        return (
            q.reshape(tokens, -1, self.key_dim),
            k.reshape(tokens, -1, self.key_dim),
            v.reshape(tokens, -1, self.value_dim),
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        mixed, z, b, a = self.in_proj(x).split(self.split_sizes, dim=-1)
        if self.kernels.gated_delta is not None:
            g, beta = self.kernels.gated_delta.delta_gates(a, b, self.A_log, self.dt_bias)
        else:
            beta = b.sigmoid()
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = cast(torch.Tensor, self.conv1d.weight)  # a parameter of a bare nn.Module
        out = torch.empty(x.shape[0], self.num_heads, self.value_dim, dtype=x.dtype, device=x.device)
        states = meta.states
        if states is None or not self.conv_state.numel():
            # No state slots (the runner measuring a step's memory): every sequence from the zero state.
            begin = 0
            for n in _sequence_lengths(meta):
                rows = slice(begin, begin + n)
                mixed_rows, _ = causal_conv(mixed[rows], weight, None)
                out[rows] = chunked(*self._heads(mixed_rows), g[rows], beta[rows], None)[0]
                begin += n
        else:
            self._run_with_states(mixed, g, beta, weight, states, out)
        normed = self.norm(out.view(-1, self.value_dim), z)
        return self.out_proj(normed.view(x.shape[0], -1))

    def _run_with_states(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        weight: torch.Tensor,
        states: StateBatch,
        out: torch.Tensor,
    ) -> None:
        """The step's sequences from their slots' state, which they leave updated: decodes all at once
        (the recurrent form), chunks one by one (the chunked form), each cut where a copy of its state is
        kept (a block boundary the block manager chose)."""
        conv_state, recurrent_state = self.conv_state, self.recurrent_state
        self.prepare_states(states)
        nd = states.num_decodes
        rule = self.kernels.gated_delta
        if nd and rule is not None:  # the recurrent form on each sequence's state row, in place
            slots = states.slots[:nd]
            q, k, v = self._heads(rule.causal_conv_decode_(mixed[:nd], conv_state, weight, slots))
            rule.gated_delta_decode_(q, k, v, g[:nd], beta[:nd].float(), recurrent_state, slots, out=out[:nd])
        elif nd:  # the recurrent form, all at once
            slots = states.slots[:nd]
            mixed_rows, conv = causal_conv_step(mixed[:nd], weight, conv_state.index_select(0, slots))
            conv_state.index_copy_(0, slots, conv)
            recurrent = recurrent_state.index_select(0, slots)
            o, s = recurrent_step(*self._heads(mixed_rows), g[:nd], beta[:nd], recurrent)
            recurrent_state.index_copy_(0, slots, s)
            out[:nd] = o
        self.keep_decode_states(states)
        begin = nd
        entries = zip(states.slot_list[nd:], states.num_tokens[nd:], states.saves[nd:])
        batched: list[tuple[int, list[tuple[slice, list[int]]]]] = []  # prompts for gated_delta_prompts
        for i, (slot, n, saves) in enumerate(entries):
            # A verification's tokens one at a time through the decode step's arithmetic, as the decode
            # steps it stands for compute them; its saves after each token keep what a rejection rolls back to.
            verify = i < states.num_verifies
            cuts = sorted({offset for offset, _ in saves} | {n})
            if not verify and self.kernels.gated_delta_prompts is not None:
                pieces, done = [], 0
                for end in cuts:
                    pieces.append((slice(begin + done, begin + end), [r for o, r in saves if o == end]))
                    done = end
                batched.append((slot, pieces))
                begin += n
                continue
            done = 0
            for end in cuts:
                if end > done:
                    rows = slice(begin + done, begin + end)
                    if verify and rule is None:
                        self._decode_rows(
                            mixed, g, beta, weight, states.slots[nd + i : nd + i + 1], rows, out
                        )
                    elif rule is not None and (verify or self.prompts_token_by_token):
                        q, k, v = self._heads(rule.causal_conv_chunk_(mixed[rows], conv_state, weight, slot))
                        rule.gated_delta_chunk_(
                            q, k, v, g[rows], beta[rows].float(), recurrent_state, slot, out=out[rows]
                        )
                    else:
                        mixed_rows, conv_state[slot] = causal_conv(mixed[rows], weight, conv_state[slot])
                        out[rows], recurrent_state[slot] = chunked(
                            *self._heads(mixed_rows), g[rows], beta[rows], recurrent_state[slot]
                        )
                    done = end
                for offset, row in saves:
                    if offset == end:
                        self._keep(slot, row)
            begin += n
        if batched:
            self._prompts_together(mixed, g, beta, weight, batched, out)

    def _prompts_together(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        weight: torch.Tensor,
        batched: list[tuple[int, list[tuple[slice, list[int]]]]],
        out: torch.Tensor,
    ) -> None:
        """Prompt chunks through kernels.gated_delta_prompts, the sequences together: each sequence's rows
        come in pieces that end where the step keeps a copy of its state (the snapshot rows after each), so
        round r runs every sequence's r-th piece in one call (the convolution on gated_delta's kernel, a
        sequence at a time), then keeps those copies."""
        rule, prompts = self.kernels.gated_delta, self.kernels.gated_delta_prompts
        assert rule is not None and prompts is not None  # bound together (Qwen3_5ForCausalLM.bind_kernels)
        for r in range(max(len(pieces) for _, pieces in batched)):
            round_ = [(slot, *pieces[r]) for slot, pieces in batched if r < len(pieces)]
            runs = [(slot, rows) for slot, rows, _ in round_ if rows.stop > rows.start]
            if runs:
                heads = [
                    self._heads(rule.causal_conv_chunk_(mixed[rows], self.conv_state, weight, slot))
                    for slot, rows in runs
                ]
                q, k, v = (torch.cat(parts) for parts in zip(*heads, strict=True))
                result = prompts(
                    q, k, v, torch.cat([g[rows] for _, rows in runs]), torch.cat([beta[rows] for _, rows in runs]),
                    self.recurrent_state, [slot for slot, _ in runs], [rows.stop - rows.start for _, rows in runs],
                )  # fmt: skip
                first = 0
                for _, rows in runs:
                    out[rows] = result[first : first + rows.stop - rows.start]
                    first += rows.stop - rows.start
            for slot, _, keeps in round_:
                for row in keeps:
                    self._keep(slot, row)

    def _decode_rows(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        weight: torch.Tensor,
        slot: torch.Tensor,
        rows: slice,
        out: torch.Tensor,
    ) -> None:
        """The recurrent form on PyTorch's ops, one row at a time, from and into state slot `slot` ([1])."""
        conv_state, recurrent_state = self.conv_state, self.recurrent_state
        for r in range(rows.start, rows.stop):
            mixed_row, conv = causal_conv_step(mixed[r : r + 1], weight, conv_state.index_select(0, slot))
            conv_state.index_copy_(0, slot, conv)
            recurrent = recurrent_state.index_select(0, slot)
            o, s = recurrent_step(*self._heads(mixed_row), g[r : r + 1], beta[r : r + 1], recurrent)
            recurrent_state.index_copy_(0, slot, s)
            out[r : r + 1] = o

    def prepare_states(self, states: StateBatch) -> None:
        """Before the step: sequences that start here from the zero state, prefix-cache hits from their
        snapshot. (A replayed decode graph has this done outside it: worker/runner/decode_graphs.py.)"""
        if states.fresh_slots is not None:
            self.conv_state.index_fill_(0, states.fresh_slots, 0)
            self.recurrent_state.index_fill_(0, states.fresh_slots, 0)
        for row, slot in states.restores:
            self.conv_state[slot], self.recurrent_state[slot] = (
                self.conv_state[row],
                self.recurrent_state[row],
            )

    def keep_decode_states(self, states: StateBatch) -> None:
        """After the decode rows: the copies of their state the step keeps (each after its token)."""
        nd = states.num_decodes
        for slot, saves in zip(states.slot_list[:nd], states.saves[:nd]):
            for _, row in saves:
                self._keep(slot, row)

    def _keep(self, slot: int, row: int) -> None:
        """Copy slot's state into snapshot row `row`."""
        self.conv_state[row] = self.conv_state[slot]
        self.recurrent_state[row] = self.recurrent_state[slot]


def _sequence_lengths(meta: AttentionMetadata) -> list[int]:
    """Each sequence's token count in the step's layout order, from the attention metadata."""
    lengths = [1] * meta.decode.context_lens.shape[0] if meta.decode is not None else []
    for batch in (meta.fresh, meta.cached):
        if batch is not None:
            lengths += batch.query_lens.tolist()
    return lengths


class HybridDecoderLayer(DecoderLayer):
    """The decoder's layer with Qwen3.5's token mixer: gated attention or Gated DeltaNet by `layer_types`."""

    # not a DecoderAttention: the layer is a DecoderLayer for its forward and MLP, not for its attention
    self_attn: GatedAttention  # type: ignore[assignment]

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext,
        quant: QuantPlan | None,
        prefix: str,
        index: int,
        mtp: bool = False,
    ) -> None:
        """Layer `index` of the model, or (`mtp`) the multi-token-prediction head's layer: full attention,
        with experts in a mixture-of-experts model."""
        nn.Module.__init__(self)
        assert cfg.hybrid is not None  # a hybrid model's config
        self.is_full_attention = mtp or cfg.hybrid.layer_types[index] == FULL_ATTENTION
        if self.is_full_attention:
            self.self_attn = GatedAttention(cfg, tp, quant, f"{prefix}.self_attn")
        else:
            self.linear_attn = GatedDeltaNet(cfg, tp, quant, f"{prefix}.linear_attn")
        self.mlp: DecoderMLP | SparseMoeBlock
        if cfg.moe is not None and (mtp or index in cfg.moe.sparse_layers):
            self.mlp = SparseMoeBlock(cfg, tp, quant, f"{prefix}.mlp")
        else:
            self.mlp = DecoderMLP(cfg, tp, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_offset=1.0)

    def mix(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.self_attn(rope, x, meta) if self.is_full_attention else self.linear_attn(x, meta)


class HybridModel(DecoderModel):
    """The decoder's embedding, layer loop and final norm (DecoderModel.forward) over hybrid layers; RoPE
    turns `rotary_dim` dimensions; a decode step's layers in one C++ call (worker/models/decode_layers.py)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp, quant, "model.embed_tokens"
        )
        dtype = torch.get_default_dtype()  # the runner builds the model in its dtype
        assert cfg.hybrid is not None  # a hybrid model's config
        self.rotary = RotaryEmbedding(
            cfg.hybrid.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, dtype, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, tp, quant, f"model.layers.{i}", i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_offset=1.0)
        self.decode_layers = None
        self.lora = None

    def runs_in_one_call(self, meta: AttentionMetadata) -> bool:
        """... and every sequence a plain decode (a speculative verification's rows, which the decode batch
        also carries and the state lists after the decodes, run the modules' token-by-token path)."""
        states = meta.states
        return (
            super().runs_in_one_call(meta)
            and states is not None
            and states.num_decodes == len(states.slot_list)
        )

    def decode_in_one_call(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        decode: DecodeBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear layers' state work before and after the layers (each layer's rows are its own, so
        the order across layers does not matter), the layers in one call on the decodes' state slots."""
        states = meta.states
        assert states is not None  # runs_in_one_call
        self.prepare_states(states)
        x, residual = self.decode_layers.forward(
            x,
            *rope,
            meta.slot_mapping,
            decode.block_tables,
            decode.context_lens,
            states.slots[: states.num_decodes],
        )
        self.keep_decode_states(states)
        return x, residual

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        layers = cast("list[HybridDecoderLayer]", list(self.layers))  # a ModuleList's items are bare Modules
        return [layer.linear_attn for layer in layers if not layer.is_full_attention]

    def prepare_states(self, states: StateBatch) -> None:
        """A decode step's state work before its layers (GatedDeltaNet.prepare_states); a step with none (most
        decode steps) runs no Python per layer."""
        if states.prepares:
            for layer in self.linear_attention_layers():
                layer.prepare_states(states)

    def keep_decode_states(self, states: StateBatch) -> None:
        """... and after them (GatedDeltaNet.keep_decode_states)."""
        if states.keeps_decode_states:
            for layer in self.linear_attention_layers():
                layer.keep_decode_states(states)


class MultiTokenPredictor(nn.Module):
    """The checkpoint's multi-token-prediction head (`mtp.*`, the published layout): from the model's final
    hidden state at position p and the embedding of token p + 1, one full-attention decoder layer (its own
    paged KV, at position p) predicts token p + 2 through the model's own output head. Its input is
    fc([pre_fc_norm_embedding(embedding) ; pre_fc_norm_hidden(hidden)]); every norm zero-centred, as the
    model's. Speculative decoding's proposer runs it (worker/sample/mtp.py).

    With tensor parallelism it is split as the model is (its attention heads and their KV, its MLP or
    experts) and reads the model's vocabulary-parallel embedding and head: rank 0 alone holding it whole
    would need a whole copy of the embedding and head there too (the 0.8B's largest tensor, a third of its
    weights), where the split costs each of its passes a broadcast of its rows and the collectives of one
    layer."""

    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, weight_offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, weight_offset=1.0)
        # Whole on every rank (2h x h, a fraction of the layer's weights): its input is the same on every
        # rank and so is its output, which the layer reads whole, so no collective is needed.
        whole = TPContext(ordered_sum=tp.ordered_sum)
        self.fc = ColumnParallelLinear(2 * h, h, False, whole, None, "mtp.fc")
        self.layers = nn.ModuleList([HybridDecoderLayer(cfg, tp, None, "mtp.layers.0", 0, mtp=True)])
        self.norm = RMSNorm(h, eps, weight_offset=1.0)

    def forward(
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The head's final hidden state (normed) per row: `embedded` the next tokens' embeddings, `hidden`
        the model's (or, drafting further, this head's own) final hidden state at each row's position."""
        x = self.pre_fc_norm_embedding(embedded)
        x = self.fc(torch.cat([x, self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](rope, x, None, meta)
        x, _ = self.norm.add_and_norm(x, residual)
        return x

    def attention(self) -> Attention:
        return cast(HybridDecoderLayer, self.layers[0]).self_attn.attn


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """The decoder's embedding, head and loading, over the hybrid's layers; the multi-token-prediction head
    when speculation asks for it (`enable_mtp`, before the weights load)."""

    model_class = HybridModel
    is_hybrid = True
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        **DecoderForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", 3),
        "in_proj_b": ("in_proj", 4),
        "in_proj_a": ("in_proj", 5),
    }
    lora_targets: ClassVar[dict[str, tuple[str, object]]] = {
        **DecoderForCausalLM.lora_targets,
        "in_proj_qkv": ("linear_attn.in_proj", "qkv"),
        "in_proj_z": ("linear_attn.in_proj", 3),
        "in_proj_b": ("linear_attn.in_proj", 4),
        "in_proj_a": ("linear_attn.in_proj", 5),
        "out_proj": ("linear_attn.out_proj", None),
    }

    def __init__(self, cfg: ModelConfig, tp: TPContext, quant: QuantPlan | None = None) -> None:
        super().__init__(cfg, tp, quant)
        self.mtp: MultiTokenPredictor | None = None

    def enable_mtp(self) -> None:
        """Build the multi-token-prediction head, whose `mtp.*` weights then load with the model's (every
        one required)."""
        self.mtp = MultiTokenPredictor(self.config, self.tp)

    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The multi-token-prediction head on `input_ids` (each row's next token) and `hidden` (the final
        hidden state at each row's position), with the model's embedding and RoPE table."""
        if self.mtp is None:
            raise RuntimeError("mtp_forward needs the multi-token-prediction head (enable_mtp)")
        rope = self.model.rotary.lookup(positions)
        return self.mtp(self.model.embed_tokens(input_ids), hidden, rope, meta)

    def checkpoint_name(self, name: str) -> str | None:
        """The published checkpoints' multimodal layout (Qwen3_5ForConditionalGeneration) served text-only:
        the language model's tensors under this model's names; the vision tower's not loaded (None), nor the
        multi-token prediction head's unless it was built (enable_mtp)."""
        if name.startswith("model.visual.") or (name.startswith("mtp.") and self.mtp is None):
            return None
        return (
            "model." + name.removeprefix("model.language_model.")
            if name.startswith("model.language_model.")
            else name
        )

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self._layers() if layer.is_full_attention]

    @staticmethod
    def state_layout(cfg: ModelConfig, tp_size: int) -> StateLayout:
        """The per-request state of a rank's share of the linear layers (key and value heads split as
        GatedDeltaNet splits them)."""
        h = cfg.hybrid
        if h is None:
            raise ValueError(f"{cfg.architecture} is not a hybrid model: it keeps no per-request state")
        return StateLayout(
            num_layers=len(h.linear_layers),
            conv=(h.conv_dim // tp_size, h.conv_kernel_size - 1),
            recurrent=(h.num_value_heads // tp_size, h.key_head_dim, h.value_head_dim),
        )

    def lora_projections(self) -> list[ParallelLinear]:
        """Each layer's attention or linear attention projections, and its dense MLP's (the MoE's
        experts, shared one included, are not adapted)."""
        projections: list[ParallelLinear] = []
        for layer in self._layers():
            if layer.is_full_attention:
                projections += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            else:
                projections += [layer.linear_attn.in_proj, layer.linear_attn.out_proj]
            if isinstance(layer.mlp, DecoderMLP):
                projections += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        return projections

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        return self._hybrid().linear_attention_layers()

    def _hybrid(self) -> HybridModel:
        return cast(HybridModel, self.model)  # model_class

    def _layers(self) -> list[HybridDecoderLayer]:
        return cast("list[HybridDecoderLayer]", self.model.layers)  # a ModuleList's items are bare Modules

    def prepare_states(self, states: StateBatch) -> None:
        """A decode step's state work outside a replayed graph, before it (HybridModel.prepare_states)."""
        self._hybrid().prepare_states(states)

    def keep_decode_states(self, states: StateBatch) -> None:
        """... and after it."""
        self._hybrid().keep_decode_states(states)

    def bind_kernels(self, attention: AttentionBackend, kernels: LayerKernels) -> None:
        """Attention layers on `attention`; the linear layers' state work on `kernels.gated_delta`, its
        prompt chunks token by token under --deterministic or on Triton without `gated_delta_prompts`
        (GatedDeltaNet._run_with_states); RMSNorm and the SwiGLU gate on the C++ CPU kernels or the fused
        Triton ones; the projections on the C++ CPU kernels or PyTorch (the rest of the fused Triton layer
        kernels are the other decoders'); GatedRMSNorm and the attention's output gate on Triton kernels of
        their own on the Triton path, on the C++ kernels or PyTorch otherwise."""
        for attn in self.attention_layers():
            attn.backend = attention
        if self.mtp is not None:
            self.mtp.attention().backend = attention
        triton = kernels.triton
        fused_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
        fused_gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if kernels.triton is not None and kernels.gated_delta is not None:
            from nanovllm.kernels.triton_gated_delta import gated_rms_norm, sigmoid_mul

            fused_norm, fused_gate = gated_rms_norm, sigmoid_mul
        for layer in self.linear_attention_layers():
            layer.prompts_token_by_token = kernels.gated_delta is not None and (
                kernels.deterministic or (kernels.triton is not None and kernels.gated_delta_prompts is None)
            )
            layer.norm.fused = fused_norm
        kernels = LayerKernels(
            cpu=kernels.cpu,
            block_fp8=kernels.block_fp8,
            deterministic=kernels.deterministic,
            exact_quantized=kernels.exact_quantized,
            gated_delta=kernels.gated_delta,
            gated_delta_prompts=None if kernels.deterministic else kernels.gated_delta_prompts,
        )
        kernel_users = (
            RMSNorm,
            HeadRMSNorm,
            DecoderMLP,
            SparseMoeBlock,
            ParallelLinear,
            VocabParallelEmbedding,  # the head too
            GatedDeltaNet,
            GatedAttention,
        )
        for module in self.modules():
            if isinstance(module, kernel_users):
                module.kernels = kernels
            # the fused norm (its zero-centred weight too) and SwiGLU gate, as the other decoders'
            if isinstance(module, (RMSNorm, DecoderMLP)) and triton is not None:
                module.kernels = replace(kernels, triton=triton)
            if isinstance(module, GatedAttention):
                module.fused_gate = fused_gate
                module.fused_qk_store = triton.qk_norm_rope_store if triton is not None else None
        # Decode steps as one C++ call (as DecoderForCausalLM.bind_kernels), with the state work on the C++
        # kernels too.
        cpu = kernels.cpu
        self.model.decode_layers = None
        if kernels.gated_delta is cpu and cpu is not None and self.tp.size == 1:
            self.model.decode_layers = build_hybrid_decode_layers(self.model, cpu, kernels)
