"""Triton kernels for a hybrid model's linear attention (worker/models/qwen3_5.py) on CUDA: the causal
convolution and the gated delta rule on each sequence's state row in place.

The convolution's output at a token needs only the last few inputs, so a prompt chunk's tokens are computed
side by side (those before the chunk read from the state row), each summed as its decode step sums it.

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
from nanovllm.kernels import triton_attention
from nanovllm.kernels.triton_layers import _cast, _round


@triton.jit
def _delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr,
    first_row_of, num_tokens, key_heads, heads, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, GROUP: tl.constexpr, PER_SEQUENCE: tl.constexpr,
    ROUND: tl.constexpr,
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
        o = tl.sum(s * q[:, None], axis=0)
        if ROUND:  # into a 16-bit output: rounded to nearest, as a copy of the float32 output rounds
            o = _cast(o, out_ptr.dtype.element_ty)
        tl.store(out_ptr + (row * heads + h) * DV + cols, o)
    tl.store(state, s)


def _delta(q, k, v, g, beta, state, slots, per_sequence: bool, out: torch.Tensor | None) -> torch.Tensor:
    rows, key_heads, dk = q.shape
    heads, dv = v.shape[1], v.shape[2]
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (heads, dk, dv):
        raise ValueError(
            f"state must be contiguous float32 [rows, {heads}, {dk}, {dv}], got {tuple(state.shape)}"
        )
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"the rule's kernel takes power-of-two head dims, got dk={dk}, dv={dv}")
    if out is None:
        out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != (rows, heads, dv) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{rows}, {heads}, {dv}], got {tuple(out.shape)}")
    # Blocks of 32 columns give a GPU more programs; the interpreter pays per program, and a column's
    # arithmetic is the same in a block of any width (its sums run down the column), so there it takes all.
    bv = dv if triton_attention.interpreted() else min(dv, 32)
    grid = (rows if per_sequence else 1, heads, dv // bv)
    _delta_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.float().contiguous(),
        state, slots, out, 1 if per_sequence else 0, 1 if per_sequence else rows, key_heads, heads,
        dk**-0.5, DK=dk, DV=dv, BV=bv, GROUP=heads // key_heads, PER_SEQUENCE=per_sequence,
        ROUND=out.dtype != torch.float32,
    )  # fmt: skip
    return out


def gated_delta_decode_(q, k, v, g, beta, state, slots, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token of B sequences, each on state[slots[b]] (updated in place): q, k [B, key_heads, dk], v [B,
    heads, dv], g and beta [B, heads]. Returns the output [B, heads, dv] fp32, or `out` filled (rounded to
    its dtype)."""
    return _delta(q, k, v, g, beta, state, slots, per_sequence=True, out=out)


