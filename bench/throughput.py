"""Offline throughput benchmark: nanovllm vs transformers vs a matmul-only ceiling, on CPU.

The workload follows nano-vllm's bench.py (random token prompts, random output lengths, greedy,
ignore_eos), scaled down so that it finishes in minutes on a few CPU cores. Every number comes
from the same process and the same random-weight checkpoint, so the ratios are what matters:

  * nanovllm      LLM.generate over the whole workload (continuous batching, paged KV cache), in
                  its default dtype (`--dtype auto`: bf16 where the CPU has native bf16, else fp32);
  * HF static     transformers `generate` on fixed batches padded to the batch's longest output, in
                  float32 and in bfloat16: nanovllm is compared with the faster of the two;
  * HF CB         transformers continuous batching (`generate_batch`'s manager) when installed, in
                  the dtype that was faster for static batches;
  * ceiling       the time the model's own linear layers alone need, in nanovllm's dtype, for the
                  token counts the engine actually ran in each step: no attention, norms, sampling
                  or Python.

With --sampled the workload also runs sampled (at --temperature, 0.6 as nano-vllm's bench.py, and with
--top-p as well) on nanovllm and on transformers' static batches in its faster dtype, and each is reported
against its own greedy run: what sampling costs each engine. --rounds alternates nanovllm's runs.

Usage:  .venv/bin/python -m bench.throughput [--num-seqs 64] [--single-stream] [--skip-hf]
            [--embedded] [--sampled [--temperature 0.6] [--top-p 0.9] [--rounds 1]]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import platform
import statistics
from pathlib import Path

import torch
import transformers

from bench.baselines import HFResult, hf_single_stream, load_hf, run_hf_continuous, run_hf_static
from bench.ceiling import MatmulCeiling
from bench.engine_run import (
    build_llm,
    nanovllm_single_stream,
    run_nanovllm,
    warm_up_nanovllm,
)
from bench.models import SHAPES, build_random_model
from bench.report import load_average, machine_description, print_summary, report_steps
from bench.workload import GREEDY, Sampling, Workload, make_workload
from nanovllm import LLM
from nanovllm.kernels.fp8_kv import KV_CACHE_DTYPES
from nanovllm.worker.device import DTYPES
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: a random --shape)")
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="the embedded SmolLM2-135M-Instruct instead of a random --shape",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--hf-batch-size", type=int, default=None, help="default: --num-seqs")
    parser.add_argument("--skip-hf", action="store_true", help="skip every transformers measurement")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="nanovllm's dtype")
    parser.add_argument(
        "--hf-dtypes", nargs="+", choices=list(DTYPES), default=["float32", "bfloat16"], help="transformers'"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *KV_CACHE_DTYPES],
        help="also run nanovllm with this KV cache (same bytes), after auto's, and print the ratio",
    )
    single = parser.add_argument_group("single stream")
    single.add_argument("--single-stream", action="store_true", help="also measure one-request decode speed")
    single.add_argument("--single-prompt", type=int, default=128)
    single.add_argument("--single-new-tokens", type=int, default=256)
    sampled = parser.add_argument_group("sampled workloads")
    sampled.add_argument("--sampled", action="store_true", help="also run the workload sampled (see above)")
    sampled.add_argument("--temperature", type=float, default=0.6)
    sampled.add_argument("--top-p", type=float, default=0.9)
    sampled.add_argument("--rounds", type=int, default=1, help="nanovllm runs of each sampling, alternating")
    args = parser.parse_args(argv)
    if args.hf_batch_size is None:
        args.hf_batch_size = args.num_seqs
    if not (1 <= args.min_input <= args.max_input and 1 <= args.min_output <= args.max_output):
        parser.error("need 1 <= --min-input <= --max-input and 1 <= --min-output <= --max-output")
    if args.model is not None and args.embedded:
        parser.error("--model and --embedded name two models; give one")
    if args.sampled and not (args.temperature > 0 and 0 < args.top_p < 1 and args.rounds >= 1):
        parser.error("--sampled needs --temperature > 0, 0 < --top-p < 1 and --rounds >= 1")
    return args


def sampled_runs(
    llm: LLM, workload: Workload, greedy_tps: float, args: argparse.Namespace
) -> dict[str, float]:
    """nanovllm's output tok/s for greedy and the sampled workloads: the median of --rounds runs of each,
    alternating (the first greedy run is the one measured already)."""
    samplings = [GREEDY, Sampling(args.temperature), Sampling(args.temperature, args.top_p)]
    runs: dict[str, list[float]] = {GREEDY.label: [greedy_tps]}
    for round_ in range(args.rounds):
        for sampling in samplings[1:] if round_ == 0 else samplings:
            tps = run_nanovllm(llm, workload, sampling).tokens_per_s
            runs.setdefault(sampling.label, []).append(tps)
            print(f"  {sampling.label}: {tps:,.1f} output tok/s")
    return {label: statistics.median(values) for label, values in runs.items()}


def print_sampling_summary(nano: dict[str, float], hf: dict[str, float], hf_label: str) -> None:
    print("\n== what sampling costs: output tok/s, each engine against its own greedy run ==")
    print(
        f"{'sampling':<30} {'nanovllm':>10} {'x greedy':>9} {hf_label:>28} {'x greedy':>9} {'nano / HF':>10}"
    )
    for label, tps in nano.items():
        theirs = hf.get(label)
        hf_cells = (
            f"{theirs:>28,.1f} {theirs / hf[GREEDY.label]:>8.2f}x {tps / theirs:>9.2f}x"
            if theirs and hf.get(GREEDY.label)
            else f"{'-':>28} {'-':>9} {'-':>10}"
        )
        print(f"{label:<30} {tps:>10,.1f} {tps / nano[GREEDY.label]:>8.2f}x {hf_cells}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # transformers' continuous batching logs through its own logger; its warnings (e.g. "EOS disabled",
    # which is what this benchmark wants) are noise here, its errors are not.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    if args.embedded:
        model_dir = prepare_gguf(embedded_model_path())
    else:
        model_dir = args.model or build_random_model(args.shape)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    if args.embedded:
        shape = f"embedded SmolLM2-135M-Instruct ({cfg.architecture})"
    else:
        shape = args.shape if args.model is None else f"{model_dir} ({cfg.architecture})"

    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}"
    )
    print(f"model: {shape}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")

    workload = make_workload(
        args.num_seqs,
        cfg.vocab_size,
        (args.min_input, args.max_input),
        (args.min_output, args.max_output),
        args.seed,
    )
    print(
        f"workload: {len(workload)} requests, {workload.num_prompt_tokens:,} prompt tokens, "
        f"{workload.num_output_tokens:,} output tokens (seed {args.seed})"
    )
    single_prompt = make_workload(
        1, cfg.vocab_size, (args.single_prompt,) * 2, (1, 1), args.seed + 1
    ).prompts[0]

    # nanovllm, then the ceiling (it needs the engine's weights), then free the engine for HF.
    llm = build_llm(model_dir, workload, args)
    runner = llm.engine.runner
    nano_dtype = runner.placement.dtype_name
    warm_up_nanovllm(llm, cfg.vocab_size)
    print(
        f"\n[nanovllm] LLM.generate, dtype {nano_dtype} ({runner.placement.reason}), kernels: {runner.kernel_backend}"
    )
    nano = run_nanovllm(llm, workload)
    print(f"  {nano.output_tokens:,} tokens in {nano.wall_s:.2f} s = {nano.tokens_per_s:,.1f} output tok/s")
    report_steps(nano)
    nano_sampled = sampled_runs(llm, workload, nano.tokens_per_s, args) if args.sampled else {}
    nano_single = None
    if args.single_stream:
        nano_single = nanovllm_single_stream(llm, single_prompt, args.single_new_tokens)
        print(f"  single stream decode: {nano_single:,.1f} tok/s")

    if args.kv_cache_dtype != "auto":
        kv_llm = build_llm(model_dir, workload, args, kv_cache_dtype=args.kv_cache_dtype)
        warm_up_nanovllm(kv_llm, cfg.vocab_size)
        kv_run = run_nanovllm(kv_llm, workload)
        print(
            f"\n[nanovllm, --kv-cache-dtype {args.kv_cache_dtype}] {kv_llm.engine.block_manager.num_blocks:,} blocks "
            f"(auto: {llm.engine.block_manager.num_blocks:,}): {kv_run.tokens_per_s:,.1f} output tok/s = "
            f"{kv_run.tokens_per_s / nano.tokens_per_s:.2f}x auto's"
        )
        del kv_llm
        gc.collect()

    print(f"\n[ceiling] {nano_dtype} linear layers only, at the engine's per-step token counts")
    ceiling = MatmulCeiling(llm.engine.runner.model)
    ceiling_s = sum(ceiling.step_time(s.num_tokens, s.sampled_rows) for s in nano.steps)
    ceiling_tps = nano.output_tokens / ceiling_s
    print(
        f"  {ceiling_s:.2f} s = {ceiling_tps:,.1f} output tok/s; nanovllm reaches {nano.tokens_per_s / ceiling_tps:.1%}"
    )
    ceiling_single = 1.0 / ceiling.step_time(1, 1)
    if args.single_stream:
        print(f"  single stream (M=1): {ceiling_single:,.1f} tok/s")
    del llm, ceiling
    gc.collect()

    hf_rows: list[HFResult] = []
    hf_single: dict[str, float] = {}
    hf_sampled: dict[str, float] = {}
    if not args.skip_hf:
        for dtype_name in args.hf_dtypes:
            print(f"\n[transformers] generate, static batches of {args.hf_batch_size}, {dtype_name}")
            model = load_hf(model_dir, DTYPES[dtype_name])
            static = run_hf_static(model, workload, args.hf_batch_size)
            print(f"  {static.tokens_per_s:,.1f} useful output tok/s ({static.note})")
            hf_rows.append(static)
            if args.single_stream:
                hf_single[dtype_name] = hf_single_stream(model, single_prompt, args.single_new_tokens)
                print(f"  single stream decode: {hf_single[dtype_name]:,.1f} tok/s")
            del model
            gc.collect()

        fastest = max(range(len(hf_rows)), key=lambda i: hf_rows[i].tokens_per_s or 0)
        fastest_dtype = args.hf_dtypes[fastest]
        model = load_hf(model_dir, DTYPES[fastest_dtype])
        if args.sampled:
            print(f"\n[transformers] static batches sampled, {fastest_dtype} (faster static dtype)")
            hf_sampled[GREEDY.label] = hf_rows[fastest].tokens_per_s or 0.0
            for sampling in (Sampling(args.temperature), Sampling(args.temperature, args.top_p)):
                tps = run_hf_static(model, workload, args.hf_batch_size, sampling).tokens_per_s or 0.0
                hf_sampled[sampling.label] = tps
                print(f"  {sampling.label}: {tps:,.1f} useful output tok/s")
        print(f"\n[transformers] continuous batching (generate_batch), {fastest_dtype} (faster static dtype)")
        cb = run_hf_continuous(model, workload, args.max_num_batched_tokens)
        print(f"  {cb.tokens_per_s:,.1f} output tok/s" if cb.tokens_per_s else f"  generate_batch: {cb.note}")
        hf_rows.append(cb)
        del model
        gc.collect()

    nano_label = f"nanovllm ({nano_dtype}, {runner.kernel_backend} kernels)"
    rows: list[tuple[str, float | None, str]] = [(nano_label, nano.tokens_per_s, "LLM.generate")]
    rows += [(r.label, r.tokens_per_s, r.note) for r in hf_rows]
    rows.append(("matmul ceiling", ceiling_tps, f"{nano_dtype} linears only at the engine's step sizes"))
    print(f"\nload average at end: {load_average()} (timings are only comparable on an idle machine)")
    print_summary(rows, nano.tokens_per_s, f"throughput: {len(workload)} requests, {shape}")
    measured = [r for r in hf_rows if r.tokens_per_s]
    if measured:
        best = max(measured, key=lambda r: r.tokens_per_s or 0.0)
        print(
            f"\nnanovllm / fastest transformers ({best.label}): {nano.tokens_per_s / (best.tokens_per_s or 1):.2f}x"
        )
    if args.single_stream:
        single_rows: list[tuple[str, float | None, str]] = [(nano_label, nano_single, "decode only")]
        n = args.single_new_tokens
        for dtype_name, tps in hf_single.items():
            single_rows.append((f"HF generate ({dtype_name})", tps, f"{n} / (t({n + 1}) - t(1))"))
        single_rows.append(("matmul ceiling", ceiling_single, f"M=1 {nano_dtype} linears + LM head"))
        print_summary(single_rows, nano_single or 0.0, "single stream decode")
    if args.sampled:
        print_sampling_summary(
            nano_sampled, hf_sampled, f"HF static ({fastest_dtype})" if hf_sampled else "HF"
        )


if __name__ == "__main__":
    main()
