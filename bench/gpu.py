"""GPU benchmark: nano-vllm's bench.py workload on a Qwen3-0.6B-shaped model, nanovllm vs transformers.

What it measures, in one process on one random-weight bf16 checkpoint (ignore_eos everywhere, so the
weights do not change the work; a random model of a shape costs what the real one costs):

  1. throughput  nano-vllm's bench.py exactly: random.seed(0), 256 requests, prompts of randint(100, 1024)
                 random token ids in [0, 10000], max_tokens randint(100, 1024), temperature 0.6,
                 ignore_eos (133,966 output tokens), timed over one LLM.generate after a warm-up;
  2. GPU busy    in decode: the engine is driven step by step over the same requests until every prompt
                 is prefilled, then a window of decode-only steps runs under torch.profiler (CUDA
                 activity only); busy = union of the GPU kernel intervals / wall time of the window;
  3. vs HF       transformers' static `generate` (left-padded batches, each run to its longest request,
                 only the tokens each request asked for counted) on the first 64 requests, against
                 nanovllm's LLM.generate on the same 64 requests; both in nanovllm's dtype;
  4. one stream  prompt 128, 256 new tokens, greedy: decode tok/s of both (prefill not timed);
  5. sampler     one sampler step at batch 256 over the model's vocabulary, temperature 0.6, in ms;
  6. KV dtype    with --kv-cache-dtype fp8: 1, 2's busy share and 4 again on an FP8 KV cache of the same
                 bytes, beside auto's.

Prefix caching is off: the workload shares no prefixes (no hits either way), and steps 2-4 repeat its
prompts, which must not be served from the cache. The KV cache is sized to hold the whole workload, so
nothing is preempted and the rest of the GPU is left to transformers.

On the GPU machine (CUDA torch in .venv; no network needed):

    .venv/bin/python -m bench.gpu                        # Qwen3-0.6B shape, random weights
    .venv/bin/python -m bench.gpu --model /path/to/Qwen3-0.6B --attention-backend triton

CPU smoke test (tiny sizes; GPU busy is reported as n/a):

    .venv/bin/python -m bench.gpu --device cpu --tiny --layers 2 --num-seqs 4 --max-input-len 64 \\
        --max-output-len 16 --profile-steps 4 --single-prompt 16 --single-new-tokens 8 --sampler-batch 8
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import importlib.metadata
import math
import pstats
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, GenerationConfig

from bench.baselines import load_hf
from bench.engine_run import nanovllm_single_stream, record_steps
from bench.models import SHAPES
from bench.report import machine_description
from nanovllm import LLM, SamplingParams
from nanovllm.kernels.fp8_kv import KV_CACHE_DTYPES
from nanovllm.worker.config import ATTENTION_BACKENDS
from nanovllm.worker.device import DTYPES, resolve_placement
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.sample.sampler import Sampler
from nanovllm.worker.step import SamplingRow

DEFAULT_SIZES = (256, 1024, 1024, 100)  # num_seqs, max_input_len, max_output_len, min_len: bench.py's
DEFAULT_OUTPUT_TOKENS = 133_966  # what bench.py's draws give for those sizes
TINY = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 10240,
}  # vocab must exceed bench.py's token ids (<= 10000)


# --------------------------------------------------------------------------------------------------
# Workload and model


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.params[:n])


def make_workload(num_seqs: int, max_input_len: int, max_output_len: int, min_len: int) -> Workload:
    """nano-vllm's bench.py draws, in its order, from the global RNG seeded with 0."""
    random.seed(0)
    lo_in, lo_out = min(min_len, max_input_len), min(min_len, max_output_len)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(lo_in, max_input_len))]
        for _ in range(num_seqs)
    ]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(lo_out, max_output_len))
        for _ in range(num_seqs)
    ]
    return Workload(prompts, params)


