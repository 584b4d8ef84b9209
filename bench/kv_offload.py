"""What the prefix cache's lower tiers buy a multi-turn workload: 64 conversations x 8 turns on one
engine, a shared system prompt, each turn the whole history plus a new user message, the device's KV
cache sized to hold a quarter of the last turn's tokens. Each turn's 64 requests are submitted together
(TTFT includes the queue). Run without tiers (evicted prefixes are recomputed), with a host-memory tier
and with a disk tier (both large enough for everything), each from cold, same run; the outputs of all
three must be token-identical.

Usage:  .venv/bin/python -m bench.kv_offload [--shape smollm2-135m] [--conversations 64] [--turns 8]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.models import SHAPES, build_random_model
from bench.report import load_average, machine_description, percentile
from bench.workload import FIRST_PROMPT_TOKEN, greedy
from nanovllm import LLM
from nanovllm.worker.device import DTYPES, resolve_placement
from nanovllm.worker.model_config import ModelConfig

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--device-share", type=float, default=0.25, help="of the last turn's tokens")
    parser.add_argument("--disk-path", default=None, help="default: a temporary directory")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@dataclass
class Result:
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    outputs: list[list[int]]
    hit_tokens: dict[str, int]  # prompt tokens served from each tier
    queried_tokens: int
    preemptions: int
    engine_ms_per_block: dict[str, tuple[float, float]]  # per tier: queueing a copy down, copying one up


def run(llm: LLM, args: argparse.Namespace, vocab: int) -> Result:
    """Every turn of every conversation through the engine's step API, turn by turn."""
    rng = random.Random(args.seed)
    system = [rng.randrange(FIRST_PROMPT_TOKEN, vocab) for _ in range(args.system_tokens)]
    histories = [list(system) for _ in range(args.conversations)]
    engine = llm.engine
    params = greedy(args.output_tokens)
    ttft, outputs = [], []
    started = time.perf_counter()
    for turn in range(args.turns):
        for i, history in enumerate(histories):
            history += [rng.randrange(FIRST_PROMPT_TOKEN, vocab) for _ in range(args.user_tokens)]
            engine.add_request(f"{turn}-{i}", list(history), params)
        submitted = time.perf_counter()
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                if out.new_token_ids and out.request_id not in tokens:
                    ttft.append(time.perf_counter() - submitted)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        for i, history in enumerate(histories):
            history += tokens[f"{turn}-{i}"]
            outputs.append(tokens[f"{turn}-{i}"])
    wall = time.perf_counter() - started
    bm = engine.block_manager
    lower = {"host": 0, "disk": 0}
    engine_ms: dict[str, tuple[float, float]] = {}
    engine.drain_kv_tiers()
    tiers = engine.load().kv_tiers
    if tiers:
        block_nbytes = engine.runner.kv_offload.block_nbytes
        lower = {tier: s.hits * BLOCK for tier, s in tiers.items()}
        for tier, s in tiers.items():
            down = s.seconds_down / (s.bytes_down / block_nbytes) if s.bytes_down else 0.0
            up = s.seconds_up / s.hits if s.hits else 0.0
            engine_ms[tier] = (down * 1000, up * 1000)
    return Result(
        wall_s=wall,
        output_tokens=sum(len(o) for o in outputs),
        ttft_s=ttft,
        outputs=outputs,
        hit_tokens={"device": bm.prefix_hit_tokens - sum(lower.values()), **lower},
        queried_tokens=bm.prefix_queried_tokens,
        preemptions=engine.load().num_preemptions,
        engine_ms_per_block=engine_ms,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = build_random_model(args.shape)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    element = resolve_placement("auto", args.dtype).dtype.itemsize
    block_bytes = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * element
    last_turn = args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
    distinct = args.system_tokens + args.conversations * (last_turn - args.system_tokens)
    device_blocks = int(args.device_share * args.conversations * last_turn / BLOCK)
    everything = 2 * (distinct // BLOCK + args.conversations) * block_bytes
    disk_root = Path(args.disk_path or tempfile.mkdtemp(prefix="nanovllm-kv-bench-"))
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(f"model: random {args.shape}, dtype {args.dtype}; {args.conversations} conversations x {args.turns} "
          f"turns, system prompt {args.system_tokens}, +{args.user_tokens} user and {args.output_tokens} output "
          f"tokens a turn (last turn {last_turn} tokens; {distinct:,} distinct tokens); device cache "
          f"{device_blocks} blocks of {BLOCK} ({device_blocks * block_bytes / 2**20:,.0f} MiB), tiers "
          f"{everything / 2**20:,.0f} MiB; disk tier in {disk_root}")  # fmt: skip
    runs = {
        "device only": {},
        "+ host tier": {"kv_host_memory": everything},
        "+ disk tier": {"kv_disk_path": str(disk_root), "kv_disk_bytes": everything},
    }
    results: dict[str, Result] = {}
    for name, tiers in runs.items():
        shutil.rmtree(disk_root, ignore_errors=True)
        llm = LLM(
            str(model_dir),
            max_model_len=last_turn + 1,
            max_num_seqs=args.conversations,
            kv_cache_memory=device_blocks * block_bytes,
            dtype=args.dtype,
            num_threads=args.threads,
            **tiers,
        )
        results[name] = run(llm, args, cfg.vocab_size)
        llm.shutdown()
        r = results[name]
        print(f"  {name}: {r.wall_s:.1f} s, TTFT p50 {statistics.median(r.ttft_s) * 1000:,.0f} ms")
    shutil.rmtree(disk_root, ignore_errors=True)
    print(f"load average at end: {load_average()}")
    same = all(r.outputs == results["device only"].outputs for r in results.values())
    print(f"outputs token-identical across the three runs: {same}")
    base = results["device only"]
    print(f"\n| random {args.shape}, {args.dtype} | wall s | output tok/s | TTFT p50 ms | TTFT p90 ms | "
          "prompt tokens hit: device / host / disk | preemptions |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, r in results.items():
        rates = " / ".join(f"{r.hit_tokens[t] / r.queried_tokens:.1%}" for t in ("device", "host", "disk"))
        print(f"| {name} | {r.wall_s:.1f} | {r.output_tokens / r.wall_s:,.1f} | "
              f"{statistics.median(r.ttft_s) * 1000:,.0f} | {percentile(r.ttft_s, 0.9) * 1000:,.0f} | {rates} | "
              f"{r.preemptions} |")  # fmt: skip
    for name in ("+ host tier", "+ disk tier"):
        tier = name.split()[1]
        down, up = results[name].engine_ms_per_block[tier]
        print(f"{name}: the engine thread's time per block of {block_bytes / 2**10:,.0f} KiB: {down:.3f} ms to "
              f"queue its copy down, {up:.3f} ms to copy it up")  # fmt: skip
    for name in ("+ host tier", "+ disk tier"):
        r = results[name]
        print(f"{name} / device only: throughput **{base.wall_s / r.wall_s:.2f}x**, TTFT p50 "
              f"**{statistics.median(base.ttft_s) / statistics.median(r.ttft_s):.2f}x** lower")  # fmt: skip


if __name__ == "__main__":
    main()
