"""The gated delta rule (Yang et al., "Gated Delta Networks", arXiv 2412.06464) and the short causal
convolution before it: the token mixer of Qwen3.5's linear-attention layers, in PyTorch.

Per value head, with a state S of [key dim, value dim] and, per token, a decay g (log space, <= 0) and a
write strength beta in (0, 1):

    S <- exp(g) * S;   S <- S + k (beta * (v - k^T S))^T;   o = q^T S

q and k are L2-normalised per head and q is scaled by key_dim ** -0.5; key heads are shared by
consecutive groups of value heads. Decode runs the recurrence a token at a time (`recurrent_step`); a
prompt chunk runs its closed form over blocks of CHUNK tokens (`chunked`): the writes inside a block are
one triangular solve, the block's tokens read the state through matmuls, and the state is carried from
block to block. The two forms are the same arithmetic in another order (they agree to float32 rounding).
Everything here runs in float32, as transformers' reference does, whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' and flash-linear-attention's block size


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """float32 copies, key heads repeated onto their value heads, q and k normalised, q scaled."""
    group = v.shape[-2] // k.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences. q, k: [B, key_heads, dk]; v: [B, heads, dv]; g, beta: [B, heads];
    state: [B, heads, dk, dv] float32. Returns the output [B, heads, dv] (float32) and the new state."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = state * g.exp()[..., None, None]
    read = (state * k.unsqueeze(-1)).sum(dim=-2)  # what the state predicts for k: k^T S
    delta = (v - read) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence. q, k: [T, key_heads, dk]; v: [T, heads, dv]; g, beta: [T, heads];
    state: [heads, dk, dv] float32, None for the zero state. Returns the output [T, heads, dv] (float32)
    and the state after the last token."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    num_tokens, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -num_tokens % CHUNK

    # Heads first, then blocks of CHUNK tokens: [heads, blocks, CHUNK, ...]. Padded tokens have g = 0 and
    # beta = 0: they neither decay nor write the state, so the carried state is the last real token's.
    def blocks(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.transpose(0, 1), (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(heads, -1, CHUNK, *x.shape[2:])

    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    decay = g.cumsum(dim=-1)  # log of the decay from the block's start through each token
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i: how much of token j's write is left at token i.
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # The writes of a block depend on one another through what earlier writes changed: a unit lower
    # triangular system (I + L) X = RHS, L_ij = beta_i k_i . k_j exp(decay_i - decay_j) for j < i.
    system = (k_beta @ k.transpose(-1, -2) * pair_decay).tril(-1) + torch.eye(CHUNK, device=q.device)
    corrected_v = torch.linalg.solve_triangular(
        system, v * beta.unsqueeze(-1), upper=False, unitriangular=True
    )
    decayed_k = torch.linalg.solve_triangular(
        system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    within = q @ k.transpose(-1, -2) * pair_decay  # reads of this block's own writes
    q_from_state = q * decay.exp().unsqueeze(-1)  # reads of the state carried in
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)  # writes as decayed at the block's end
    block_decay = decay[..., -1].exp()[..., None, None]

    s = torch.zeros(heads, dk, dv, device=q.device) if state is None else state.float()
    out = torch.empty(heads, q.shape[1], CHUNK, dv, device=q.device)
    for b in range(q.shape[1]):
        writes = corrected_v[:, b] - decayed_k[:, b] @ s  # each write's new information given the state
        out[:, b] = q_from_state[:, b] @ s + within[:, b] @ writes
        s = s * block_decay[:, b] + k_to_end[:, b].transpose(-1, -2) @ writes
    return out.reshape(heads, -1, dv)[:, :num_tokens].transpose(0, 1), s


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution with SiLU over one sequence's new inputs x [T, C], after the last
    K - 1 inputs in `state` [C, K - 1] (None: zeros, a sequence's start). weight: [C, K]. Returns the
    output [T, C] and the new state (the last K - 1 inputs)."""
    channels, width = weight.shape
    before = x.new_zeros(channels, width - 1) if state is None else state.to(x.dtype)
    window = torch.cat([before, x.transpose(0, 1)], dim=1)
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=channels).squeeze(0)
    return F.silu(out).transpose(0, 1), window[:, -(width - 1) :]


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input for each of B sequences: x [B, C], state [B, C, K - 1]. Returns [B, C] and the new
    states."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)
    out = F.conv1d(window, weight.unsqueeze(1), groups=weight.shape[0]).squeeze(-1)
    return F.silu(out), window[..., 1:]
