"""Each C++ CPU kernel (kernels/csrc) against the PyTorch path it replaces, at SmolLM2-135M's shapes.

Both sides run in the same process, alternating call by call, so the ratio holds even when the machine
is shared; the PyTorch side is the layer's own code (RMSNorm, apply_rotary, the SwiGLU gate of the MLP,
the reference AttentionBackend's decode) with the kernels unbound. Prints a markdown table of median milliseconds per call.

"projections" is one decode step's matmuls: every q/k/v, o, gate/up and down projection of SmolLM2's 30
layers and its LM head, F.linear against linear_few_rows (the layers use the kernel up to FEW_ROWS_MAX
rows): 540 MB of fp32 weights, read from memory as in the model.

"sample ..." is one sampler call over rows of SmolLM2's 49,152 logits (random, scale 3: flatter than a
model's, so top-p's nucleus is wide) at temperature 0.7 with each filter: the Sampler's torch path (the
same inversion in torch ops, with a sort or a top-k for the filters) against its C++ kernel, sample_rows;
"greedy" is temperature 0: torch.argmax against the kernels' argmax_rows.

Decode attention runs at SmolLM2's 3 kv heads for each group size (query heads per kv head) and head dim
asked for; a context "100-500" gives each sequence its own length, drawn uniformly from that range (the
mixed lengths of a serving batch). Its K/V come from memory, as in a model (see attention_case), unless
--warm.

Usage:  .venv/bin/python -m bench.cpu_kernels [--dtypes float32 bfloat16] [--rows 1 64] [--threads N]
            [--contexts 128 512 100-500] [--groups 3] [--head-dims 64] [--only attention] [--warm]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from nanovllm import SamplingParams
from nanovllm.kernels.attention import AttentionBackend, DecodeBatch
from nanovllm.kernels.cpu_kernels import load_cpu_kernels
from nanovllm.worker.layers.kernels import LayerKernels
from nanovllm.worker.layers.norm import RMSNorm
from nanovllm.worker.layers.rotary import RotaryEmbedding, apply_rotary
from nanovllm.worker.sample.sampler import Sampler
from nanovllm.worker.step import SamplingRow

# SmolLM2-135M
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK, EPS = 576, 9, 3, 64, 1536, 16, 1e-5
LAYERS, VOCAB = 30, 49152
COLD_BYTES = 256 << 20  # K/V copies cycled through by the attention cases: well over a last-level cache

Case = tuple[str, Callable[[], object], Callable[[], object], Callable[[], None]]


def cases(kernels, dtype: torch.dtype, rows: int, args: argparse.Namespace) -> Iterator[Case]:
    """(name, torch call, kernel call, reset): reset restores the inputs an in-place call changed."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    torch_norm, kernel_norm = RMSNorm(HIDDEN, EPS), RMSNorm(HIDDEN, EPS)
    for norm in (torch_norm, kernel_norm):
        norm.weight.data = torch.rand(HIDDEN, generator=gen).to(dtype)
    kernel_norm.kernels = LayerKernels(cpu=kernels)
    x = randn(rows, HIDDEN)
    yield "rms_norm", lambda: torch_norm(x), lambda: kernel_norm(x), lambda: None

    x0, r0 = randn(rows, HIDDEN), randn(rows, HIDDEN)
    xs, rs = x0.clone(), r0.clone()

    def reset() -> None:
        xs.copy_(x0), rs.copy_(r0)

    yield (
        "add_rms_norm_",
        lambda: torch_norm.add_and_norm(xs, rs),
        lambda: kernel_norm.add_and_norm(xs, rs),
        reset,
    )

    gate_up = randn(rows, 2 * INTERMEDIATE)

    def torch_gate() -> torch.Tensor:  # DecoderMLP's PyTorch path
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    yield "silu_and_mul", torch_gate, lambda: kernels.silu_and_mul(gate_up), lambda: None

    rope = RotaryEmbedding(HEAD_DIM, 4096, 1e5, dtype)
    cos, sin = rope.lookup(torch.randint(0, 4096, (rows,), generator=gen))
    qkv = randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, -1, HEAD_DIM)  # strided, as in the model
    yield "rotary", lambda: apply_rotary(qk, cos, sin), lambda: kernels.rotary(qk, cos, sin), lambda: None

    yield projections_case(kernels, dtype, randn, rows)
    yield from sampler_cases(kernels, randn(rows, VOCAB) * 3, rows)

    for head_dim in args.head_dims:
        for group in args.groups:
            for context in args.contexts:
                yield attention_case(kernels, randn, gen, rows, context, group, head_dim, args.warm)


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "sample t0.7": SamplingParams(temperature=0.7),
    "sample t0.7 top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "sample t0.7 top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "sample t0.7 min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
}