def gated_delta_chunk_(q, k, v, g, beta, state, slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of T tokens of one sequence, in order, on state[slot]. Returns [T, heads, dv] fp32, or `out`
    filled (rounded to its dtype)."""
    slots = torch.tensor([slot], dtype=torch.long, device=q.device)
    return _delta(q, k, v, g, beta, state, slots, per_sequence=False, out=out)


@triton.jit
def _conv_decode_kernel(
    x_ptr, x_stride, state_ptr, w_ptr, slot_ptr, out_ptr, channels, KEEP: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """One token of sequence program_id(0) on its state row, shifted in."""
    seq, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    live = c < channels
    row_state = state_ptr + (tl.load(slot_ptr + seq) * channels + c) * KEEP
    newest = tl.load(x_ptr + seq * x_stride + c, mask=live, other=0.0)
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(KEEP):  # oldest first, as the C++ kernel; the state shifts as it is read
        past = tl.load(row_state + j, mask=live, other=0.0)
        acc += tl.load(w_ptr + c * (KEEP + 1) + j, mask=live, other=0.0).to(tl.float32) * past.to(tl.float32)
        if j + 1 < KEEP:
            tl.store(row_state + j, tl.load(row_state + j + 1, mask=live, other=0.0), mask=live)
    acc += tl.load(w_ptr + c * (KEEP + 1) + KEEP, mask=live, other=0.0).to(tl.float32) * newest.to(tl.float32)
    tl.store(row_state + KEEP - 1, newest, mask=live)
    y = _round(acc, newest.dtype)  # the sum rounded to the dtype, then SiLU, as transformers
    tl.store(out_ptr + seq * channels + c, _cast(y / (1.0 + tl.exp(-y)), newest.dtype), mask=live)


@triton.jit
def _conv_chunk_kernel(
    x_ptr, x_stride, state_ptr, w_ptr, slot, out_ptr, channels, num_tokens,
    KEEP: tl.constexpr, KEEP_POW2: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """BT tokens of one sequence's chunk at once: token t's inputs are x[t - KEEP .. t], those before the
    chunk from the state row, summed in the decode kernel's order, so a token's result is the same bits
    either way. The first block's program then writes the new state (the chunk's last KEEP inputs) after
    it has read the old one; no other program reads the state (BT >= KEEP)."""
    tb, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    live = c < channels
    t = tb * BT + tl.arange(0, BT)
    cells = (t < num_tokens)[:, None] & live[None, :]
    row_state = state_ptr + (slot * channels + c) * KEEP
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KEEP):
        past = _input_before(x_ptr, x_stride, row_state, t - KEEP + j, c, cells, KEEP)
        acc += tl.load(w_ptr + c * (KEEP + 1) + j, mask=live, other=0.0).to(tl.float32)[None, :] * past.to(
            tl.float32
        )
    newest = tl.load(x_ptr + t[:, None] * x_stride + c[None, :], mask=cells, other=0.0)
    w_newest = tl.load(w_ptr + c * (KEEP + 1) + KEEP, mask=live, other=0.0).to(tl.float32)
    acc += w_newest[None, :] * newest.to(tl.float32)
    y = _round(acc, newest.dtype)
    tl.store(
        out_ptr + t[:, None] * channels + c[None, :], _cast(y / (1.0 + tl.exp(-y)), newest.dtype), mask=cells
    )
    if tb == 0:
        tl.debug_barrier()  # every thread's reads of the old state before any write (a CTA's threads split them)
        j = tl.arange(0, KEEP_POW2)
        keep = (j < KEEP)[:, None] & live[None, :]
        last = _input_before(x_ptr, x_stride, row_state, num_tokens - KEEP + j, c, keep, KEEP)
        tl.store(row_state[None, :] + j[:, None], last, mask=keep)


@triton.jit
def _input_before(x_ptr, x_stride, row_state, src, c, cells, KEEP: tl.constexpr):
    """The chunk's input at rows `src` ([N]) of channels c: x's row where src >= 0, else the state's
    (src + KEEP)-th oldest."""
    in_x = (src >= 0)[:, None]
    from_x = tl.load(x_ptr + src[:, None] * x_stride + c[None, :], mask=cells & in_x, other=0.0)
    from_state = tl.load(row_state[None, :] + (src + KEEP)[:, None], mask=cells & ~in_x, other=0.0)
    return tl.where(in_x, from_x, from_state)


def _check_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> None:
    channels, keep = x.shape[1], state.shape[2]
    if not state.is_contiguous() or state.shape[1] != channels or tuple(weight.shape) != (channels, keep + 1):
        raise ValueError(
            f"state must be contiguous [rows, {channels}, K - 1] and weight [{channels}, K], got "
            f"{tuple(state.shape)} and {tuple(weight.shape)}"
        )


_CONV_CHANNELS = 128  # a program's channels
_CONV_TOKENS = 32  # a chunk program's tokens


def causal_conv_decode_(x, state, weight, slots) -> torch.Tensor:
    """x [B, C] (rows of unit stride) -> SiLU(conv) [B, C], each sequence's state row (slots[b]) shifted in."""
    _check_conv(x, state, weight)
    rows, channels = x.shape
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    grid = (rows, triton.cdiv(channels, _CONV_CHANNELS))
    _conv_decode_kernel[grid](
        x, x.stride(0), state, weight.contiguous(), slots, out, channels, KEEP=state.shape[2], BC=_CONV_CHANNELS
    )  # fmt: skip
    return out


def causal_conv_chunk_(x, state, weight, slot: int) -> torch.Tensor:
    """A chunk x [T, C] of one sequence on state row `slot`: each token's result the bits its decode step
    would give, the tokens computed side by side."""
    _check_conv(x, state, weight)
    rows, channels = x.shape
    keep = state.shape[2]
    if keep > _CONV_TOKENS:
        raise ValueError(
            f"a convolution of width {keep + 1}: the chunk kernel takes up to {_CONV_TOKENS + 1}"
        )
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, _CONV_TOKENS), triton.cdiv(channels, _CONV_CHANNELS))
        _conv_chunk_kernel[grid](
            x, x.stride(0), state, weight.contiguous(), slot, out, channels, rows,
            KEEP=keep, KEEP_POW2=triton.next_power_of_2(keep), BT=_CONV_TOKENS, BC=_CONV_CHANNELS,
        )  # fmt: skip
    return out


