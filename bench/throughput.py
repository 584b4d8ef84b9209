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

Usage:  .venv/bin/python bench/throughput.py [--num-seqs 64] [--single-stream] [--skip-hf]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench.models` when run as a script

import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from bench.models import SHAPES, build_random_model
from nanovllm import LLM, SamplingParams
from nanovllm.common.config import ModelConfig
from nanovllm.worker.device import DTYPES, cpu_bf16_support, cpu_flags
from nanovllm.worker.engine import StepResult

# Token ids below this are often special (bos/eos/pad) in real vocabularies; keep prompts clear of them.
FIRST_PROMPT_TOKEN = 10


# --------------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class Workload:
    """Prompts and the exact number of tokens each request must generate."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def __len__(self) -> int:
        return len(self.prompts)


def make_workload(
    num_seqs: int, vocab: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> Workload:
    """Random prompts and output lengths, reproducible from `seed` alone.

    Lengths are drawn before any token id, so the token counts do not depend on the vocabulary size
    and the same seed gives the same workload shape for every model.
    """
    rng = random.Random(seed)
    input_lens = [rng.randint(*input_range) for _ in range(num_seqs)]
    output_lens = [rng.randint(*output_range) for _ in range(num_seqs)]
    prompts = [[rng.randrange(FIRST_PROMPT_TOKEN, vocab - 1) for _ in range(n)] for n in input_lens]
    return Workload(prompts, output_lens)


# --------------------------------------------------------------------------------------------------
# nanovllm


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the benchmark saw it."""

    prefill_tokens: int
    decode_tokens: int
    sampled_rows: int  # sequences that produced a token this step (rows through the LM head)
    overhead_s: float  # schedule + input preparation + sampling + update
    forward_s: float  # the model's forward pass and LM head
    wall_s: float

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass
class NanoResult:
    """The timed nanovllm run and the steps it took, which the ceiling is computed from."""

    wall_s: float
    output_tokens: int
    steps: list[StepRecord]
    num_preemptions: int
    num_cached_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


@contextmanager
def record_steps(llm: LLM) -> Iterator[list[StepRecord]]:
    """Record every engine step that `llm.generate` takes, without changing what it does.

    Recording inside the timed generate call (rather than in a second pass that drives the engine
    by hand) matters: a second pass over the same prompts would hit the prefix cache and run
    different, smaller steps. The wrapper costs one list append per step.
    """
    engine = llm.engine
    step = engine.step
    records: list[StepRecord] = []

    def recording_step() -> StepResult:
        t0 = time.perf_counter()
        result = step()
        wall = time.perf_counter() - t0
        stats = result.stats
        records.append(
            StepRecord(
                prefill_tokens=stats.num_prefill_tokens,
                decode_tokens=stats.num_decode_tokens,
                sampled_rows=sum(len(o.new_token_ids) for o in result.outputs),
                overhead_s=stats.overhead_s,
                forward_s=stats.forward_s,
                wall_s=wall,
            )
        )
        return result

    engine.step = recording_step  # type: ignore[method-assign]
    try:
        yield records
    finally:
        del engine.step  # back to the class's method


def greedy(max_tokens: int) -> SamplingParams:
    """Exactly `max_tokens` greedy tokens: ignore_eos keeps the workload independent of the weights."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def build_llm(model_dir: Path, workload: Workload, args: argparse.Namespace) -> LLM:
    """An engine whose KV cache holds the whole workload at once, so nothing is preempted."""
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    max_model_len = max(1024, longest + 1)
    block = 16  # EngineConfig.kvcache_block_size default
    blocks = sum(math.ceil((len(p) + n) / block) + 1 for p, n in zip(workload.prompts, workload.output_lens))
    bytes_per_block = 2 * cfg.num_hidden_layers * block * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32
    kv_bytes = max(2 * 2**30, int(blocks * bytes_per_block * 1.1))
    return LLM(
        str(model_dir),
        max_model_len=max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=kv_bytes,
        enforce_eager=True,
        dtype=args.dtype,
    )


def warm_up_nanovllm(llm: LLM, vocab: int) -> None:
    """A few steps of prefill and decode so that first-call costs stay out of the measurement."""
    warm = make_workload(4, vocab, (16, 64), (8, 8), seed=12345)
    llm.generate(warm.prompts, [greedy(n) for n in warm.output_lens], use_tqdm=False)


def run_nanovllm(llm: LLM, workload: Workload) -> NanoResult:
    params = [greedy(n) for n in workload.output_lens]
    preempted_before = llm.engine.load().num_preemptions
    with record_steps(llm) as steps:
        t0 = time.perf_counter()
        outputs = llm.generate(workload.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    got = [len(o["token_ids"]) for o in outputs]
    if got != workload.output_lens:
        raise RuntimeError("nanovllm generated a different number of tokens than requested")
    return NanoResult(
        wall_s=wall,
        output_tokens=sum(got),
        steps=steps,
        num_preemptions=llm.engine.load().num_preemptions - preempted_before,
        num_cached_tokens=sum(o.get("num_cached_tokens", 0) for o in outputs),
    )


def nanovllm_single_stream(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s for one request: the prefill step (and its first token) is not timed."""
    engine = llm.engine
    engine.add_request("single-stream", prompt, greedy(new_tokens + 1))
    engine.step()  # prefill, samples the first token
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step().outputs)
    return produced / (time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------
# Matmul-only ceiling


def _bracket(m: int) -> tuple[int, int]:
    """The powers of two around m (equal when m is one)."""
    hi = 1 << max(0, (m - 1).bit_length())
    return (hi if hi == m else hi // 2), hi


class MatmulCeiling:
    """Time of the model's own linear layers (in their dtype) at M tokens, as a lower bound for a step.

    Timings are taken at powers of two and interpolated linearly in between: matmul time is flat in
    M while it is bound by reading the weights, and linear once it is bound by arithmetic. Small M
    runs through every layer's weights, because one layer's weights would sit in cache and look
    faster than the real model; large M is compute bound, so one layer times the layer count is
    accurate and much cheaper to measure.
    """

    ALL_LAYERS_UP_TO = 256

    def __init__(self, model: torch.nn.Module) -> None:
        self.layer_weights = [
            [
                layer.self_attn.qkv_proj.weight,
                layer.self_attn.o_proj.weight,
                layer.mlp.gate_up_proj.weight,
                layer.mlp.down_proj.weight,
            ]
            for layer in model.model.layers
        ]
        self.lm_head = model.lm_head.weight
        self._stack: dict[int, float] = {}
        self._head: dict[int, float] = {}

    @staticmethod
    def _time(fn: Callable[[], None], min_total_s: float = 0.2, min_reps: int = 3) -> float:
        """Best of several runs: a ceiling is what the hardware can do, and on a shared machine every
        slower run is someone else's load, not the matmul."""
        fn()  # warm-up: allocator and kernel selection
        times: list[float] = []
        while len(times) < min_reps or sum(times) < min_total_s:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if len(times) >= 50:
                break
        return min(times)

    def _measure_stack(self, m: int) -> float:
        in_dims = {w.shape[1] for w in self.layer_weights[0]}
        dtype = self.lm_head.dtype
        inputs = {d: torch.randn(m, d, dtype=dtype) for d in in_dims}
        layers = self.layer_weights if m <= self.ALL_LAYERS_UP_TO else self.layer_weights[:1]

        def run() -> None:
            for weights in layers:
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)

        with torch.inference_mode():
            return self._time(run) * len(self.layer_weights) / len(layers)

    def _measure_head(self, m: int) -> float:
        x = torch.randn(m, self.lm_head.shape[1], dtype=self.lm_head.dtype)
        with torch.inference_mode():
            return self._time(lambda: F.linear(x, self.lm_head), min_total_s=0.05)

    @staticmethod
    def _interpolate(m: int, table: dict[int, float], measure: Callable[[int], float]) -> float:
        if m <= 0:
            return 0.0
        lo, hi = _bracket(m)
        for b in {lo, hi}:
            if b not in table:
                table[b] = measure(b)
        if lo == hi:
            return table[lo]
        return table[lo] + (table[hi] - table[lo]) * (m - lo) / (hi - lo)

    def step_time(self, num_tokens: int, sampled_rows: int) -> float:
        return self._interpolate(num_tokens, self._stack, self._measure_stack) + self._interpolate(
            sampled_rows, self._head, self._measure_head
        )


# --------------------------------------------------------------------------------------------------
# transformers


@dataclass
class HFResult:
    """One transformers measurement; tokens_per_s is None when it could not run."""

    label: str
    tokens_per_s: float | None
    note: str = ""


def load_hf(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh transformers model (continuous batching may switch a model's attention backend)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


def hf_static_batch(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> None:
    """One left-padded `generate` call that runs exactly `new_tokens` steps for every row."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def run_hf_static(model: torch.nn.Module, workload: Workload, batch_size: int) -> HFResult:
    """Static batching: each batch runs to its longest request; only requested tokens count."""
    dtype = str(model.dtype).removeprefix("torch.")
    hf_static_batch(model, workload.prompts[:2], 4)  # warm-up
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        end = start + batch_size
        hf_static_batch(model, workload.prompts[start:end], max(workload.output_lens[start:end]))
    wall = time.perf_counter() - t0
    steps = sum(
        max(workload.output_lens[s : s + batch_size]) * len(workload.output_lens[s : s + batch_size])
        for s in range(0, len(workload), batch_size)
    )
    waste = 1 - workload.num_output_tokens / steps
    return HFResult(
        f"HF generate (static, batch {batch_size}, {dtype})",
        workload.num_output_tokens / wall,
        f"{waste:.0%} of generated tokens past their request's length",
    )


def run_hf_continuous(model: torch.nn.Module, workload: Workload, max_batch_tokens: int) -> HFResult:
    """transformers' continuous batching, with each request's own max_new_tokens.

    `generate_batch` takes one max_new_tokens for all prompts, so this drives the manager behind it
    (the same code path) and gives each request its own length and no EOS (-1), like ignore_eos.
    """
    label = f"HF generate_batch ({str(model.dtype).removeprefix('torch.')})"
    if not hasattr(model, "generate_batch"):
        return HFResult(label, None, "unavailable (this transformers has no generate_batch)")
    try:
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        page = 256
        pages = sum(math.ceil((len(p) + n) / page) for p, n in zip(workload.prompts, workload.output_lens))
        cb_config = ContinuousBatchingConfig(
            page_size=page, num_blocks=pages + 8, max_batch_tokens=max_batch_tokens
        )
        hints = WorkloadHints(
            max_prompt_length=max(len(p) for p in workload.prompts),
            max_generated_length=max(workload.output_lens),
            num_requests=len(workload),
        )
        gen_config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False)
        with model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            workload_hints=hints,
            block=True,
            timeout=30,
        ) as manager:
            _hf_cb_run(manager, workload.prompts[:2], [4, 4])  # warm-up
            t0 = time.perf_counter()
            produced = _hf_cb_run(manager, workload.prompts, workload.output_lens)
            wall = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - any failure of an optional, fast-moving API is reported, not fatal
        return HFResult(label, None, f"unavailable ({type(exc).__name__}: {exc})")
    if produced != workload.output_lens:
        return HFResult(label, None, "unavailable (generated a different number of tokens than requested)")
    return HFResult(label, workload.num_output_tokens / wall)


def _hf_cb_run(manager: Any, prompts: list[list[int]], output_lens: list[int]) -> list[int]:
    """Submit every request, wait for all of them, return the tokens each one generated."""
    ids = [
        manager.add_request(input_ids=p, max_new_tokens=n, eos_token_id=-1)
        for p, n in zip(prompts, output_lens)
    ]
    if any(i is None for i in ids):
        raise RuntimeError("the manager refused a request")
    done: dict[str, int] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the generation thread stopped")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(result.error)
            done[result.request_id] = len(result.generated_tokens)
    return [done[i] for i in ids]


def hf_single_stream(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s for one request: the difference of a 1-token and a (1 + N)-token generate."""
    hf_static_batch(model, [prompt], 4)  # warm-up
    t0 = time.perf_counter()
    hf_static_batch(model, [prompt], 1)
    t1 = time.perf_counter()
    hf_static_batch(model, [prompt], new_tokens + 1)
    t2 = time.perf_counter()
    return new_tokens / ((t2 - t1) - (t1 - t0))


# --------------------------------------------------------------------------------------------------
# Reporting


def machine_description() -> str:
    model = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), model
        )
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "bf16") if f in flags]
    return (
        f"{model}, nproc {os.cpu_count()}, torch threads {torch.get_num_threads()}, "
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, flags: {' '.join(shown) or 'none'}"
        f" ({cpu_bf16_support()[1]})"
    )


def load_average() -> str:
    """1/5/15-minute load: on a shared machine, anything above 0 means the timings include other work."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report_steps(result: NanoResult) -> None:
    steps = result.steps
    overhead = [s.overhead_s for s in steps]
    total = sum(s.wall_s for s in steps)
    decode_only = [s.decode_tokens for s in steps if s.prefill_tokens == 0 and s.decode_tokens]
    mixed = sum(1 for s in steps if s.prefill_tokens and s.decode_tokens)
    print(f"  steps: {len(steps)} ({sum(1 for s in steps if s.prefill_tokens)} with prefill, {mixed} mixed)")
    print(
        f"  python overhead per step (schedule + inputs + sampling + update): "
        f"{1e3 * statistics.mean(overhead):.2f} ms = {sum(overhead) / total:.1%} of step time;"
        f" model forward + LM head: {sum(s.forward_s for s in steps) / total:.1%}"
    )
    if decode_only:
        print(
            f"  decode batch size (decode-only steps): mean {statistics.mean(decode_only):.1f},"
            f" min {min(decode_only)}, p50 {percentile(decode_only, 0.5)},"
            f" p90 {percentile(decode_only, 0.9)}, max {max(decode_only)}"
        )
        buckets: dict[int, int] = {}
        for size in decode_only:
            lo, _ = _bracket(size)
            buckets[lo] = buckets.get(lo, 0) + 1
        hist = ", ".join(f"{lo}-{2 * lo - 1}: {n}" for lo, n in sorted(buckets.items()))
        print(f"  decode batch size histogram (steps per size range): {hist}")
    print(f"  preemptions: {result.num_preemptions}, prefix-cache hit tokens: {result.num_cached_tokens}")


def print_summary(rows: list[tuple[str, float | None, str]], reference: float, title: str) -> None:
    print(f"\n### {title}\n")
    print("| engine | output tok/s | nanovllm / this | note |")
    print("|---|---:|---:|---|")
    for label, tps, note in rows:
        if tps is None:
            print(f"| {label} | n/a | n/a | {note} |")
        else:
            print(f"| {label} | {tps:,.1f} | {reference / tps:.2f}x | {note} |")


# --------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: a random --shape)")
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
    single = parser.add_argument_group("single stream")
    single.add_argument("--single-stream", action="store_true", help="also measure one-request decode speed")
    single.add_argument("--single-prompt", type=int, default=128)
    single.add_argument("--single-new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if args.hf_batch_size is None:
        args.hf_batch_size = args.num_seqs
    if not (1 <= args.min_input <= args.max_input and 1 <= args.min_output <= args.max_output):
        parser.error("need 1 <= --min-input <= --max-input and 1 <= --min-output <= --max-output")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # transformers' continuous batching logs through its own logger; its warnings (e.g. "EOS disabled",
    # which is what this benchmark wants) are noise here, its errors are not.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    model_dir = args.model or build_random_model(args.shape)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
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
    nano_single = None
    if args.single_stream:
        nano_single = nanovllm_single_stream(llm, single_prompt, args.single_new_tokens)
        print(f"  single stream decode: {nano_single:,.1f} tok/s")

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

        fastest_dtype = args.hf_dtypes[max(range(len(hf_rows)), key=lambda i: hf_rows[i].tokens_per_s or 0)]
        print(f"\n[transformers] continuous batching (generate_batch), {fastest_dtype} (faster static dtype)")
        model = load_hf(model_dir, DTYPES[fastest_dtype])
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


if __name__ == "__main__":
    main()
