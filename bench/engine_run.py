"""nanovllm's side of the benchmarks: the engine as a bench builds it, warm-up, timed runs, per-step records."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.workload import GREEDY, Sampling, Workload, greedy, make_workload
from nanovllm import LLM
from nanovllm.worker.device import resolve_placement
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import resolve_model
from nanovllm.worker.step import StepResult


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


def build_llm(model_dir: Path, workload: Workload, args: argparse.Namespace, **options: object) -> LLM:
    """An engine whose KV cache holds the whole workload at once, so nothing is preempted; `options` are
    more EngineConfig fields. `model_dir` may be a .gguf file, served as it ships."""
    cfg = ModelConfig.from_pretrained_dir(Path(resolve_model(str(model_dir))[0]))
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    max_model_len = max(1024, longest + 1)
    block = 16  # EngineConfig.kvcache_block_size default
    blocks = sum(math.ceil((len(p) + n) / block) + 1 for p, n in zip(workload.prompts, workload.output_lens))
    element = resolve_placement(getattr(args, "device", "auto"), args.dtype).dtype.itemsize
    bytes_per_block = 2 * cfg.num_hidden_layers * block * cfg.num_key_value_heads * cfg.head_dim * element
    kv_bytes = max(2 * 2**30, int(blocks * bytes_per_block * 1.1))
    return LLM(
        str(model_dir),
        max_model_len=max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=kv_bytes,
        dtype=args.dtype,
        num_threads=args.threads,  # fixed: the run must not split its CPUs with whatever else runs here
        # Random prompts share no prefix; off, so that a workload run twice does the same work twice.
        enable_prefix_caching=False,
        **options,
    )


def warm_up_nanovllm(llm: LLM, vocab: int) -> None:
    """A few steps of prefill and decode so that first-call costs stay out of the measurement."""
    warm = make_workload(4, vocab, (16, 64), (8, 8), seed=12345)
    llm.generate(warm.prompts, [greedy(n) for n in warm.output_lens], use_tqdm=False)


def run_nanovllm(llm: LLM, workload: Workload, sampling: Sampling = GREEDY) -> NanoResult:
    params = [sampling.params(n) for n in workload.output_lens]
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
