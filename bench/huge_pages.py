"""The CPU engine's weights, KV cache and states on huge pages against the allocator's 4 KiB pages
(worker/runner/huge_pages.py): the same engine built twice in one process, `huge_pages=False` and `True`,
their work alternating so that both meet the machine's same moments.

One stream: one 128-token random prompt on each engine, 64 new tokens, greedy, their decode steps
interleaved; the median step of each, and the machine's read bandwidth (bench/moe.py's `read_bandwidth`, a
1 GiB sum on huge pages) after each pass. W64 (unless --skip-w64): bench/throughput.py's workload (64
random requests, 32-256 tokens in and out) on one engine, then the other, output tokens/s. Greedy tokens
must be equal on both; the run fails if they are not. Engines' start times are printed as they were
measured (the first huge-page allocations of a process may wait for the kernel to compact memory).

    .venv/bin/python -m bench.huge_pages [--shape qwen3.5-0.8b] [--quantization int4] [--passes 5]
        [--dtype auto] [--skip-w64]

--shape smollm2 runs the embedded SmolLM2-135M-Instruct GGUF as it ships.
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import time

from bench.models import SHAPES, build_random_model
from bench.moe import read_bandwidth
from bench.report import machine_description
from bench.speculation import run_batch
from bench.workload import make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import embedded_model_path

SMOLLM2 = "smollm2"


def interleaved_streams(
    engines: dict[bool, LLM], prompt: list[int], new_tokens: int
) -> tuple[dict[bool, float], bool]:
    """Each engine's median decode step (s), their steps alternating, and whether their tokens are equal."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    steps: dict[bool, list[float]] = {on: [] for on in engines}
    tokens: dict[bool, list[int]] = {on: [] for on in engines}
    for on, llm in engines.items():
        llm.engine.add_request("stream", prompt, params)
        for out in llm.engine.step().outputs:  # the prompt's step
            tokens[on] += out.new_token_ids
    while any(llm.engine.has_unfinished_requests() for llm in engines.values()):
        for on, llm in engines.items():
            if not llm.engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outputs = llm.engine.step().outputs
            steps[on].append(time.perf_counter() - start)
            for out in outputs:
                tokens[on] += out.new_token_ids
    return {on: statistics.median(s) for on, s in steps.items()}, tokens[False] == tokens[True]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3.5-0.8b", choices=[*SHAPES, SMOLLM2])
    parser.add_argument("--quantization", default="int4", help="int8, int4 or none (not with smollm2)")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (auto: the machine's default)")
    parser.add_argument("--skip-w64", action="store_true")
    args = parser.parse_args()
    options: dict[str, object] = {}
    if args.shape == SMOLLM2:
        path = str(embedded_model_path())
    else:
        path = str(build_random_model(args.shape))
        if args.quantization != "none":
            options["quantization"] = args.quantization
    vocab = ModelConfig.from_pretrained_dir(path).vocab_size if args.shape != SMOLLM2 else 49_152
    engines: dict[bool, LLM] = {}
    started: dict[bool, float] = {}
    for on in (False, True):
        start = time.perf_counter()
        engines[on] = LLM(
            path, max_model_len=1024, kv_cache_memory="1GiB", huge_pages=on, dtype=args.dtype, **options
        )
        started[on] = time.perf_counter() - start
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine_description()}")
    weights = options.get("quantization", "as shipped" if args.shape == SMOLLM2 else "the default dtype")
    print(f"{args.shape}, weights {weights}, dtype {args.dtype}; engines started in {started[False]:.2f} s (4 KiB pages) and "
          f"{started[True]:.2f} s (huge pages)\n")  # fmt: skip
    prompt = [random.Random(0).randrange(2, vocab) for _ in range(128)]
    interleaved_streams(engines, prompt, 8)  # warm-up
    print("| one stream, pass | read GB/s after | 4 KiB pages ms/step | huge pages ms/step | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for number in range(1, args.passes + 1):
        step, equal = interleaved_streams(engines, prompt, 64)
        if not equal:
            raise SystemExit("the engines' greedy tokens differ")
        print(f"| {number} | {read_bandwidth() / 1e9:.0f} | {step[False] * 1e3:.2f} | {step[True] * 1e3:.2f} | "
              f"{step[False] / step[True]:.3f}x |")  # fmt: skip
    if args.skip_w64:
        return
    batch = make_workload(64, vocab, (32, 256), (32, 256), seed=0)
    warm = make_workload(8, vocab, (32, 64), (8, 16), seed=1)
    for llm in engines.values():
        run_batch(llm, warm)
    print("\n| W64, pass | 4 KiB pages tok/s | huge pages tok/s | speed-up |")
    print("|---|---:|---:|---:|")
    for number in range(1, 3):
        runs = {on: run_batch(llm, batch) for on, llm in engines.items()}
        if runs[False][0] != runs[True][0]:
            raise SystemExit("the engines' greedy tokens differ on W64")
        rate = {on: run[1] for on, run in runs.items()}
        print(f"| {number} | {rate[False]:.1f} | {rate[True]:.1f} | {rate[True] / rate[False]:.3f}x |")


if __name__ == "__main__":
    main()
