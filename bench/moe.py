"""Mixture of experts on a CPU: the Qwen3-30B-A3B shape with a few layers (random weights), nanovllm against
transformers in one run, and how many bytes one decode stream reads per token.

  * W64        bench.throughput's workload (64 requests, 32-256 prompt and output tokens, greedy,
               ignore_eos): nanovllm's LLM.generate against transformers' static `generate` in batches of
               64 (left-padded, each batch run to its longest request; only requested tokens count).
  * one stream decode tok/s of one request (a 128-token prompt), prefill not timed, on both.
  * bytes      one stream reads per token: the active parameters' bytes (attention, the router, the k
               chosen experts, one embedding row, the LM head) plus the KV cache, against an upper bound
               measured here: the decode step's time times the machine's read bandwidth (a sum over
               1 GiB, best of 5, measured right before and right after the one stream, the larger:
               this VM's bandwidth drifts by half within minutes). No step reads more than that, so bound / active <= 1.5 shows that the
               step reads about the chosen experts, never all of them, without trusting any counter.

Both engines run in nanovllm's `--dtype` (auto: bf16 where the CPU has native bf16, else float32), one after
the other; transformers in a child process first, so that its memory is gone before nanovllm loads (the
model is about 12 GB in float32 at 4 layers; it is built once and cached). transformers' one stream is
its faster experts implementation of `grouped_mm` (its default) and `eager` (a loop over the experts hit);
its W64 is `eager`: with `grouped_mm` the batch of 64 took all 24 GB of a 24 GB machine and was killed.

Usage:  .venv/bin/python -m bench.moe [--layers 4] [--dtype auto] [--skip-hf]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from bench.baselines import hf_single_stream, run_hf_static
from bench.engine_run import build_llm, nanovllm_single_stream, run_nanovllm, warm_up_nanovllm
from bench.gpu import decode_bytes_per_token
from bench.models import build_random_model
from bench.report import load_average, machine_description
from bench.workload import Workload, make_workload
from nanovllm.worker.device import DTYPES, resolve_placement
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.runner import huge_pages

SHAPE = "qwen3-30b-a3b"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the random model (48 real)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="both engines'")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--single-prompt", type=int, default=128)
    parser.add_argument("--single-new-tokens", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="nanovllm and the bytes only")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def read_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes per second a sum over `nbytes` reads, the best of 5; on huge pages where the kernel gives them,
    as the engine's weights are (worker/runner/huge_pages.py), the faster read on this machine."""
    data = huge_pages.zeros((nbytes // 4,), torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def transformers_runs(
    model_dir: Path, dtype: torch.dtype, single: list[int], new_tokens: int, workload: Workload, threads: int
) -> tuple[float, str, float, str]:
    """(one stream tok/s, its experts implementation, W64 useful tok/s, its note), in a child process."""
    torch.set_num_threads(threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    one: dict[str, float] = {}
    for implementation in ("grouped_mm", "eager"):
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, experts_implementation=implementation
        ).eval()
        one[implementation] = hf_single_stream(model, single, new_tokens)
        print(
            f"[transformers, {dtype}, {implementation}] one stream: {one[implementation]:,.2f} tok/s",
            flush=True,
        )
    static = run_hf_static(model, workload, len(workload))  # eager
    print(
        f"[transformers, {dtype}, eager] W{len(workload)}: {static.tokens_per_s:,.2f} useful tok/s",
        flush=True,
    )
    best = max(one, key=one.__getitem__)
    return one[best], best, static.tokens_per_s or 0.0, static.note


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model_dir = build_random_model(SHAPE, layers=args.layers)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    workload = make_workload(args.num_seqs, cfg.vocab_size, (32, 256), (32, 256), args.seed)
    single = make_workload(1, cfg.vocab_size, (args.single_prompt,) * 2, (1, 1), args.seed + 1).prompts[0]
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model: random {SHAPE}, {cfg.num_hidden_layers} layers, {cfg.num_parameters / 1e9:.2f} B parameters; "
          f"W{len(workload)}: {workload.num_prompt_tokens:,} prompt tokens, {workload.num_output_tokens:,} "
          f"output tokens; one stream: {args.single_prompt} + {args.single_new_tokens} tokens")  # fmt: skip

    dtype = resolve_placement("cpu", args.dtype).dtype
    hf: tuple[float, str, float, str] | None = None
    if not args.skip_hf:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            run = child.submit(
                transformers_runs, model_dir, dtype, single, args.single_new_tokens, workload, args.threads
            )
            hf = run.result()

    llm = build_llm(model_dir, workload, args)
    warm_up_nanovllm(llm, cfg.vocab_size)
    bandwidths = [read_bandwidth()]
    nano_one = nanovllm_single_stream(llm, single, args.single_new_tokens)
    bandwidths.append(read_bandwidth())
    print(f"[nanovllm, {dtype}] one stream: {nano_one:,.2f} tok/s")
    nano_w64 = run_nanovllm(llm, workload)
    print(
        f"[nanovllm, {dtype}] W{len(workload)}: {nano_w64.tokens_per_s:,.2f} tok/s ({nano_w64.wall_s:.1f} s)"
    )
    del llm
    gc.collect()

    bandwidth = max(bandwidths)
    context = args.single_prompt + args.single_new_tokens // 2
    active = decode_bytes_per_token(cfg, context, dtype.itemsize)
    every = decode_bytes_per_token(cfg, context, dtype.itemsize, every_expert=True)
    bound = bandwidth / nano_one
    print(f"read bandwidth around the one stream: {' and '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s")
    print(f"load average at end: {load_average()}")
    hf_one, hf_one_impl, hf_w64, hf_note = hf if hf is not None else (None, "", None, "")

    def ratio(ours: float, theirs: float | None) -> str:
        return f"{ours / theirs:.2f}x" if theirs else "-"

    def cell(value: float | None) -> str:
        return f"{value:,.2f}" if value else "-"

    print(f"\n| random {SHAPE}, {cfg.num_hidden_layers} layers, {dtype} | nanovllm | transformers | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| W{len(workload)} output tok/s | {nano_w64.tokens_per_s:,.2f} | {cell(hf_w64)} | "
          f"{ratio(nano_w64.tokens_per_s, hf_w64)} |")  # fmt: skip
    print(f"| one stream decode tok/s | {nano_one:,.2f} | {cell(hf_one)} | {ratio(nano_one, hf_one)} |")
    if hf is not None:
        print(
            f"\ntransformers: one stream with experts_implementation={hf_one_impl} (the faster); W64 eager, {hf_note}"
        )
    print(f"\none stream, bytes per token at {context} cached tokens: active parameters + KV {active / 1e9:.3f} GB "
          f"(every expert: {every / 1e9:.3f} GB); read at most (step time x {bandwidth / 1e9:.1f} GB/s) "
          f"{bound / 1e9:.3f} GB = {bound / active:.2f}x active, {bound / every:.2f}x every expert")  # fmt: skip


if __name__ == "__main__":
    main()
