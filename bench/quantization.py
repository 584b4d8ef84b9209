"""Weight-only quantization benchmark: the embedded SmolLM2-135M-Instruct one stream and W64 with its
weights in the model's dtype, in bfloat16, int8, int4, and the GGUF's Q4_1 as it ships, and llama.cpp on
the same GGUF, all in one run.

One stream: each prompt (128 tokens of the model's own text) alone, 256 new tokens, greedy, ignore_eos;
decode tokens/s from the first token to the last. W64: bench/throughput.py's batch workload (64 random
requests at once, 32-256 tokens in and out), output tokens/s. Engines run in this process one after the
other after a warm-up; llama.cpp (llama-cpp-python, bench/llama_cpp_peer.py under --llama-cpp-python)
decodes the same prompts to the same length after them. Ratios are against the default dtype's engine.

    .venv/bin/python -m bench.quantization [--prompts 3] [--max-tokens 256] [--skip-w64]
        [--llama-cpp-python PATH/TO/python]

With --shape (a random model of bench/models.py's shapes, e.g. qwen3.5-0.8b) the weights in the default
dtype, int8 and int4, one stream only (random 128-token prompts), and what each token read at most: the
median decode step's time times the machine's read bandwidth (the median of sums over 1 GiB taken before,
every 16 steps and after: the machine's bandwidth moves within seconds), against the weights' bytes (a
Qwen3.5 step also reads and writes its recurrent state, printed beside them); the same for each 16 steps
against the sums just before and after them (the median of those windows, and their range: the steps and
the bandwidth of the same seconds, where the run's two medians can pair a fast spell's sums with a slow
spell's steps); and each step against a
read of the same weights right after it (a max over each tensor of 1 MiB or more, scaled to all of them),
the median: the step's work beyond reading its weights, whatever the machine reads that second.

With --shape and --checkpoint fp8, the same random model also written as Qwen's block-FP8 checkpoints
ship (bench/models.py write_block_fp8) and served as it loads (dequantized to the dtype) and repacked to
int8 (--quantization int8), beside the float checkpoint in the dtype and in int8; one stream and (unless
--skip-w64) W64, a batch of 64 random requests (32-64 tokens in, 16-32 out), each against the float
checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import random
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch

from bench.models import SHAPES, build_random_model, write_block_fp8
from bench.moe import read_bandwidth
from bench.report import machine_description
from bench.speculation import llama_cpp, run_batch
from bench.workload import make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.worker.layers.quantization import PackedWeight
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import embedded_model_path
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
    "faster and more cheaply than any scribe. Within fifty years, presses had spread to more than two "
    "hundred cities across Europe, and millions of volumes had been printed. The consequences reached far "
    "beyond the workshop: scholars could compare identical copies of a text, reformers could spread "
    "pamphlets in weeks rather than years, and ordinary people gained access to almanacs, news sheets and "
    "grammars. Historians still debate how quickly literacy rose, but few doubt that the press changed how "
    "knowledge was stored, checked and shared. In the centuries that followed, "
)


def one_stream(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tokens/s, each prompt alone, timed from its first token."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    decode_s, decode_tokens = 0.0, 0
    for prompt in prompts:
        engine = llm.engine
        engine.add_request("bench", prompt, params)
        count, first_at = 0, 0.0
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                count += len(out.new_token_ids)
            if count and not first_at:
                first_at = time.perf_counter()
        decode_s += time.perf_counter() - first_at
        decode_tokens += count - 1
    return decode_tokens / decode_s


@dataclass(frozen=True)
class PairedStream:
    """One stream's decode steps, each against a read of the same weights right after it."""

    tokens_per_s: float  # decode tokens over the decode steps' own time
    step_s: float  # the median decode step
    against_read: float  # the median of each step's time over the read's after it
    bandwidth: float  # the median of the sums over 1 GiB before, every 16 steps and after
    bandwidth_range: tuple[float, float]
    # each 16 steps' median times the mean of the sums before and after them: the steps and the machine's
    # bandwidth of the same seconds (the run's medians pair moments that differ when the bandwidth moves)
    read_per_window: list[float]