def build_model(out_dir: Path, layers: int | None, tiny: bool, shape_name: str, device: torch.device) -> Path:
    """A Qwen3 shape (bench/models.py) with seeded random weights, saved by transformers in bf16. The
    weights are drawn on `device`: the Qwen3-30B-A3B shape's 8 layers hold 4.8B parameters, which a CPU
    takes tens of seconds to draw."""
    config_cls, shape = SHAPES[shape_name]
    shape = {**shape, **(TINY if tiny else {}), **({"num_hidden_layers": layers} if layers else {})}
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config_cls(**shape), dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the draw's memory back before the engine loads
    return out_dir


def kv_cache_bytes(cfg: ModelConfig, workload: Workload, dtype: torch.dtype, block: int = 16) -> int:
    """KV cache for every request of the workload at once (a spare block each, 10% more), and at least
    two sequences of max_model_len 4096."""
    lens = [len(p) + s.max_tokens for p, s in zip(workload.prompts, workload.params)]
    blocks = max(sum(math.ceil(n / block) + 1 for n in lens), 2 * 4096 // block)
    return int(
        1.1
        * blocks
        * 2
        * cfg.num_hidden_layers
        * block
        * cfg.num_key_value_heads
        * cfg.head_dim
        * dtype.itemsize
    )


def decode_bytes_per_token(cfg: ModelConfig, context: int, element: int, every_expert: bool = False) -> int:
    """Bytes one decode step of one sequence must read: every weight once (of the embedding only the
    token's row; the LM head whole, tied or not; of a mixture-of-experts layer the router and the top_k
    chosen experts, or all of them with `every_expert`) and the KV cache of `context` tokens."""
    hidden, d = cfg.hidden_size, cfg.head_dim
    attention = hidden * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    dense_mlp = 3 * hidden * cfg.intermediate_size
    weights = cfg.num_hidden_layers * (attention + dense_mlp) + cfg.vocab_size * hidden
    if cfg.moe is not None:
        experts = cfg.moe.num_experts if every_expert else cfg.moe.top_k
        sparse_mlp = cfg.moe.num_experts * hidden + experts * 3 * hidden * cfg.moe.intermediate_size
        weights += len(cfg.moe.sparse_layers) * (sparse_mlp - dense_mlp)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * context
    return (weights + kv) * element


def copy_bandwidth(device: torch.device, nbytes: int = 2**31) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the best of 5: the memory-bound
    limit one stream's decode is held against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# nanovllm


def build_llm(
    args: argparse.Namespace,
    model_dir: Path,
    workload: Workload,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> LLM:
    """nano-vllm bench.py's LLM(...) (max_model_len 4096, nano-vllm's batch limits), warmed up."""
    llm = LLM(
        str(model_dir),
        max_model_len=4096,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=kv_cache_bytes(ModelConfig.from_pretrained_dir(model_dir), workload, dtype),
        enable_prefix_caching=False,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling,
        deterministic=args.deterministic,
        kv_cache_dtype=kv_cache_dtype,
    )
    # Prefill lengths 16..816, sampled decode at batch 8 down to 1, one greedy request; then the workload's
    # own prompts, two tokens each: its prefill steps' shapes, so that no Triton kernel is compiled inside
    # the timed run (on a fresh H200 one was: a second in the first run, none once cached).
    rng = random.Random(1234)
    warm = [[rng.randint(0, 10000) for _ in range(16 + 100 * i)] for i in range(9)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8 * (i + 1)) for i in range(8)]
    params.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8))
    llm.generate(warm, params, use_tqdm=False)
    two = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2)
    llm.generate(workload.prompts, [two] * len(workload.prompts), use_tqdm=False)
    return llm


