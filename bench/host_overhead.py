"""Host work per decode step: what the engine's Python does around the device's work, measurable on a CPU.

On a GPU the device idles while the host schedules, builds the next step's inputs and applies the last
step's picks, unless that work overlaps the device's (async scheduling). This measures that work without
a GPU: a model with the Qwen3-0.6B shape's block size, batch and sequence lengths (nano-vllm's bench.py
draws: prompts of 100-1024 tokens, temperature 0.6) but tiny layers and vocabulary, so that the model's
forward pass, timed apart and subtracted, and the sampler's kernels (a 128-token vocabulary) cost
little; the batch's bookkeeping
(block tables of up to 128 blocks, 256 sequences) is the real one.

Columns, in ms per decode step (mean over the timed steps, after every prompt is prefilled):
  schedule   the scheduler (and admitting compiled constraints, proposals: none here)
  rows       the sampling rows of each sequence
  inputs     the step as integers (ModelRunner.step_inputs)
  to device  the integers as tensors on the device, and the graph/eager dispatch around the model
  sampler    the sampler's preparation (its kernels over a 128-token vocabulary included)
  update     applying the picks: tokens, stop checks, prefix-cache blocks, outputs
  host       the step's wall time less the model's forward pass: all of the above (a mean, so Python's
             garbage collections, a few ms now and then, count)
  host p50   its median

    python -m bench.host_overhead                       # batches 1, 64, 256, sync and async
    python -m bench.host_overhead --batches 256 --steps 64
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.models import SHAPES
from bench.report import machine_description
from nanovllm import LLM, SamplingParams

TINY = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
TINY |= {"intermediate_size": 128, "vocab_size": 128, "num_hidden_layers": 2}


def build_model(out_dir: Path) -> Path:
    config_cls, shape = SHAPES["qwen3-0.6b"]
    torch.manual_seed(0)
    config = config_cls(**{**shape, **TINY, "bos_token_id": 0, "eos_token_id": 1})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


def timed(record: list[float], fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - started)

    return wrapper


def measure(model_dir: Path, batch: int, steps: int, mode: str) -> dict[str, float]:
    """Mean ms per decode step of each phase at `batch` sequences, with async scheduling `mode`."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=4096,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=16384,
        kv_cache_memory="2GiB",
        enable_prefix_caching=False,
        async_scheduling=mode,
        num_threads=1,
    )
    engine, runner = llm.engine, llm.engine.runner
    model_time: list[float] = []
    runner.model.forward = timed(model_time, runner.model.forward)
    runner.model.compute_logits = timed(model_time, runner.model.compute_logits)
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(2, 128) for _ in range(rng.randint(100, 1024))]
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 16)
        engine.add_request(str(i), prompt, params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(4):  # warm-up decode steps
        engine.step()
    totals = dict.fromkeys(("schedule", "rows", "inputs", "to device", "sampler", "update", "host"), 0.0)
    hosts = []
    for _ in range(steps):
        del model_time[:]
        started = time.perf_counter()
        stats = engine.step().stats
        wall = time.perf_counter() - started
        if stats.num_prefill_tokens or stats.num_decode_tokens != batch:
            raise RuntimeError(f"step at batch {batch} was not a full decode step: {stats}")
        model = sum(model_time)
        totals["schedule"] += stats.schedule_s
        totals["rows"] += stats.rows_s + stats.draft_s + stats.mask_s
        totals["inputs"] += stats.prepare_s
        totals["to device"] += stats.forward_s - model
        totals["sampler"] += stats.sample_s
        totals["update"] += stats.update_s
        totals["host"] += wall - model
        hosts.append(wall - model)
    llm.shutdown()
    means = {name: 1000 * value / steps for name, value in totals.items()}
    return {**means, "host p50": 1000 * statistics.median(hosts)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--modes", nargs="+", default=["off", "on"], help="async_scheduling values")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print("model: Qwen3-0.6B's block size and workload lengths, tiny layers (bench/host_overhead.py)")
    columns = ("schedule", "rows", "inputs", "to device", "sampler", "update", "host", "host p50")
    print(f"| batch | async | {' | '.join(columns)} |")
    print(f"|---:|---|{'---:|' * len(columns)}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        for batch in args.batches:
            for mode in args.modes:
                row = measure(model_dir, batch, args.steps, mode)
                print(f"| {batch} | {mode} | {' | '.join(f'{row[c]:.3f}' for c in columns)} |", flush=True)


if __name__ == "__main__":
    main()
