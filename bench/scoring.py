"""Scoring prompts, as an evaluation harness does (SamplingParams.prompt_logprobs): the logprob of every
token of 64 prompts of 512 tokens and its most likely alternative, by this engine and by transformers'
forward pass (a log-softmax over each position, batched, equal lengths so nothing is padded), on the same
weights in one process, the runs alternating; prompt tokens per second and their ratio are what matter, and
the largest difference between the two engines' logprobs says they scored the same thing.

transformers runs in float32 and in bfloat16 where the engine's dtype is bfloat16 (the faster counts).
Scoring is bound by arithmetic (every position goes through every layer and the LM head), so beside the
ratio the script prints a matmul ceiling measured in the same run (bench/ceiling.py: the model's own
linear layers and LM head alone, in the engine's dtype, at the engine's step size, on PyTorch's GEMM, the
fastest here) and each run's fraction of it.

Usage:  .venv/bin/python -m bench.scoring [--shape smollm2-135m] [--embedded] [--dtype auto]
            [--deterministic auto] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.ceiling import MatmulCeiling
from bench.models import SHAPES, build_random_model
from bench.report import load_average, machine_description
from nanovllm import LLM, SamplingParams
from nanovllm.worker.device import DTYPES
from nanovllm.worker.layers.kernels import PYTORCH
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="smollm2-135m", help="a random model's shape"
    )
    parser.add_argument("--embedded", action="store_true", help="the embedded SmolLM2 (its real weights)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    parser.add_argument(
        "--deterministic",
        choices=["auto", "on", "off"],
        default="auto",
        help="the engine's batch-invariant kernels (auto: its default on this machine)",
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--top", type=int, default=1, help="alternatives per position (lm-eval asks for 1)")
    parser.add_argument("--hf-batch", type=int, default=8, help="prompts per transformers forward pass")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating; medians")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    return parser.parse_args(argv)


def score_nanovllm(llm: LLM, prompts: list[list[int]], top: int) -> list[list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[e.logprob for e in out["prompt_logprobs"][1:]] for out in outs]


@torch.inference_mode()
def score_transformers(
    model: torch.nn.Module, prompts: list[list[int]], top: int, batch: int
) -> list[list[float]]:
    scores = []
    for begin in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[begin : begin + batch])
        logp = model(ids).logits[:, :-1].float().log_softmax(dim=-1)
        chosen = logp.gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
        logp.topk(top, dim=-1)  # the alternatives, as the engine computes them
        scores += chosen.tolist()
    return scores


def timed(run) -> tuple[float, list[list[float]]]:
    started = time.perf_counter()
    scores = run()
    return time.perf_counter() - started, scores


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_gguf(embedded_model_path()) if args.embedded else build_random_model(args.shape)
    cfg = ModelConfig.from_pretrained_dir(str(model_dir))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    num_tokens = args.prompts * args.prompt_len
    deterministic = {"auto": None, "on": True, "off": False}[args.deterministic]
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        deterministic=deterministic,
        max_model_len=args.prompt_len + 8,
        kv_cache_memory="2GiB",
    )
    dtype = llm.engine.runner.dtype
    step_tokens = min(llm.config.max_num_batched_tokens, num_tokens)
    ceiling = MatmulCeiling(llm.engine.runner.model, PYTORCH)
    ceiling_s = num_tokens / step_tokens * ceiling.step_time(step_tokens, step_tokens)
    hf_dtypes = [torch.float32] + ([torch.bfloat16] if dtype == torch.bfloat16 else [])
    peers = {
        str(d).removeprefix("torch."): AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=d).eval()
        for d in hf_dtypes
    }
    model = "embedded SmolLM2-135M-Instruct" if args.embedded else f"random {args.shape}"
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(f"model: {model}; engine dtype {str(dtype).removeprefix('torch.')}, deterministic "
          f"{llm.config.deterministic}; {args.prompts} prompts of {args.prompt_len} tokens ({num_tokens:,}), "
          f"top {args.top}")  # fmt: skip
    score_nanovllm(llm, prompts[:2], args.top)  # warm-up
    seconds: dict[str, list[float]] = {"nanovllm": [], **{name: [] for name in peers}}
    scores = {}
    for round_ in range(args.rounds):
        elapsed, scores["nanovllm"] = timed(lambda: score_nanovllm(llm, prompts, args.top))
        seconds["nanovllm"].append(elapsed)
        for name, peer in peers.items():
            elapsed, scores[name] = timed(
                lambda peer=peer: score_transformers(peer, prompts, args.top, args.hf_batch)
            )
            seconds[name].append(elapsed)
        print(
            f"  round {round_ + 1}: "
            + ", ".join(f"{k} {num_tokens / v[-1]:,.0f} tok/s" for k, v in seconds.items())
        )
    print(f"load average at end: {load_average()}")
    ours = torch.tensor(scores["nanovllm"])
    rate = {name: num_tokens / statistics.median(s) for name, s in seconds.items()}
    print(
        f"\n| {model}, {args.prompts} x {args.prompt_len} tokens | prompt tok/s | of the matmul ceiling "
        "| max abs logprob difference from nanovllm |"
    )
    print("|---|---:|---:|---:|")
    ceiling_rate = num_tokens / ceiling_s
    for name, r in rate.items():
        label = "nanovllm (prompt_logprobs)" if name == "nanovllm" else f"transformers forward, {name}"
        diff = (torch.tensor(scores[name]) - ours).abs().max().item()
        print(f"| {label} | {r:,.0f} | {r / ceiling_rate:.0%} | {diff:.2e} |")
    print(
        f"| matmul ceiling ({str(dtype).removeprefix('torch.')} linear layers and LM head at "
        f"{step_tokens:,} tokens a step) | {ceiling_rate:,.0f} | 100% | |"
    )
    best = max((n for n in rate if n != "nanovllm"), key=rate.get)
    print(f"\nnanovllm / transformers ({best}, the faster): **{rate['nanovllm'] / rate[best]:.2f}x**")
    llm.shutdown()


if __name__ == "__main__":
    main()