def paired_stream(llm: LLM, prompts: list[list[int]], max_tokens: int) -> PairedStream:
    """Each prompt alone; after each decode step, a read of the model's weights (a max over each tensor of
    1 MiB or more, at the machine's threads; scaled to all the weights' bytes)."""
    tensors = [t for t in weight_tensors(llm.engine.runner.model) if t.numel() * t.element_size() >= 2**20]
    scale = weight_bytes(llm) / sum(t.numel() * t.element_size() for t in tensors)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps: list[float] = []
    against_read: list[float] = []
    bandwidths = [read_bandwidth()]
    windows: list[int] = [0]  # where each sum falls in `steps`
    engine = llm.engine
    for prompt in prompts:
        engine.add_request("bench", prompt, params)
        produced = 0
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = engine.step().outputs
            step = time.perf_counter() - start
            decoding = produced > 0  # the prompt's step gives the first token
            produced += sum(len(out.new_token_ids) for out in outputs)
            if not decoding:
                continue
            start = time.perf_counter()
            for tensor in tensors:
                tensor.max()
            steps.append(step)
            against_read.append(step / ((time.perf_counter() - start) * scale))
            if len(steps) % 16 == 0:
                bandwidths.append(read_bandwidth())
                windows.append(len(steps))
    bandwidths.append(read_bandwidth())
    windows.append(len(steps))
    read_per_window = [
        statistics.median(steps[begin:end]) * (bandwidths[i] + bandwidths[i + 1]) / 2
        for i, (begin, end) in enumerate(itertools.pairwise(windows))
        if end > begin
    ]
    return PairedStream(
        len(steps) / sum(steps),
        statistics.median(steps),
        statistics.median(against_read),
        statistics.median(bandwidths),
        (min(bandwidths), max(bandwidths)),
        read_per_window,
    )


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and its packed weights' planes, each once."""
    packed = {id(m): m for m in model.modules() if isinstance(m, PackedWeight)}.values()
    planes = [t for m in packed for t in (m.qweight, m.scales, m.mins) if t is not None]
    return [*model.parameters(), *planes]


