"""Triton kernels for a hybrid model's linear attention (worker/models/qwen3_5.py) on CUDA: the causal
convolution and the gated delta rule, token after token on each sequence's state row in place.

The rule's state of a value head is [dk, dv]; its columns are independent (a column's read, write and
output involve only that column and the whole of k and q), so a program takes one sequence, one head and a
block of BV columns, keeps that [dk, BV] block in registers and walks its tokens: one token for a decode
step, a prompt chunk's tokens in order otherwise. Decode and prefill run the same arithmetic, so a token's
result does not depend on how its prompt was cut into steps. The arithmetic is
worker/layers/gated_delta_rule.py's recurrent step (kernels/csrc/gated_delta_cpu.cpp's on a CPU), in fp32.
On a CPU these run only in Triton's interpreter (the tests); the attention kernels' module decides that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Importing the attention kernels first defines every kernel under the same interpreter setting.
from nanovllm.kernels import triton_attention  # noqa: F401


@triton.jit
def _delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr,
    first_row_of, num_tokens, key_heads, heads, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, GROUP: tl.constexpr, PER_SEQUENCE: tl.constexpr,
):  # fmt: skip
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # PER_SEQUENCE (decode): program `seq` runs row `seq` on slot_ptr[seq]; else one sequence's rows
    # [0, num_tokens) on slot_ptr[0].
    first = seq * first_row_of
    slot = tl.load(slot_ptr + (seq if PER_SEQUENCE else 0))
    kh = h // GROUP
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    state = state_ptr + ((slot * heads + h) * DK + dk[:, None]) * DV + cols[None, :]
    s = tl.load(state)
    for t in range(num_tokens):
        row = first + t
        q = tl.load(q_ptr + (row * key_heads + kh) * DK + dk).to(tl.float32)
        k = tl.load(k_ptr + (row * key_heads + kh) * DK + dk).to(tl.float32)
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        decay = tl.exp(tl.load(g_ptr + row * heads + h))
        beta = tl.load(beta_ptr + row * heads + h)
        v = tl.load(v_ptr + (row * heads + h) * DV + cols).to(tl.float32)
        delta = (v - tl.sum(s * k[:, None], axis=0) * decay) * beta
        s = s * decay + k[:, None] * delta[None, :]
        tl.store(out_ptr + (row * heads + h) * DV + cols, tl.sum(s * q[:, None], axis=0))
    tl.store(state, s)


def _delta(q, k, v, g, beta, state, slots, per_sequence: bool) -> torch.Tensor:
    rows, key_heads, dk = q.shape
    heads, dv = v.shape[1], v.shape[2]
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (heads, dk, dv):
        raise ValueError(
            f"state must be contiguous float32 [rows, {heads}, {dk}, {dv}], got {tuple(state.shape)}"
        )
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"the rule's kernel takes power-of-two head dims, got dk={dk}, dv={dv}")
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    bv = min(dv, 32)
    grid = (rows if per_sequence else 1, heads, dv // bv)
    _delta_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.float().contiguous(),
        state, slots, out, 1 if per_sequence else 0, 1 if per_sequence else rows, key_heads, heads,
        dk**-0.5, DK=dk, DV=dv, BV=bv, GROUP=heads // key_heads, PER_SEQUENCE=per_sequence,
    )  # fmt: skip
    return out


def gated_delta_decode_(q, k, v, g, beta, state, slots) -> torch.Tensor:
    """One token of B sequences, each on state[slots[b]] (updated in place): q, k [B, key_heads, dk], v [B,
    heads, dv], g and beta [B, heads]. Returns the output [B, heads, dv] fp32."""
    return _delta(q, k, v, g, beta, state, slots, per_sequence=True)


def gated_delta_chunk_(q, k, v, g, beta, state, slot: int) -> torch.Tensor:
    """A chunk of T tokens of one sequence, in order, on state[slot]. Returns [T, heads, dv] fp32."""
    slots = torch.tensor([slot], dtype=torch.long, device=q.device)
    return _delta(q, k, v, g, beta, state, slots, per_sequence=False)


@triton.jit
def _conv_kernel(
    x_ptr, x_stride, state_ptr, w_ptr, slot_ptr, out_ptr, channels, num_tokens, first_row_of,
    KEEP: tl.constexpr, BC: tl.constexpr, PER_SEQUENCE: tl.constexpr,
):  # fmt: skip
    seq, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    live = c < channels
    first = seq * first_row_of
    slot = tl.load(slot_ptr + (seq if PER_SEQUENCE else 0))
    row_state = state_ptr + (slot * channels + c) * KEEP
    for t in range(num_tokens):
        row = first + t
        newest = tl.load(x_ptr + row * x_stride + c, mask=live, other=0.0)
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(KEEP):  # oldest first, as the C++ kernel; the state shifts as it is read
            past = tl.load(row_state + j, mask=live, other=0.0)
            acc += tl.load(w_ptr + c * (KEEP + 1) + j, mask=live, other=0.0).to(tl.float32) * past.to(
                tl.float32
            )
            if j + 1 < KEEP:
                tl.store(row_state + j, tl.load(row_state + j + 1, mask=live, other=0.0), mask=live)
        acc += tl.load(w_ptr + c * (KEEP + 1) + KEEP, mask=live, other=0.0).to(tl.float32) * newest.to(
            tl.float32
        )
        tl.store(row_state + KEEP - 1, newest, mask=live)
        y = acc.to(newest.dtype).to(tl.float32)  # the sum rounded to the dtype, then SiLU, as transformers
        tl.store(out_ptr + row * channels + c, (y / (1.0 + tl.exp(-y))).to(newest.dtype), mask=live)


def _conv(x, state, weight, slots, per_sequence: bool) -> torch.Tensor:
    rows, channels = x.shape
    keep = state.shape[2]
    if not state.is_contiguous() or state.shape[1] != channels or tuple(weight.shape) != (channels, keep + 1):
        raise ValueError(
            f"state must be contiguous [rows, {channels}, K - 1] and weight [{channels}, K], got "
            f"{tuple(state.shape)} and {tuple(weight.shape)}"
        )
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    bc = 128
    grid = (rows if per_sequence else 1, triton.cdiv(channels, bc))
    _conv_kernel[grid](
        x, x.stride(0), state, weight.contiguous(), slots, out, channels, 1 if per_sequence else rows,
        1 if per_sequence else 0, KEEP=keep, BC=bc, PER_SEQUENCE=per_sequence,
    )  # fmt: skip
    return out


def causal_conv_decode_(x, state, weight, slots) -> torch.Tensor:
    """x [B, C] (contiguous rows) -> SiLU(conv) [B, C], each sequence's state row (slots[b]) shifted in."""
    return _conv(x, state, weight, slots, per_sequence=True)


def causal_conv_chunk_(x, state, weight, slot: int) -> torch.Tensor:
    """A chunk x [T, C] of one sequence, token after token, on state row `slot`."""
    slots = torch.tensor([slot], dtype=torch.long, device=x.device)
    return _conv(x, state, weight, slots, per_sequence=False)
