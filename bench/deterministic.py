"""What --deterministic costs, per weight format: bench.throughput's W64 workload and one decode stream,
with the flag and without, on one model in one process, the runs alternating; the ratio is what matters.
Each row also says what `deterministic=None` (auto) chooses for that format on this machine, and why.

Formats: bfloat16 and float32 (a random SmolLM2-shaped model in that dtype); Q4_1 (the embedded
SmolLM2-135M-Instruct GGUF as it ships), Q4_0 and Q8_0 (the same file requantized, bench/gguf_requantize.py),
int8 and int4 (the random model quantized as it loads), all in the machine's default dtype unless --dtype;
qwen3.5 (a random Qwen3.5-0.8B shape with --qwen3-5-layers layers, the machine's default dtype).

The flag moves every projection onto the C++ fixed-order kernels: float weights to the fixed-order matmul
(PyTorch's GEMM above 16 rows otherwise), quantized ones to the integer dots at every row count where the
engine takes them (16-bit x, or float32 x with 4-bit projections, on a CPU with AVX2 or AVX512-VNNI), else
to the registers and the panels (PyTorch's GEMM on the dequantized weight above 8 rows otherwise, 64 with
float32 x); every prompt query onto the decode attention kernel (SDPA otherwise).

Usage:  .venv/bin/python -m bench.deterministic [--formats Q4_1 int8 ...] [--rounds 3] [--num-seqs 64]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.engine_run import build_llm, nanovllm_single_stream, run_nanovllm, warm_up_nanovllm
from bench.gguf_requantize import requantized_gguf
from bench.models import build_random_model
from bench.report import load_average, machine_description
from bench.workload import make_workload
from nanovllm.worker.device import DTYPES
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import embedded_model_path, resolve_model

FORMATS = ("bfloat16", "float32", "Q4_1", "Q4_0", "Q8_0", "int8", "int4", "qwen3.5")


@dataclass(frozen=True)
class Subject:
    """One format's model as LLM takes it: `model` a directory or .gguf file, `options` more fields."""

    model: Path
    dtype: str
    options: dict[str, str]


def subject(name: str, args: argparse.Namespace) -> Subject:
    if name in ("bfloat16", "float32"):
        return Subject(build_random_model("smollm2-135m"), name, {})
    if name == "Q4_1":
        return Subject(embedded_model_path(), args.dtype, {})
    if name in ("Q4_0", "Q8_0"):
        return Subject(requantized_gguf(embedded_model_path(), name), args.dtype, {})
    if name in ("int8", "int4"):
        return Subject(build_random_model("smollm2-135m"), args.dtype, {"quantization": name})
    return Subject(build_random_model("qwen3.5-0.8b", layers=args.qwen3_5_layers), args.dtype, {})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="the activations' dtype of the quantized formats and qwen3.5 (auto: the machine's default)",
    )
    parser.add_argument("--qwen3-5-layers", type=int, default=8, help="layers of the Qwen3.5 shape")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--single-prompt", type=int, default=128)
    parser.add_argument("--single-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each engine, alternating; medians")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def measure(name: str, args: argparse.Namespace) -> str:
    """One format's table row: W and one stream, without and with the flag, and what auto chooses."""
    case = subject(name, args)
    cfg = ModelConfig.from_pretrained_dir(Path(resolve_model(str(case.model))[0]))
    workload = make_workload(args.num_seqs, cfg.vocab_size, (32, 256), (32, 256), args.seed)
    single = make_workload(1, cfg.vocab_size, (args.single_prompt,) * 2, (1, 1), args.seed + 1).prompts[0]
    run_args = argparse.Namespace(**{**vars(args), "dtype": case.dtype})
    engines = {
        flag: build_llm(case.model, workload, run_args, deterministic=flag, **case.options)
        for flag in (False, True)
    }
    auto = build_llm(case.model, workload, run_args, **case.options)
    choice = f"{'on' if auto.config.deterministic else 'off'} ({auto.config.deterministic_reason})"
    auto.shutdown()
    del auto
    for llm in engines.values():
        warm_up_nanovllm(llm, cfg.vocab_size)
    many: dict[bool, list[float]] = {False: [], True: []}
    one: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for flag, llm in engines.items():
            many[flag].append(run_nanovllm(llm, workload).tokens_per_s)
            one[flag].append(nanovllm_single_stream(llm, single, args.single_new_tokens))
            print(f"  {name}, round {round_ + 1}, deterministic={flag}: W{len(workload)} "
                  f"{many[flag][-1]:,.1f} tok/s, one stream {one[flag][-1]:,.1f} tok/s", flush=True)  # fmt: skip
    dtype = engines[False].engine.runner.placement.dtype_name
    for llm in engines.values():
        llm.shutdown()
    del engines
    gc.collect()
    cells = [name, dtype]
    for runs in (many, one):
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        cells += [f"{off:,.1f}", f"{on:,.1f}", f"**{on / off:.3f}x**"]
    return "| " + " | ".join([*cells, choice]) + " |"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(f"W{args.num_seqs}: prompts and outputs of 32-256 tokens; one stream: {args.single_prompt} + "
          f"{args.single_new_tokens} tokens; rounds {args.rounds}", flush=True)  # fmt: skip
    rows = [measure(name, args) for name in args.formats]
    print(f"load average at end: {load_average()}")
    w = f"W{args.num_seqs}"
    print(f"\n| format | dtype | {w} without | {w} with | with / without | one stream without | one stream "
          "with | with / without | auto |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
