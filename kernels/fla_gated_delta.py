"""A hybrid model's prompts through fla-core's chunked gated-delta kernels, on CUDA where it is installed.

kernels/triton_gated_delta.py walks a prompt's tokens one after another (a program per head and column
block), which keeps a chunk's arithmetic that of its decode steps but leaves most of a GPU idle on a long
prompt. fla-core (flash-linear-attention's kernels) computes each 64-token chunk through matmuls and takes
several prompts in one varlen call. Measured on a GPU (bench/gated_delta.py; docs/performance.md has the
table), its prompts ran an order of magnitude faster than the walk from a few thousand tokens or several
prompts, while its decode kernel was slower than ours: prompts go to fla-core, decode steps stay on ours. Not under --deterministic (a
chunk's sums are not its decode steps') and not in float32 (fla's matmuls take TF32 there, and float32 engines
are held to transformers' tokens).
"""

from __future__ import annotations

import torch


def fla_unavailable(device: torch.device) -> str | None:
    """Why fla-core's prompt kernels cannot run here, or None when they can."""
    if device.type != "cuda":
        return "fla-core's kernels are CUDA's"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError as exc:
        return f"fla-core is not installed ({exc})"
    return None


def gated_delta_prompts_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: list[int],
    lengths: list[int],
) -> torch.Tensor:
    """Prompt chunks of several sequences, one after another in the rows of q, k [T, key_heads, dk], v [T,
    heads, dv], g and beta [T, heads] (`lengths` tokens each), each from and into its row `slots[i]` of
    `state` ([rows, heads, dk, dv] float32). Returns the output [T, heads, dv] in v's dtype."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    starts = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
    rows = torch.tensor(slots, dtype=torch.long, device=q.device)
    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None].float(), beta=beta[None].float(), scale=q.shape[-1] ** -0.5,
        initial_state=state.index_select(0, rows), output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=starts.to(q.device),
        cu_seqlens_cpu=starts,  # its chunk table without a device sync
    )  # fmt: skip
    state.index_copy_(0, rows, final)
    return out[0]


def warm_up(
    key_heads: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    """One small varlen call at the layers' shape, so that fla-core's autotuning and Triton's compilation
    (a fresh machine's first call took most of a minute, bench/gated_delta.py) happen as the engine starts,
    not in its first request's prompt step. The autotuned configurations depend on the shape, not on T."""
    gen = torch.Generator().manual_seed(0)
    lengths = [70, 3]  # two sequences, one longer than a 64-token chunk

    def rows(*size: int) -> torch.Tensor:
        return torch.randn(sum(lengths), *size, generator=gen).to(device, dtype)

    state = torch.zeros(2, heads, key_dim, value_dim, dtype=torch.float32, device=device)
    g = -torch.rand(sum(lengths), heads, generator=gen).to(device)
    beta = torch.rand(sum(lengths), heads, generator=gen).to(device)
    gated_delta_prompts_(
        rows(key_heads, key_dim),
        rows(key_heads, key_dim),
        rows(heads, value_dim),
        g,
        beta,
        state,
        [0, 1],
        lengths,
    )