@triton.jit
def _gates_kernel(
    a_ptr, a_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, heads, count, BLOCK: tl.constexpr
):  # fmt: skip
    """BLOCK of the T x heads decays g = -exp(A_log) softplus(a + dt_bias) and write strengths beta =
    sigmoid(b), the latter rounded to b's dtype, both float32 out."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    t, h = i // heads, i % heads
    x = tl.load(a_ptr + t * a_stride + h, mask=live, other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + h, mask=live, other=0.0).to(tl.float32)
    # softplus as PyTorch's (x past 20 as is), log1p(u) kept accurate for small u: log(1 + u) u / ((1 + u) - 1)
    u = tl.exp(x)
    one_u = 1.0 + u
    log1p = tl.where(one_u == 1.0, u, tl.log(one_u) * (u / (one_u - 1.0)))
    g = -tl.exp(tl.load(a_log_ptr + h, mask=live, other=0.0).to(tl.float32)) * tl.where(x > 20.0, x, log1p)
    b = tl.load(b_ptr + t * b_stride + h, mask=live, other=0.0)
    beta = _round(1.0 / (1.0 + tl.exp(-b.to(tl.float32))), b.dtype)
    tl.store(g_ptr + i, g, mask=live)
    tl.store(beta_ptr + i, beta, mask=live)


def delta_gates(a, b, a_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) float32 [T, heads] of a, b [T, heads] (rows of unit stride), a_log and dt_bias [heads]:
    one launch for what PyTorch takes eight."""
    tokens, heads = a.shape
    if a.stride(1) != 1 or b.stride(1) != 1 or tuple(b.shape) != (tokens, heads):
        raise ValueError(
            f"a and b must be [T, heads] with unit-stride rows, got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if tokens:
        count = tokens * heads
        _gates_kernel[(triton.cdiv(count, _GATES_BLOCK),)](
            a, a.stride(0), b, b.stride(0), a_log, dt_bias, g, beta, heads, count, BLOCK=_GATES_BLOCK
        )  # fmt: skip
    return g, beta


_GATES_BLOCK = 1024


@triton.jit
def _gated_norm_kernel(
    x_ptr, z_ptr, z_stride, w_ptr, out_ptr, rows, heads, eps, D: tl.constexpr, R: tl.constexpr
):
    """R head rows (row r: token r // heads, head r % heads): each rms-normalised in float32 and rounded,
    times the weight (rounded), times SiLU of its gate in float32, rounded: GatedRMSNorm's roundings."""
    r = (tl.program_id(0) * R + tl.arange(0, R))[:, None]
    d = tl.arange(0, D)[None, :]
    live = (r < rows) & (d < D)
    x = tl.load(x_ptr + r * D + d, mask=live, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    normed = _round(x * tl.rsqrt(tl.sum(x * x, 1)[:, None] / D + eps), dtype)
    weighted = _round(tl.load(w_ptr + d).to(tl.float32) * normed, dtype)
    gate = tl.load(z_ptr + (r // heads) * z_stride + (r % heads) * D + d, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * D + d, _cast(weighted * (gate / (1.0 + tl.exp(-gate))), dtype), mask=live)


_NORM_ROWS = 16  # a program's head rows


def gated_rms_norm(x, z, weight, eps: float) -> torch.Tensor:
    """GatedRMSNorm (worker/models/qwen3_5.py) of x [T * heads, D] (contiguous) with the gates z [T, heads * D]
    (rows of unit stride, a view of the projection's output as it is): [T * heads, D] in x's dtype, one
    launch for what PyTorch takes eight."""
    rows, dim = x.shape
    tokens = z.shape[0]
    if not x.is_contiguous() or z.stride(1) != 1 or tokens * z.shape[1] != rows * dim or dim & (dim - 1):
        raise ValueError(
            f"gated_rms_norm: x contiguous [T * heads, D] with D a power of two and z [T, heads * D] of unit "
            f"stride, got {tuple(x.shape)} and {tuple(z.shape)}"
        )
    out = torch.empty_like(x)
    if rows:
        _gated_norm_kernel[(triton.cdiv(rows, _NORM_ROWS),)](
            x, z, z.stride(0), weight, out, rows, rows // tokens, eps, D=dim, R=_NORM_ROWS
        )  # fmt: skip
    return out


@triton.jit
def _sigmoid_mul_kernel(x_ptr, gate_ptr, gate_stride, out_ptr, heads, D: tl.constexpr, HEADS: tl.constexpr):
    """One token: each head's x times sigmoid(its gate), the sigmoid rounded, then the product."""
    t = tl.program_id(0)
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, D)[None, :]
    live = (h < heads) & (d < D)
    x = tl.load(x_ptr + (t * heads + h) * D + d, mask=live, other=0.0)
    gate = tl.load(gate_ptr + t * gate_stride + h * 2 * D + d, mask=live, other=0.0).to(tl.float32)
    dtype = x.dtype
    tl.store(out_ptr + (t * heads + h) * D + d, _cast(x.to(tl.float32) * _round(tl.sigmoid(gate), dtype), dtype),
             mask=live)  # fmt: skip


def sigmoid_mul(x, gate) -> torch.Tensor:
    """Qwen3.5's attention output gate: x [T, heads * D] (contiguous) times sigmoid(gate), gate [T, heads, D]
    the gate half of each head's [q | gate] rows as the projection gives them (head stride 2 D, unit stride
    within a head); [T, heads * D] in x's dtype, one launch for PyTorch's three (a copy of the gate too)."""
    tokens, heads, dim = gate.shape
    if not x.is_contiguous() or tuple(x.shape) != (tokens, heads * dim) or gate.stride()[1:] != (2 * dim, 1):
        raise ValueError(
            f"sigmoid_mul: x contiguous [T, heads * D] and gate [T, heads, D] of strides (*, 2 D, 1), got "
            f"{tuple(x.shape)} and {tuple(gate.shape)} {gate.stride()}"
        )
    out = torch.empty_like(x)
    if tokens:
        _sigmoid_mul_kernel[(tokens,)](
            x, gate, gate.stride(0), out, heads, D=dim, HEADS=triton.next_power_of_2(heads)
        )  # fmt: skip
    return out
