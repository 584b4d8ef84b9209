"""Embeddings per second: 64 texts of 256 tokens embedded by this engine (LLM.embed: a pooling request per
text, the last token's final hidden state, normalised) and by transformers' base model (a forward pass
over a batch of equal-length texts, nothing padded, the last position normalised), on the same random
weights with Qwen3-Embedding-0.6B's shape (Qwen3-0.6B's), in one process, the runs alternating.

transformers runs in each of --hf-dtypes, float32 and bfloat16 by default (the faster counts; on a CPU
without native bf16, bfloat16 takes several times float32's time and float32 is the faster).
An embedding is a prefill with no head: bound by arithmetic, so beside the ratio the script prints the
matmul ceiling of the model's linear layers (bench/ceiling.py, on PyTorch's GEMM, at the engine's step
size, the head left out) and each run's fraction of it; the largest difference between the engines'
embeddings says they computed the same thing.

Usage:  .venv/bin/python -m bench.embeddings [--shape qwen3-0.6b] [--dtype auto] [--deterministic auto]
            [--hf-dtypes float32,bfloat16] [--texts 64] [--text-len 256] [--rounds 1]

On a 2-core AVX2 CPU a round of the default workload took about 5 minutes with --deterministic off and
--hf-dtypes float32 (docs/performance.md#embeddings-benchembeddingspy).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModel

from bench.ceiling import MatmulCeiling
from bench.models import SHAPES, build_random_model
from bench.report import load_average, machine_description
from nanovllm import LLM
from nanovllm.worker.device import DTYPES
from nanovllm.worker.layers.kernels import PYTORCH
from nanovllm.worker.model_config import ModelConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="a random model's shape"
    )
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--text-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=8, help="texts per transformers forward pass")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each, alternating; medians")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--deterministic",
        choices=["auto", "on", "off"],
        default="auto",
        help="the engine's batch-invariant kernels (auto: its default on this machine)",
    )
    parser.add_argument(
        "--hf-dtypes",
        default="float32,bfloat16",
        help="transformers' dtypes, comma-separated (bfloat16 without native bf16 takes several times float32's time)",
    )
    return parser.parse_args(argv)


def embed_nanovllm(llm: LLM, texts: list[list[int]]) -> torch.Tensor:
    return torch.tensor([out["embedding"] for out in llm.embed(texts, use_tqdm=False)])


@torch.inference_mode()
def embed_transformers(model: torch.nn.Module, texts: list[list[int]], batch: int) -> torch.Tensor:
    out = []
    for begin in range(0, len(texts), batch):
        hidden = model(torch.tensor(texts[begin : begin + batch])).last_hidden_state[:, -1]
        out.append(F.normalize(hidden.float(), dim=-1))
    return torch.cat(out)


def timed(run) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = build_random_model(args.shape)
    cfg = ModelConfig.from_pretrained_dir(str(model_dir))
    rng = random.Random(0)
    texts = [[rng.randrange(3, cfg.vocab_size) for _ in range(args.text_len)] for _ in range(args.texts)]
    num_tokens = args.texts * args.text_len
    # A fixed thread count: the engine would otherwise split the CPUs with other nanovllm processes on
    # them (worker/runner/cpu_share.py), and transformers would run on its share too.
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        max_model_len=args.text_len + 8,
        kv_cache_memory="2GiB",
        num_threads=args.threads,
        deterministic={"auto": None, "on": True, "off": False}[args.deterministic],
    )
    torch.set_num_threads(args.threads)
    dtype = llm.engine.runner.dtype
    step_tokens = min(llm.config.max_num_batched_tokens, num_tokens)
    ceiling = MatmulCeiling(llm.engine.runner.model, PYTORCH)
    # The layers alone: an embedding multiplies by no head (step_time's head rows: none).
    ceiling_s = num_tokens / step_tokens * ceiling.step_time(step_tokens, 0)
    hf_dtypes = [getattr(torch, name) for name in args.hf_dtypes.split(",")]
    peers = {
        str(d).removeprefix("torch."): AutoModel.from_pretrained(model_dir, dtype=d).eval() for d in hf_dtypes
    }
    print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}", flush=True)
    print(
        f"model: random {args.shape} (Qwen3-Embedding-0.6B's shape); engine dtype "
        f"{str(dtype).removeprefix('torch.')}, deterministic {llm.config.deterministic}; {args.texts} texts of "
        f"{args.text_len} tokens ({num_tokens:,})"
    )
    embed_nanovllm(llm, texts[:2])  # warm-up
    seconds: dict[str, list[float]] = {"nanovllm": [], **{name: [] for name in peers}}
    vectors: dict[str, torch.Tensor] = {}
    for round_ in range(args.rounds):
        elapsed, vectors["nanovllm"] = timed(lambda: embed_nanovllm(llm, texts))
        seconds["nanovllm"].append(elapsed)
        print(
            f"  round {round_ + 1}: nanovllm {args.texts / elapsed:,.3f} embeddings/s ({elapsed:.0f} s)",
            flush=True,
        )
        for name, peer in peers.items():
            elapsed, vectors[name] = timed(lambda peer=peer: embed_transformers(peer, texts, args.hf_batch))
            seconds[name].append(elapsed)
            print(
                f"  round {round_ + 1}: transformers {name} {args.texts / elapsed:,.2f} embeddings/s",
                flush=True,
            )
    print(f"load average at end: {load_average()}")
    rate = {name: args.texts / statistics.median(s) for name, s in seconds.items()}
    ceiling_rate = args.texts / ceiling_s
    print(
        f"\n| random {args.shape}, {args.texts} x {args.text_len} tokens | embeddings/s | of the matmul ceiling "
        "| max abs difference from nanovllm |"
    )
    print("|---|---:|---:|---:|")
    for name, r in rate.items():
        label = "nanovllm (LLM.embed)" if name == "nanovllm" else f"transformers AutoModel forward, {name}"
        diff = (vectors[name] - vectors["nanovllm"]).abs().max().item()
        print(f"| {label} | {r:,.3f} | {r / ceiling_rate:.0%} | {diff:.2e} |")
    print(
        f"| matmul ceiling ({str(dtype).removeprefix('torch.')} linear layers at {step_tokens:,} tokens a step) "
        f"| {ceiling_rate:,.3f} | 100% | |"
    )
    best = max((n for n in rate if n != "nanovllm"), key=lambda n: rate[n])
    print(f"\nnanovllm / transformers ({best}, the faster): **{rate['nanovllm'] / rate[best]:.2f}x**")
    llm.shutdown()


if __name__ == "__main__":
    main()
