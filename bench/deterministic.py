"""What --deterministic costs: bench.throughput's W64 workload and one decode stream, with the flag and
without, on one model in one process, the runs alternating; the ratio is what matters.

The flag moves every projection onto the C++ fixed-order matmul (PyTorch's GEMM above 16 rows otherwise)
and every prompt query onto the decode attention kernel (SDPA otherwise), so the cost is in prefill and
large decode batches; one stream decodes on the same kernels either way.

Usage:  .venv/bin/python -m bench.deterministic [--dtype bfloat16] [--embedded] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics

import torch

from bench.engine_run import build_llm, nanovllm_single_stream, run_nanovllm, warm_up_nanovllm
from bench.models import SHAPES, build_random_model
from bench.report import load_average, machine_description
from bench.workload import make_workload
from nanovllm.worker.device import DTYPES
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="smollm2-135m", help="a random model's shape"
    )
    parser.add_argument(
        "--embedded", action="store_true", help="the embedded SmolLM2 GGUF (quantized) instead"
    )
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--single-prompt", type=int, default=128)
    parser.add_argument("--single-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each engine, alternating; medians")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_gguf(embedded_model_path()) if args.embedded else build_random_model(args.shape)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    workload = make_workload(args.num_seqs, cfg.vocab_size, (32, 256), (32, 256), args.seed)
    single = make_workload(1, cfg.vocab_size, (args.single_prompt,) * 2, (1, 1), args.seed + 1).prompts[0]
    model = "embedded SmolLM2-135M-Instruct (GGUF)" if args.embedded else f"random {args.shape}"
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(f"model: {model}; dtype {args.dtype}; W{len(workload)}: {workload.num_prompt_tokens:,} prompt tokens, "
          f"{workload.num_output_tokens:,} output tokens; one stream: {args.single_prompt} + "
          f"{args.single_new_tokens} tokens")  # fmt: skip

    engines = {flag: build_llm(model_dir, workload, args, deterministic=flag) for flag in (False, True)}
    for llm in engines.values():
        warm_up_nanovllm(llm, cfg.vocab_size)
    w64: dict[bool, list[float]] = {False: [], True: []}
    one: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for flag, llm in engines.items():
            w64[flag].append(run_nanovllm(llm, workload).tokens_per_s)
            one[flag].append(nanovllm_single_stream(llm, single, args.single_new_tokens))
            print(f"  round {round_ + 1}, deterministic={flag}: W{len(workload)} {w64[flag][-1]:,.1f} tok/s, "
                  f"one stream {one[flag][-1]:,.1f} tok/s")  # fmt: skip
    del engines
    gc.collect()
    print(f"load average at end: {load_average()}")
    print(f"\n| {model}, {args.dtype} | without | with --deterministic | with / without |")
    print("|---|---:|---:|---:|")
    for name, runs in ((f"W{len(workload)} output tok/s", w64), ("one stream decode tok/s", one)):
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"| {name} | {off:,.1f} | {on:,.1f} | {on / off:.3f}x |")


if __name__ == "__main__":
    main()