def sampler_cases(kernels, logits: torch.Tensor, rows: int) -> Iterator[Case]:
    torch_sampler, kernel_sampler = Sampler(), Sampler(cpu_kernels=kernels)
    for label, params in SAMPLINGS.items():
        batch = [SamplingRow(params, [], []) for _ in range(rows)]
        yield (
            label,
            lambda b=batch: torch_sampler(logits, b),
            lambda b=batch: kernel_sampler(logits, b),
            lambda: None,
        )


@functools.cache
def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """SmolLM2-135M's projection weights, [out, in], layer by layer, then the LM head."""
    gen = torch.Generator().manual_seed(1)
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM)]
    shapes += [(2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    layers = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(LAYERS) for shape in shapes]
    return layers + [torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype)]


def projections_case(kernels, dtype: torch.dtype, randn, rows: int) -> Case:
    weights = model_weights(dtype)
    inputs = {HIDDEN: randn(rows, HIDDEN), INTERMEDIATE: randn(rows, INTERMEDIATE)}

    def step(linear) -> None:
        for w in weights:
            linear(inputs[w.shape[1]], w, None)

    return (
        "projections, 30 layers + LM head",
        lambda: step(F.linear),
        lambda: step(kernels.linear_few_rows),
        lambda: None,
    )


def attention_case(
    kernels, randn, gen: torch.Generator, rows: int, context: str, group: int, head_dim: int, warm: bool
) -> Case:
    """`rows` sequences of `context` tokens each ("lo-hi": lengths drawn from that range), their blocks
    scattered over the cache. Unless `warm`, each call reads another copy of the caches (as many copies as
    fill COLD_BYTES): in a model, the other layers' caches pass through the CPU caches between two calls
    of one layer, so it reads its K/V from memory, not from a last-level cache that holds them."""
    lo, _, hi = context.partition("-")
    lens = torch.randint(int(lo), int(hi or lo) + 1, (rows,), generator=gen)
    width = -(-int(lens.max()) // BLOCK)
    num_blocks = rows * width
    k_cache, v_cache = (randn(num_blocks, BLOCK, KV_HEADS, head_dim) for _ in range(2))
    copies = 1 if warm else max(1, COLD_BYTES // (2 * k_cache.nbytes))
    caches = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(copies - 1)]
    torch_caches, kernel_caches = itertools.cycle(caches), itertools.cycle(caches)
    tables = torch.randperm(num_blocks, generator=gen).view(rows, width)
    q, scale = randn(rows, group * KV_HEADS, head_dim), head_dim**-0.5
    batch, reference = DecodeBatch(tables, lens, BLOCK), AttentionBackend()
    return (
        f"decode attention, context {context}, group {group}, head_dim {head_dim}",
        lambda: reference.decode(q, *next(torch_caches), batch, scale),
        lambda: kernels.paged_decode_attention(q, *next(kernel_caches), tables, lens, scale),
        lambda: None,
    )


def median_ms(torch_call, kernel_call, reset, repeats: int) -> tuple[float, float]:
    """Median milliseconds of each call, alternating the two so that both see the same machine."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats + 5):
        for call, out in ((torch_call, times[0]), (kernel_call, times[1])):
            reset()
            start = time.perf_counter()
            call()
            if i >= 5:  # warm-up
                out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 64], help="tokens / sequences per call")
    parser.add_argument(
        "--contexts", nargs="+", default=["128", "512", "100-500"], help='attention contexts: "N" or "lo-hi"'
    )
    parser.add_argument(
        "--groups", nargs="+", type=int, default=[HEADS // KV_HEADS], help="query heads per kv head"
    )
    parser.add_argument("--head-dims", nargs="+", type=int, default=[HEAD_DIM])
    parser.add_argument("--only", help="run only the kernels whose name contains this")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="attention reads one copy of the K/V caches (cache-resident if small)",
    )
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, help="torch / OpenMP threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels did not build")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} calls\n")
    print("| kernel | dtype | rows | torch ms | kernel ms | torch / kernel |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for rows in args.rows:
            for label, torch_call, kernel_call, reset in cases(kernels, dtype, rows, args):
                if args.only and args.only not in label:
                    continue
                t, k = median_ms(torch_call, kernel_call, reset, args.repeats)
                print(f"| {label} | {name} | {rows} | {t:.4f} | {k:.4f} | {t / k:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
