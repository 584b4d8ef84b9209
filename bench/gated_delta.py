"""The gated delta rule on CUDA: this project's Triton kernels (kernels/triton_gated_delta.py) against
fla-core's (the library written for these layers), at Qwen3.5's linear-attention shapes, in one run.

    python -m bench.gated_delta [--shapes 0.8b 9b] [--decode-batches 1 64 256] [--prompt-lens 512 4096]

Decode: B sequences' next token, each on its own row of a pool of state rows. Ours updates the rows in
place; fla's fused recurrent kernel reads and writes a batch of states, so the rows are gathered before it
and scattered back after (what the engine would have to do to use it); its kernel alone is shown too. Both
are timed as CUDA graphs replayed (the engine's decode steps run as graphs), so the figures are GPU time.
Prefill: one prompt of T tokens and 8 prompts of 512 on states from the pool, the final state written back;
ours walks a prompt's tokens one after another (a launch per prompt, as the runner calls it), fla's chunked
kernel computes a chunk's tokens with matmuls (one varlen call). Timed eagerly with CUDA events. Then our
convolution of a prompt (fla's prompts take theirs from the caller: the engine runs ours before them).

Each row also gives the largest difference of fla's output from ours, relative to our output's largest
magnitude: the two sum in different orders (and fla's chunked form rounds through 16-bit matmul inputs), so
it is a check that both compute the same rule, not an exactness claim.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (key heads, value heads, key dim, value dim) of the linear layers: Qwen3.5-0.8B, and the 9B (as Qwen3.5's
# larger models: 16 key and 32 value heads of 128).
SHAPES = {"0.8b": (16, 16, 128, 128), "9b": (16, 32, 128, 128)}
POOL = 512  # state rows in the pool the decode rows are drawn from


def _inputs(tokens: int, shape: tuple[int, int, int, int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    key_heads, heads, dk, dv = shape

    def bf16(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to("cuda", torch.bfloat16)

    return {
        "q": bf16(tokens, key_heads, dk),
        "k": bf16(tokens, key_heads, dk),
        "v": bf16(tokens, heads, dv),
        "g": F.logsigmoid(torch.randn(tokens, heads, generator=gen) + 4).cuda(),  # decays near 1, as trained
        "beta": torch.rand(tokens, heads, generator=gen).cuda(),
    }


def _graph_ms(fn: Callable[[], object], reps: int = 200) -> float:
    """GPU time a call of fn takes, captured once as a CUDA graph and replayed reps times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up (and autotuning) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _event_ms(graph.replay, reps)