def weight_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size() for t in weight_tensors(llm.engine.runner.model))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--skip-w64", action="store_true")
    parser.add_argument(
        "--llama-cpp-python", help="an interpreter with llama-cpp-python: adds llama.cpp's row"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model instead of the embedded one")
    parser.add_argument(
        "--checkpoint", choices=["fp8"], help="with --shape: also the model as a block-FP8 checkpoint"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the dtype of every engine whose row names none (auto: the machine's default; 16-bit x takes the "
        "quantized kernel's integer dots)",
    )
    args = parser.parse_args()
    if args.checkpoint and not args.shape:
        parser.error("--checkpoint needs --shape")
    if args.shape:
        w64 = (
            args.checkpoint is not None and not args.skip_w64
        )  # (the float formats' own W64: bench.throughput)
        shape_streams(args.shape, args.prompts, args.max_tokens, args.checkpoint, w64, args.dtype)
        return

    gguf = embedded_model_path()
    engines = {  # name: (LLM kwargs, runs W64)
        "default dtype": ({"quantization": "none"}, True),
        "bfloat16": ({"quantization": "none", "dtype": "bfloat16"}, True),
        "int8 (per channel)": ({"quantization": "int8"}, True),
        "int4 (group 32)": ({"quantization": "int4"}, True),
        "GGUF Q4_1 as shipped": ({"quantization": "auto"}, True),
    }
    w64 = make_workload(64, 49152, (32, 256), (32, 256), seed=0)
    prompts: list[list[int]] = []
    rows = []
    for name, (kwargs, batch) in engines.items():
        llm = LLM(str(gguf), max_model_len=1024, kv_cache_memory="1GiB", **{"dtype": args.dtype, **kwargs})
        if not prompts:
            ids = llm.tokenizer.encode(TEXT)
            prompts = [ids[i : i + 128] for i in range(0, args.prompts * 3, 3)]
            if any(len(p) != 128 for p in prompts):
                raise SystemExit(f"the text is {len(ids)} tokens: too short for 128-token prompts")
        one_stream(llm, prompts[:1], 16)  # warm-up
        stream = one_stream(llm, prompts, args.max_tokens)
        throughput = None
        if batch and not args.skip_w64:
            run_batch(llm, make_workload(8, 49152, (32, 64), (8, 16), seed=1))  # warm-up
            throughput = run_batch(llm, w64)[1]
        rows.append(
            (name, str(llm.engine.runner.dtype).removeprefix("torch."), weight_bytes(llm), stream, throughput)
        )
        llm.shutdown()
        del llm
    peer, peer_failure = None, "pass --llama-cpp-python PATH/TO/python with llama-cpp-python installed"
    if args.llama_cpp_python:
        try:
            peer = llama_cpp(args.llama_cpp_python, gguf, prompts, args.max_tokens, ignore_eos=True)
        except subprocess.CalledProcessError as exc:  # the engines' table is still worth printing
            peer_failure = f"the peer exited with {exc.returncode}: {exc.stderr.strip()[-300:]}"

    base_stream, base_batch = rows[0][3], rows[0][4]
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine_description()}")
    print(
        f"SmolLM2-135M-Instruct; one stream: {len(prompts)} prompts of 128 tokens, {args.max_tokens} new, "
        f"greedy; W64: 64 random requests, 32-256 in and out; {torch.get_num_threads()} threads\n"
    )
    print("| weights | activations | weight MB | one stream tok/s | vs default | W64 tok/s | vs default |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, dtype, size, stream, batch in rows:
        w64_cells = f"{batch:.1f} | {batch / base_batch:.2f}x" if batch and base_batch else "- | -"
        print(
            f"| {name} | {dtype} | {size / 1e6:.0f} | {stream:.1f} | {stream / base_stream:.2f}x | {w64_cells} |"
        )
    if peer is not None:
        rate = peer["decode_tokens"] / peer["decode_s"]
        print(
            f"| llama.cpp {peer['version']} (the GGUF as shipped) | - | - | {rate:.1f} | "
            f"{rate / base_stream:.2f}x | - | - |"
        )
    else:
        print(f"\nllama.cpp: not measured ({peer_failure})")


def shape_streams(
    shape: str, count: int, max_tokens: int, checkpoint: str | None, w64: bool, dtype: str = "auto"
) -> None:
    """One stream (and W64 if asked) of a random `shape` per weight format, each engine in `dtype`, and the
    bytes each token read at most."""
    model_dir = build_random_model(shape)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(128)] for _ in range(count)]
    state = 0
    if cfg.hybrid is not None:
        state = Qwen3_5ForCausalLM.state_layout(cfg, 1).bytes_per_slot(4)  # float32 here
    engines = {  # name: (checkpoint, LLM kwargs)
        "default dtype": (model_dir, {}),
        "int8 (per channel)": (model_dir, {"quantization": "int8"}),
        "int4 (group 32)": (model_dir, {"quantization": "int4"}),
    }
    if checkpoint == "fp8":
        fp8 = write_block_fp8(model_dir)
        del engines["int4 (group 32)"]
        engines["block-FP8 checkpoint, dequantized at load"] = (fp8, {})
        engines["block-FP8 checkpoint, repacked to int8"] = (fp8, {"quantization": "int8"})
    # W64 here: 64 requests at once, shorter than bench/throughput.py's (with a 0.6B model in float32, its 32-256
    # tokens in and out had not finished the first engine after 17 minutes on the shared 2-core AVX2 EPYC)
    batch = make_workload(64, cfg.vocab_size, (32, 64), (16, 32), seed=0) if w64 else None
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine_description()}")
    print(f"random {shape}, dtype {dtype}; one stream: {count} prompts of 128 tokens, {max_tokens} new, greedy; "
          f"{torch.get_num_threads()} threads; recurrent state per request {state / 2**20:.1f} MiB"
          + ("; W64: 64 random requests, 32-64 tokens in, 16-32 out" if w64 else "") + "\n")  # fmt: skip
    print(
        "| weights | weight GB | one stream tok/s | vs default | read bandwidth GB/s (range) | read per token at "
        "most | vs weights | each 16 steps vs weights (median, range) | a step vs reading its weights | W64 tok/s "
        "| vs default |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base_rate = base_w64 = 0.0
    for name, (path, kwargs) in engines.items():
        kv_cache_memory = "1GiB" if w64 else "256MiB"
        llm = LLM(str(path), max_model_len=1024, kv_cache_memory=kv_cache_memory, dtype=dtype, **kwargs)
        one_stream(llm, prompts[:1], 16)  # warm-up
        stream = paired_stream(llm, prompts, max_tokens)
        throughput = 0.0
        if batch is not None:
            run_batch(llm, make_workload(8, cfg.vocab_size, (32, 64), (8, 16), seed=1))  # warm-up
            throughput = run_batch(llm, batch)[1]
        rate = stream.tokens_per_s
        base_rate, base_w64 = base_rate or rate, base_w64 or throughput
        size, bound = weight_bytes(llm), stream.bandwidth * stream.step_s
        low, high = stream.bandwidth_range
        w64_cells = f"{throughput:.1f} | {throughput / base_w64:.2f}x" if throughput else "- | -"
        windows = [read / size for read in stream.read_per_window]
        print(f"| {name} | {size / 1e9:.3f} | {rate:.2f} | {rate / base_rate:.2f}x | {stream.bandwidth / 1e9:.1f} "
              f"({low / 1e9:.0f}-{high / 1e9:.0f}) | {bound / 1e9:.3f} GB | {bound / size:.2f}x | "
              f"{statistics.median(windows):.2f}x ({min(windows):.2f}-{max(windows):.2f}) | "
              f"{stream.against_read:.2f}x | {w64_cells} |")  # fmt: skip
        llm.shutdown()
        del llm


if __name__ == "__main__":
    main()
