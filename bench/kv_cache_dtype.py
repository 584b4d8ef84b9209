"""An FP8 KV cache (--kv-cache-dtype) against the model's dtype, in one run: what it costs in fidelity and
what it gains in decode speed where attention dominates.

    .venv/bin/python -m bench.kv_cache_dtype [--fidelity] [--long-context] [--num-seqs 64 --context 4096]

Fidelity: teacher-forced over 4,096 positions (8 windows of 512 tokens) in bfloat16, the top-1 agreement
with the same engine on a bf16 cache and the mean KL per position, for SmolLM2-135M (the embedded real
model, on English prose: this repository's docs) and random Qwen3 and Llama models (random token ids), with
the scales chosen here (per kv head, calibrated: kernels/fp8_kv.py) beside the alternatives it was chosen
over: one calibrated scale per layer (the largest head's), and a scale of 1 (vLLM's default without
checkpoint scales).

Long context: decode steps of --num-seqs sequences each --context tokens deep, every sequence with blocks
of its own (the cache is filled with random K/V rather than by prefill, which at 64 x 4k tokens would take
the CPU an hour), timed on the SmolLM2 shape for each cache dtype; with the KV bytes a step reads and the
bandwidth that makes, beside the memory's copy bandwidth measured in the same run; then the C++ attention
kernel alone, reading a cache of that size from memory and a small one from the CPU's caches (the rate its
arithmetic allows), which says whether attention is bound by memory or by arithmetic there.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.models import build_random_model
from nanovllm import LLM
from nanovllm.kernels.cpu_kernels import load_cpu_kernels
from nanovllm.kernels.fp8_kv import quantize, scale_for
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf
from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import ScheduledSequence, SchedulerOutput
from tests.helpers import greedy, kv_fidelity, text_windows
from tests.model_factory import build_model

WINDOWS, WINDOW = 8, 512  # 4,096 teacher-forced positions


def _set_scales(llm: LLM, how: str) -> None:
    """Replace the calibrated per-head scales in place (the cache is empty; store and reads share them)."""
    for attn in llm.engine.runner.model.attention_layers():
        for scale in (attn.kv_scales.key, attn.kv_scales.value):
            with torch.inference_mode():  # they were made in it
                scale.copy_(torch.ones_like(scale) if how == "one" else scale.max().expand_as(scale))


def fidelity() -> None:
    opts = {"dtype": "bfloat16", "max_model_len": 1024, "kv_cache_memory": "256MiB"}
    with tempfile.TemporaryDirectory() as tmp:
        smollm2 = prepare_gguf(embedded_model_path())
        rng = random.Random(0)
        random_ids = [[rng.randrange(2, 512) for _ in range(WINDOW)] for _ in range(WINDOWS)]
        models = {
            "SmolLM2-135M (real)": (smollm2, text_windows(smollm2, WINDOWS, WINDOW)),
            "Qwen3 (random)": (build_model("qwen3", Path(tmp) / "qwen3", max_position=1024), random_ids),
            "Llama (random)": (build_model("llama", Path(tmp) / "llama", max_position=1024), random_ids),
        }
        variants = [
            ("fp8 (e4m3), per head, calibrated", "fp8", None),
            ("fp8 (e4m3), per layer, calibrated", "fp8", "layer"),
            ("fp8 (e4m3), scale 1", "fp8", "one"),
            ("fp8_e5m2, per head, calibrated", "fp8_e5m2", None),
        ]
        print("| model | KV cache | top-1 agreement | mean KL (nats) | positions |")
        print("|---|---|---|---|---|")
        for name, (path, batch) in models.items():
            reference = LLM(str(path), **opts)
            for label, kv_dtype, scales in variants:
                llm = LLM(str(path), kv_cache_dtype=kv_dtype, **opts)
                if scales is not None:
                    _set_scales(llm, scales)
                ((top1, kl, positions),) = kv_fidelity(reference, [llm], batch, chunk=128)
                print(f"| {name} | {label} | {top1:.4f} | {kl:.5f} | {positions} |", flush=True)
                del llm


def _copy_bandwidth() -> float:
    """Bytes a second this machine reads and writes copying a 1 GiB tensor (the best of 5)."""
    src = torch.ones(2**30, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def _decode_steps(llm: LLM, num_seqs: int, context: int, steps: int) -> float:
    """Seconds per decode step of num_seqs sequences `context` tokens deep; their K/V is random (filled
    directly, not by prefill), every sequence in blocks of its own."""
    engine, runner = llm.engine, llm.engine.runner
    # K/V of unit size (as a normed model's), stored as the model's store kernels store them
    for attn in runner.model.attention_layers():
        for cache, scale in (
            (attn.k_cache, attn.kv_scales and attn.kv_scales.key),
            (attn.v_cache, attn.kv_scales and attn.kv_scales.value),
        ):
            values = torch.randn(cache.shape, dtype=torch.float32)
            cache.copy_(
                values
                if scale is None
                else quantize(values.flatten(0, 1), scale, cache.dtype).view(cache.shape)
            )
    # prompts `steps` tokens longer than the context: each step feeds one as a decode token
    seqs = [Sequence(-1 - i, f"lc{i}", [7] * (context + steps), greedy(1)) for i in range(num_seqs)]
    for seq in seqs:
        if not engine.block_manager.allocate_slots(seq, context + steps):
            raise SystemExit("the KV cache is too small for --num-seqs x --context: raise --kv-cache-memory")
        seq.num_computed_tokens = context - 1
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            sched = SchedulerOutput([ScheduledSequence(s, s.num_computed_tokens, 1) for s in seqs], num_seqs)
            start = time.perf_counter()
            runner.forward(runner.step_inputs(sched, all_logits=False))
            times.append(time.perf_counter() - start)
            for seq in seqs:
                seq.num_computed_tokens += 1
    for seq in seqs:
        engine.block_manager.free(seq)
    times.sort()
    return times[len(times) // 2]


def _attention_rate(cache_dtype: torch.dtype, num_seqs: int, context: int, repeats: int) -> float:
    """Cache bytes a second the C++ decode attention reads, SmolLM2's heads (9 query, 3 kv, dim 64), bf16
    queries: from memory for a large cache, from the CPU's caches for a small one (its arithmetic's bound)."""
    kernels = load_cpu_kernels()
    blocks = num_seqs * context // 16
    values = [torch.randn(blocks * 16, 3, 64) for _ in range(2)]
    if cache_dtype.itemsize == 1:  # stored as the engine stores them, with calibrated scales
        scales = tuple(scale_for(v.abs().amax(dim=(0, 2)), cache_dtype) for v in values)
        k_cache, v_cache = (
            quantize(v, s, cache_dtype).view(blocks, 16, 3, 64) for v, s in zip(values, scales)
        )
    else:
        scales = (None, None)
        k_cache, v_cache = (v.to(cache_dtype).view(blocks, 16, 3, 64) for v in values)
    tables = torch.arange(blocks).view(num_seqs, -1)
    lens = torch.full((num_seqs,), context)
    query = torch.randn(num_seqs, 9, 64).to(torch.bfloat16)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, *scales)
        best = min(best, time.perf_counter() - start)
    return 2 * k_cache.numel() * k_cache.element_size() / best


def long_context(num_seqs: int, context: int, steps: int, memory: str) -> None:
    model = build_random_model("smollm2-135m")
    bandwidth = _copy_bandwidth()
    print(f"memory copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write, 1 GiB)")
    print("| KV cache | step (ms) | tok/s | KV read a step (GB) | KV GB/s | of copy bandwidth | vs auto |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(
            str(model), kv_cache_dtype=kv_dtype, max_model_len=context + steps + 16, kv_cache_memory=memory
        )
        step = _decode_steps(llm, num_seqs, context, steps)
        cache = llm.engine.runner.kv_cache
        per_token = cache[:, :, 0, 0].numel() * cache.element_size()  # K and V, every layer
        read = per_token * num_seqs * context
        base = base or step
        print(
            f"| {kv_dtype} ({str(cache.dtype).removeprefix('torch.')}) | {step * 1e3:.0f} | "
            f"{num_seqs / step:.1f} | {read / 1e9:.2f} | {read / step / 1e9:.1f} | "
            f"{read / step / bandwidth:.0%} | {base / step:.2f}x |",
            flush=True,
        )
        del llm
    print("\nThe C++ decode attention alone (one layer), GB/s of cache read:")
    print(f"| cache | {num_seqs} x {context} tokens (from memory) | 4 x 512 tokens (from the CPU's caches) |")
    print("|---|---|---|")
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        memory_rate = _attention_rate(cache_dtype, num_seqs, context, 5)
        cached_rate = _attention_rate(cache_dtype, 4, 512, 200)
        name = str(cache_dtype).removeprefix("torch.")
        print(f"| {name} | {memory_rate / 1e9:.1f} | {cached_rate / 1e9:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fidelity", action="store_true", help="only the fidelity table")
    parser.add_argument("--long-context", action="store_true", help="only the long-context decode table")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="7GiB", help="for the long-context case (both dtypes)")
    args = parser.parse_args()
    both = not (args.fidelity or args.long_context)
    if args.fidelity or both:
        fidelity()
    if args.long_context or both:
        long_context(args.num_seqs, args.context, args.steps, args.kv_cache_memory)


if __name__ == "__main__":
    main()