def _event_ms(fn: Callable[[], object], reps: int) -> float:
    """Median over 5 rounds of the time reps back-to-back calls take, per call."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / reps)
    return statistics.median(rounds)


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs.float()).abs().max() / ours.float().abs().max())


def decode_row(name: str, batch: int, gen: torch.Generator) -> str:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    from nanovllm.kernels.triton_gated_delta import gated_delta_decode_

    _, heads, dk, dv = shape = SHAPES[name]
    x = _inputs(batch, shape, gen)
    pool = torch.randn(POOL, heads, dk, dv, generator=gen).cuda() * 0.1
    slots = torch.randperm(POOL, generator=gen)[:batch].cuda()
    ours_pool, fla_pool = pool.clone(), pool.clone()
    scale = dk**-0.5

    def ours() -> torch.Tensor:
        return gated_delta_decode_(x["q"], x["k"], x["v"], x["g"], x["beta"], ours_pool, slots)

    def fla_kernel(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_recurrent_gated_delta_rule(
            x["q"][:, None], x["k"][:, None], x["v"][:, None], g=x["g"][:, None], beta=x["beta"][:, None],
            scale=scale, initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    def fla_rows() -> torch.Tensor:
        out, final = fla_kernel(fla_pool[slots])
        fla_pool.index_copy_(0, slots, final)
        return out

    want, got = ours(), fla_rows()
    error = _relative(want, got[:, 0])
    state_error = _relative(ours_pool[slots], fla_pool[slots])
    gathered = fla_pool[slots].clone()
    ms = {
        "ours": _graph_ms(ours),
        "fla + rows": _graph_ms(fla_rows),
        "fla kernel": _graph_ms(lambda: fla_kernel(gathered)),
    }
    state_mb = 2 * batch * heads * dk * dv * 4 / 1e6  # the rows read and written
    return (
        f"| {name} | decode, batch {batch} | {ms['ours'] * 1e3:.1f} | {ms['fla + rows'] * 1e3:.1f} "
        f"({ms['fla kernel'] * 1e3:.1f} kernel) | {ms['fla + rows'] / ms['ours']:.2f} | "
        f"{state_mb / ms['ours']:.0f} / {state_mb / ms['fla + rows']:.0f} | {error:.1e} / {state_error:.1e} |"
    )


def prefill_row(name: str, lengths: list[int], gen: torch.Generator) -> str:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from nanovllm.kernels.triton_gated_delta import gated_delta_chunk_

    _, heads, dk, dv = shape = SHAPES[name]
    total = sum(lengths)
    x = _inputs(total, shape, gen)
    pool = torch.randn(len(lengths), heads, dk, dv, generator=gen).cuda() * 0.1
    ours_pool, fla_pool = pool.clone(), pool.clone()
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    cu_seqlens = torch.tensor(starts, dtype=torch.long, device="cuda")
    scale = dk**-0.5

    def ours() -> torch.Tensor:
        outs = [
            gated_delta_chunk_(
                x["q"][a:b], x["k"][a:b], x["v"][a:b], x["g"][a:b], x["beta"][a:b], ours_pool, slot
            )
            for slot, (a, b) in enumerate(itertools.pairwise(starts))
        ]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def fla() -> torch.Tensor:
        out, final = chunk_gated_delta_rule(
            x["q"][None], x["k"][None], x["v"][None], g=x["g"][None], beta=x["beta"][None], scale=scale,
            initial_state=fla_pool, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens if len(lengths) > 1 else None,
        )  # fmt: skip
        fla_pool.copy_(final)
        return out[0]

    want, got = ours(), fla()
    error = _relative(want, got)
    state_error = _relative(ours_pool, fla_pool)
    reps = 3 if total >= 4096 else 10
    ours_ms, fla_ms = _event_ms(ours, reps), _event_ms(fla, reps)
    what = f"prefill, {len(lengths)} x {lengths[0]}" if len(lengths) > 1 else f"prefill, {lengths[0]} tokens"
    return (
        f"| {name} | {what} | {ours_ms * 1e3:.0f} | {fla_ms * 1e3:.0f} | {fla_ms / ours_ms:.2f} | "
        f"{total / ours_ms / 1e3:.2f} / {total / fla_ms / 1e3:.2f} M tok/s | {error:.1e} / {state_error:.1e} |"
    )


def conv_row(name: str, length: int, gen: torch.Generator) -> str:
    """Ours alone (fla's prompts take their convolution from the caller): a prompt's causal convolution of
    width 4 over the layer's q, k and v channels, its tokens side by side."""
    from nanovllm.kernels.triton_gated_delta import causal_conv_chunk_

    key_heads, heads, dk, dv = SHAPES[name]
    channels = 2 * key_heads * dk + heads * dv
    x = torch.randn(length, channels, generator=gen).to("cuda", torch.bfloat16)
    state = torch.zeros(1, channels, 3, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(channels, 4, generator=gen).to("cuda", torch.bfloat16)
    ms = _event_ms(lambda: causal_conv_chunk_(x, state, weight, 0), 10)
    return (
        f"| {name} | convolution, {length} tokens | {ms * 1e3:.0f} | | | {length / ms / 1e3:.2f} M tok/s | |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--decode-batches", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[512, 4096])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gated_delta compares CUDA kernels: it needs a GPU")
    import fla

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fla-core {fla.__version__}")
    print(
        "| shape | case | ours, us | fla, us | fla / ours | decode: state GB/s ours / fla; prefill: rate | "
        "output / state difference, relative |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name in args.shapes:
        for batch in args.decode_batches:
            print(decode_row(name, batch, gen), flush=True)
        for length in args.prompt_lens:
            print(prefill_row(name, [length], gen), flush=True)
        print(prefill_row(name, [512] * 8, gen), flush=True)
        for length in args.prompt_lens:
            print(conv_row(name, length, gen), flush=True)


if __name__ == "__main__":
    main()
