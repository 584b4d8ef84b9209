"""What serving LoRA adapters costs: bench.throughput's W64 workload on one engine, its requests all on the
base model, then spread over 8 adapters (8 requests each, mixed in every batch), the runs alternating; the
ratio is what matters (the issue's target: mixed >= 0.8x base).

The adapters are random, in PEFT's format (every projection of every layer, rank --rank), written once
into the cache beside the model. On a CPU a step with adapter rows runs the layers module by module (the
C++ one-call decode layers know no adapters) plus one C++ call per projection for every adapter's rows; on
CUDA a decode step with adapter rows replays its own graph, two Triton kernels per projection.

With --steps, one more run of each through the engine step by step: its prefill and decode steps' wall
time apart, so a gap between the two runs can be placed.

Usage:  .venv/bin/python -m bench.lora [--shape smollm2-135m] [--rank 16] [--adapters 8] [--rounds 3]
            [--steps]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.engine_run import build_llm, warm_up_nanovllm
from bench.models import SHAPES, build_random_model
from bench.report import load_average, machine_description
from bench.workload import greedy, make_workload
from nanovllm import LLM
from nanovllm.worker.device import DTYPES
from nanovllm.worker.model_config import ModelConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating; medians")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", action="store_true", help="time prefill and decode steps apart")
    return parser.parse_args(argv)


def _layer_projections(cfg: ModelConfig, layer: int) -> dict[str, tuple[str, int, int]]:
    """Every projection LoRA adapts in `layer`: name -> (its module group, fan-in, fan-out). A hybrid's
    linear-attention layers have the Gated DeltaNet's projections where attention's are (and its
    full-attention q_proj a gate half); a MoE layer's experts are not adapted."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    hybrid = cfg.hybrid
    if hybrid is not None and layer in hybrid.linear_layers:
        values = hybrid.num_value_heads * hybrid.value_head_dim
        mixer = {"in_proj_qkv": (h, hybrid.conv_dim), "in_proj_z": (h, values), "out_proj": (values, h)}
        mixer |= {"in_proj_b": (h, hybrid.num_value_heads), "in_proj_a": (h, hybrid.num_value_heads)}
        projections = {name: ("linear_attn", *shape) for name, shape in mixer.items()}
    else:
        q_rows = 2 * q if hybrid is not None else q
        attention = {"q_proj": (h, q_rows), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        projections = {name: ("self_attn", *shape) for name, shape in attention.items()}
    if cfg.moe is None or layer not in cfg.moe.sparse_layers:
        mlp = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        projections |= {name: ("mlp", *shape) for name, shape in mlp.items()}
    return projections


def write_adapter(cfg: ModelConfig, out_dir: Path, rank: int, seed: int) -> Path:
    """A random rank-`rank` PEFT adapter on every projection of every layer of a model shaped `cfg`."""
    if (out_dir / "adapter_model.safetensors").is_file():
        return out_dir
    generator = torch.Generator().manual_seed(seed)
    tensors, targets = {}, set()
    for layer in range(cfg.num_hidden_layers):
        for target, (group, fan_in, fan_out) in _layer_projections(cfg, layer).items():
            name = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) / rank**0.5
            targets.add(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(targets)}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def timed_generate(
    llm: LLM, prompts: list[list[int]], output_lens: list[int], names: list[str | None]
) -> float:
    """Output tokens/s of one run of the workload with each request's adapter."""
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, [greedy(n) for n in output_lens], use_tqdm=False, lora_name=names)
    wall = time.perf_counter() - t0
    return sum(len(o["token_ids"]) for o in outputs) / wall


def step_times(
    llm: LLM, prompts: list[list[int]], output_lens: list[int], names: list[str | None]
) -> dict[str, tuple[int, float]]:
    """One run of the workload step by step: (steps, wall seconds) of the steps that prefill any tokens
    and of the decode-only ones, each step's time ending when its outputs are on the host."""
    engine = llm.engine
    for k, (prompt, n, name) in enumerate(zip(prompts, output_lens, names)):
        engine.add_request(f"steps-{k}", prompt, greedy(n), lora_name=name)
    times = {"prefill": (0, 0.0), "decode": (0, 0.0)}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        stats = engine.step().stats
        kind = "prefill" if stats.num_prefill_tokens else "decode"
        steps, seconds = times[kind]
        times[kind] = (steps + 1, seconds + time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = build_random_model(args.shape)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    adapters = {
        f"a{k}": write_adapter(cfg, model_dir / "lora" / f"r{args.rank}-{k}", args.rank, args.seed + k)
        for k in range(args.adapters)
    }
    workload = make_workload(args.num_seqs, cfg.vocab_size, (32, 256), (32, 256), args.seed)
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(f"model: random {args.shape}; dtype {args.dtype}; W{len(workload)}: {workload.num_prompt_tokens:,} "
          f"prompt tokens, {workload.num_output_tokens:,} output tokens; {args.adapters} adapters of rank "
          f"{args.rank} on every projection")  # fmt: skip
    llm = build_llm(
        model_dir,
        workload,
        args,
        lora_adapters=[f"{name}={path}" for name, path in adapters.items()],
        max_loras=args.adapters,
        max_lora_rank=args.rank,
    )
    warm_up_nanovllm(llm, cfg.vocab_size)
    names = list(adapters)
    runs = {
        "base": [None] * len(workload),
        "mixed": [names[k % len(names)] for k in range(len(workload))],
    }
    results: dict[str, list[float]] = {kind: [] for kind in runs}
    for round_ in range(args.rounds):
        for kind, lora in runs.items():
            results[kind].append(timed_generate(llm, workload.prompts, workload.output_lens, lora))
            print(f"  round {round_ + 1}, {kind}: {results[kind][-1]:,.1f} tok/s")
    print(f"load average at end: {load_average()}")
    if args.steps:
        for kind, lora in runs.items():
            times = step_times(llm, workload.prompts, workload.output_lens, lora)
            parts = [
                f"{k}: {n} steps, {1e3 * t:,.1f} ms ({1e3 * t / max(n, 1):.2f} ms a step)"
                for k, (n, t) in times.items()
            ]
            print(f"  {kind} step by step: " + "; ".join(parts))
    base, mixed = (statistics.median(results[k]) for k in ("base", "mixed"))
    print(f"\n| random {args.shape}, {args.dtype}, W{len(workload)} | output tok/s |")
    print("|---|---:|")
    print(f"| base model only | {base:,.1f} |")
    print(f"| {args.adapters} adapters mixed (rank {args.rank}) | {mixed:,.1f} |")
    print(f"| mixed / base | **{mixed / base:.2f}x** |")


if __name__ == "__main__":
    main()
