"""transformers on the same checkpoint: static batched `generate`, continuous batching, one stream."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from bench.workload import GREEDY, Sampling, Workload


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


def hf_static_batch(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, sampling: Sampling = GREEDY
) -> None:
    """One left-padded `generate` call that runs exactly `new_tokens` steps for every row."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **sampling.hf_generation()
    )
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def run_hf_static(
    model: torch.nn.Module, workload: Workload, batch_size: int, sampling: Sampling = GREEDY
) -> HFResult:
    """Static batching: each batch runs to its longest request; only requested tokens count."""
    dtype = str(model.dtype).removeprefix("torch.")
    hf_static_batch(model, workload.prompts[:2], 4, sampling)  # warm-up
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        end = start + batch_size
        hf_static_batch(model, workload.prompts[start:end], max(workload.output_lens[start:end]), sampling)
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