def timed_generate(llm: LLM, workload: Workload, device: torch.device, breakdown: bool = False) -> float:
    """Output tok/s of one LLM.generate over the workload; checks every request got its max_tokens. With
    `breakdown`, prints where the wall time went: steps with prompt tokens, decode-only steps by batch."""
    sync(device)
    with record_steps(llm) as steps:
        t0 = time.perf_counter()
        outputs = llm.generate(workload.prompts, workload.params, use_tqdm=False)
        sync(device)
        wall = time.perf_counter() - t0
    if [len(o["token_ids"]) for o in outputs] != [p.max_tokens for p in workload.params]:
        raise RuntimeError("nanovllm generated a different number of tokens than requested")
    if breakdown:
        prefill = [s for s in steps if s.prefill_tokens]
        parts = [f"{len(steps)} steps in {sum(s.wall_s for s in steps):.2f} of {wall:.2f} s"]
        parts.append(f"{len(prefill)} with prompt tokens: {sum(s.wall_s for s in prefill):.2f} s")
        for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 256), (257, 512)):
            part = [s for s in steps if not s.prefill_tokens and lo <= s.decode_tokens <= hi]
            if part:
                ms = 1e3 * sum(s.wall_s for s in part) / len(part)
                parts.append(f"decode batch {lo}-{hi}: {len(part)} steps, {ms:.2f} ms/step")
        print("    " + "; ".join(parts))
    return workload.output_tokens / wall


@dataclass
class DecodeWindow:
    steps: int
    mean_batch: float
    wall_s: float  # the unprofiled window
    profiled_steps: int = 0
    profiled_wall_s: float = 0.0
    kernels: int = 0
    kernel_s: float | None = None  # union of the kernels' intervals
    copy_s: float = 0.0  # union of the memcpy/memset intervals
    top_kernels: list[tuple[str, int, float]] = field(default_factory=list)  # name, launches, seconds

    @property
    def busy(self) -> str:
        if self.kernel_s is None or not self.profiled_wall_s:
            return "n/a (no GPU)"
        return f"{self.kernel_s / self.profiled_wall_s:.1%}"


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in microseconds, in seconds."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e6


def kernel_table(events: list[tuple[str, float, float]], top: int = 14) -> list[tuple[str, int, float]]:
    """The kernels that took the most GPU time, grouped by name: (name, launches, seconds)."""
    by_name: dict[str, list[float]] = {}
    for name, start, end in events:
        entry = by_name.setdefault(name[:70], [0, 0.0])
        entry[0] += 1
        entry[1] += (end - start) / 1e6
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return [(name, int(count), seconds) for name, (count, seconds) in ranked]


def run_decode_steps(llm: LLM, n: int, device: torch.device) -> tuple[int, int, float]:
    """Up to n decode-only steps (fewer if requests run out): (steps, decode tokens, wall seconds)."""
    engine = llm.engine
    steps = tokens = 0
    sync(device)
    t0 = time.perf_counter()
    while steps < n and engine.has_unfinished_requests():
        stats = engine.step().stats
        if stats.num_prefill_tokens:
            raise RuntimeError("a prefill step ran inside the decode window")
        steps, tokens = steps + 1, tokens + stats.num_decode_tokens
    sync(device)
    return steps, tokens, time.perf_counter() - t0


def decode_window(
    llm: LLM,
    workload: Workload,
    n: int,
    device: torch.device,
    host_profile: bool = False,
    top_kernels: int = 14,
) -> DecodeWindow:
    """Prefill the whole workload step by step, then time n decode-only steps and, on CUDA, profile
    the next n: the first window warms the profiled one up and shows what the profiler costs. With
    `host_profile`, n more steps run under cProfile and the host functions that took longest print."""
    engine = llm.engine
    ids = [f"window-{i}" for i in range(len(workload.prompts))]
    for rid, prompt, params in zip(ids, workload.prompts, workload.params):
        engine.add_request(rid, prompt, params)
    prefilling = True
    while engine.load().num_waiting or prefilling:
        prefilling = engine.step().stats.num_prefill_tokens > 0
    steps, tokens, wall = run_decode_steps(llm, n, device)
    window = DecodeWindow(steps, tokens / max(steps, 1), wall)
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            window.profiled_steps, _, window.profiled_wall_s = run_decode_steps(llm, n, device)
        gpu = [
            (e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA
        ]
        kernels = [(s, e) for name, s, e in gpu if not name.startswith(("Memcpy", "Memset"))]
        window.kernels, window.kernel_s = len(kernels), union_s(kernels)
        window.top_kernels = kernel_table(gpu, top_kernels)
        window.copy_s = union_s([(s, e) for name, s, e in gpu if name.startswith(("Memcpy", "Memset"))])
    if host_profile:
        profiler = cProfile.Profile()
        profiler.enable()
        profiled = run_decode_steps(llm, n, device)[0]
        profiler.disable()
        print(f"    host profile of {profiled} decode steps (cProfile inflates Python), by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return window


# --------------------------------------------------------------------------------------------------
# transformers


def sampler_ms(vocab: int, batch: int, device: torch.device, steps: int) -> float:
    """Mean milliseconds of one sampler step on [batch, vocab] fp32 logits with bench.py's sampling
    (temperature 0.6), its copy of the tokens to the host included."""
    sampler = Sampler(torch.Generator(device).manual_seed(0))
    logits = torch.randn(batch, vocab, device=device)
    rows = [SamplingRow(SamplingParams(temperature=0.6, ignore_eos=True), [1], []) for _ in range(batch)]
    sampler(logits, rows)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        sampler(logits, rows)
    sync(device)
    return 1e3 * (time.perf_counter() - start) / steps


def hf_generate(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, temperature: float
) -> None:
    """One left-padded `generate` on the model's device, exactly `new_tokens` steps for every row
    (bench/baselines.py's hf_static_batch builds CPU tensors and samples greedily only)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        do_sample=bool(temperature),
        **sampling,
    )
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    sync(model.device)


def hf_static(model: torch.nn.Module, workload: Workload, batch_size: int) -> tuple[float, str]:
    """Requests sorted by max_tokens into equal-sized batches, each run to its longest; useful tok/s."""
    hf_generate(model, workload.prompts[:2], 4, 0.6)  # warm-up
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.params[i].max_tokens)
    num_batches = math.ceil(len(order) / batch_size)
    batches = [
        order[b * len(order) // num_batches : (b + 1) * len(order) // num_batches] for b in range(num_batches)
    ]
    run_tokens = 0
    t0 = time.perf_counter()
    for batch in batches:
        longest = max(workload.params[i].max_tokens for i in batch)
        hf_generate(model, [workload.prompts[i] for i in batch], longest, 0.6)
        run_tokens += longest * len(batch)
    wall = time.perf_counter() - t0
    waste = 1 - workload.output_tokens / run_tokens
    sizes = "/".join(str(len(b)) for b in batches)
    return (
        workload.output_tokens / wall,
        f"batches of {sizes}, {waste:.0%} of generated tokens past a request's max_tokens",
    )


def hf_single_stream(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> float:
    """Greedy decode tok/s for one request: N / (t(1 + N tokens) - t(1 token)), as bench/baselines.py."""
    hf_generate(model, [prompt], 4, 0.0)  # warm-up
    t0 = time.perf_counter()
    hf_generate(model, [prompt], 1, 0.0)
    t1 = time.perf_counter()
    hf_generate(model, [prompt], new_tokens + 1, 0.0)
    t2 = time.perf_counter()
    return new_tokens / ((t2 - t1) - (t1 - t0))


# --------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model dir (default: a random --shape)")
    p.add_argument(
        "--shape",
        default="qwen3-0.6b",
        choices=[name for name in SHAPES if name.startswith("qwen3")],
        help="the random model's shape",
    )
    p.add_argument("--layers", type=int, help="layer count of the random model (default 28)")
    p.add_argument(
        "--tiny", action="store_true", help="random model with hidden 128, vocab 10240 (CPU smoke)"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="nanovllm's and transformers'")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: off on CUDA (as bench.py), on on CPU",
    )
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (EngineConfig)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *KV_CACHE_DTYPES],
        help="also run [1], the decode window's busy share and [4] with this KV cache, after auto's [6]",
    )
    p.add_argument("--num-seqs", type=int, default=DEFAULT_SIZES[0])
    p.add_argument("--max-input-len", type=int, default=DEFAULT_SIZES[1])
    p.add_argument("--max-output-len", type=int, default=DEFAULT_SIZES[2])
    p.add_argument(
        "--min-len", type=int, default=DEFAULT_SIZES[3], help="lower bound of both (capped at the max)"
    )
    p.add_argument("--max-num-seqs", type=int, default=512, help="nano-vllm's default")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="nano-vllm's default")
    p.add_argument("--profile-steps", type=int, default=32, help="decode steps per window")
    p.add_argument("--host-profile", action="store_true", help="cProfile one more decode window [2]")
    p.add_argument("--top-kernels", type=int, default=14, help="rows of the decode window's kernel table [2]")
    p.add_argument(
        "--hf-num-seqs", type=int, default=64, help="first N requests for the transformers comparison"
    )
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--single-prompt", type=int, default=128)
    p.add_argument("--single-new-tokens", type=int, default=256)
    p.add_argument("--sampler-batch", type=int, default=256, help="rows of the sampler timing [5]")
    p.add_argument("--sampler-steps", type=int, default=50)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    placement = resolve_placement(args.device, args.dtype)
    device, dtype = placement.device, placement.dtype
    if args.enforce_eager is None:
        args.enforce_eager = device.type != "cuda"
    sizes = (args.num_seqs, args.max_input_len, args.max_output_len, args.min_len)
    workload = make_workload(*sizes)
    print(
        f"workload: {args.num_seqs} requests, {sum(map(len, workload.prompts)):,} prompt tokens, "
        f"total output tokens {workload.output_tokens:,}"
    )
    if sizes == DEFAULT_SIZES:
        assert workload.output_tokens == DEFAULT_OUTPUT_TOKENS, "not nano-vllm bench.py's workload"
    hf_subset = workload.head(args.hf_num_seqs)
    rng = random.Random(1)
    single_prompt = [rng.randint(0, 10000) for _ in range(args.single_prompt)]

    with tempfile.TemporaryDirectory(prefix="nanovllm-gpu-bench-") as tmp:
        model_dir = args.model or build_model(Path(tmp), args.layers, args.tiny, args.shape, device)
        cfg = ModelConfig.from_pretrained_dir(model_dir)
        model_desc = f"{args.model or f'random {args.shape} shape' + (' (tiny)' if args.tiny else '')}: " + (
            f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}"
        )
        print(f"model: {model_desc}")

        llm = build_llm(args, model_dir, workload, dtype)
        backend = llm.engine.runner.kernel_backend
        print(
            f"nanovllm: {placement.dtype_name} on {device}, attention backend {backend}, "
            f"enforce_eager {args.enforce_eager}, async scheduling {llm.engine.async_scheduling}, "
            f"deterministic {args.deterministic}"
        )
        tps = timed_generate(llm, workload, device, breakdown=True)
        print(f"[1] nanovllm LLM.generate: {workload.output_tokens:,} output tokens, {tps:,.1f} tok/s")
        window = decode_window(llm, workload, args.profile_steps, device, args.host_profile, args.top_kernels)
        ms_per_step = 1e3 * window.wall_s / max(window.steps, 1)
        print(
            f"[2] decode window: {window.steps} steps at mean batch {window.mean_batch:.0f}, "
            f"{ms_per_step:.2f} ms/step; GPU busy (kernels / wall): {window.busy}"
        )
        if window.kernel_s is not None and window.profiled_steps:
            steps, wall = window.profiled_steps, window.profiled_wall_s
            print(
                f"    profiled window: {steps} steps, {1e3 * wall / steps:.2f} ms/step, "
                f"{window.kernels / steps:.0f} kernels/step; memcpy/memset busy {window.copy_s / wall:.1%}; "
                f"kernel time per step / unprofiled ms/step {1e3 * window.kernel_s / steps / ms_per_step:.1%}"
            )
            for name, count, seconds in window.top_kernels:
                print(
                    f"      {1e3 * seconds / steps:7.3f} ms/step {count / steps:6.1f} launches/step  {name}"
                )
        nano_hf_tps = timed_generate(llm, hf_subset, device)
        nano_single = nanovllm_single_stream(llm, single_prompt, args.single_new_tokens)
        sample_ms = sampler_ms(cfg.vocab_size, args.sampler_batch, device, args.sampler_steps)
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.kv_cache_dtype != "auto":
            kv_llm = build_llm(args, model_dir, workload, dtype, args.kv_cache_dtype)
            kv_tps = timed_generate(kv_llm, workload, device)
            kv_window = decode_window(kv_llm, workload, args.profile_steps, device, False, 0)
            kv_single = nanovllm_single_stream(kv_llm, single_prompt, args.single_new_tokens)
            blocks = kv_llm.engine.block_manager.num_blocks
            print(
                f"[6] --kv-cache-dtype {args.kv_cache_dtype} ({blocks:,} blocks in the same memory): "
                f"LLM.generate {kv_tps:,.1f} tok/s ({kv_tps / tps:.2f}x auto's); decode busy {kv_window.busy}; "
                f"one stream {kv_single:,.1f} tok/s ({kv_single / nano_single:.2f}x auto's)"
            )
            del kv_llm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

        hf_tps = hf_single = None
        hf_note = "transformers skipped"
        if not args.skip_hf:
            model = load_hf(model_dir, dtype).to(device)
            hf_tps, hf_note = hf_static(model, hf_subset, args.hf_batch_size)
            hf_note += f"; attention {model.config._attn_implementation}"
            hf_single = hf_single_stream(model, single_prompt, args.single_new_tokens)
            del model

    def ratio(nano: float, hf: float | None) -> str:
        return f"{nano:,.1f} / {hf:,.1f} ({nano / hf:.2f}x)" if hf else f"{nano:,.1f} / n/a"

    n = len(hf_subset.prompts)
    print(
        f"[3] first {n} requests ({hf_subset.output_tokens:,} output tokens, temperature 0.6, ignore_eos), "
        f"{placement.dtype_name}, tok/s: nanovllm LLM.generate / transformers static generate (useful "
        f"tokens): {ratio(nano_hf_tps, hf_tps)}\n    transformers: {hf_note}"
    )
    print(
        f"[4] one stream, prompt {args.single_prompt}, {args.single_new_tokens} new tokens, greedy, decode "
        f"only, tok/s: nanovllm / transformers: {ratio(nano_single, hf_single)}"
    )
    if device.type == "cuda":
        context = args.single_prompt + args.single_new_tokens // 2
        per_token = decode_bytes_per_token(cfg, context, dtype.itemsize)
        bandwidth = copy_bandwidth(device)
        limit = bandwidth / per_token
        print(
            f"    one stream reads {per_token / 1e9:.3f} GB a token; at the copy bandwidth measured here, "
            f"{bandwidth / 1e12:.2f} TB/s, the limit is {limit:,.0f} tok/s: nanovllm runs at "
            f"{nano_single / limit:.1%} of it"
        )

    print(
        f"[5] sampler at batch {args.sampler_batch}, vocab {cfg.vocab_size}, temperature 0.6: "
        f"{sample_ms:.2f} ms/step"
    )

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_description()
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nmodel: {model_desc}; {placement.dtype_name}; enforce_eager {args.enforce_eager}\n")
    print(
        f"| date | device | torch | triton | transformers | attention backend | {args.num_seqs} requests, "
        f"tok/s | decode GPU busy ({window.steps} steps, batch {window.mean_batch:.0f}) "
        f"| first {n} requests, tok/s: nanovllm / HF | one stream, tok/s: nanovllm / HF "
        f"| sampler, ms/step (batch {args.sampler_batch}) |"
    )
    print("|---|---|---|---|---|---|---:|---:|---:|---:|---:|")
    print(
        f"| {date} | {device_name} | {torch.__version__} | {triton} | {transformers.__version__} | {backend} "
        f"| {tps:,.1f} | {window.busy} | {ratio(nano_hf_tps, hf_tps)} | {ratio(nano_single, hf_single)} "
        f"| {sample_ms:.2f} |"
    )


if __name__ == "__main__":
    main()
