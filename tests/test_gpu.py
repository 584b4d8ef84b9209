"""What only a GPU can show: decode steps captured as CUDA graphs and replayed, and a sampler step that waits
on the device once. `make test-gpu` runs these with the rest of the suite that runs on CUDA (docs/devices.md);
on a CPU they skip."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.worker.sample.sampler import Sampler
from nanovllm.worker.step import SamplingRow

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: CUDA graphs and device syncs do not exist on a CPU",
)


def _generate(model_dir, prompts, params, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        str(model_dir), dtype="float32", max_num_seqs=8, max_model_len=256, kv_cache_memory="64MiB",
        enable_prefix_caching=False, **kwargs,
    )  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return llm, [o["token_ids"] for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_cuda_graphs_greedy_equals_eager(model_dirs, arch):
    """Graphs are on by default on CUDA; five sequences ending one after another pass through buckets 8, 4,
    2 and 1, and every greedy token equals the eager engine's, in float32."""
    prompts = [[5, 6, 7], list(range(40, 75)), [9] * 17, list(range(100, 130)), [11, 12]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 7, 12)]
    graphs, replayed = _generate(model_dirs[arch], prompts, params)
    assert graphs.engine.runner.decode_graphs is not None
    assert graphs.engine.runner.decode_graphs.buckets == [1, 2, 4, 8]
    eager, expected = _generate(model_dirs[arch], prompts, params, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    assert replayed == expected


def test_sampler_waits_on_the_device_once():
    """Greedy, top-k/top-p/min-p, penalties, banned ids, seeded rows and logprobs in one batch of 256: the
    sampler queues its work and the copy of its results without one synchronising call (torch's sync
    debug mode raises on any), so the next step can be launched behind it; the step then waits once, on
    its results."""
    vocab = 4096
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.8, seed=42, logprobs=5),
    ]
    rows = [
        SamplingRow(kinds[i % 4], [1, 2, 3], list(range(i % 7)), banned_token_ids=(0,) if i % 3 else ())
        for i in range(256)
    ]
    logits = torch.randn(256, vocab, device="cuda")
    sampler = Sampler(torch.Generator("cuda").manual_seed(0))
    sampler(logits, rows)  # warm-up: kernels loaded, pinned host buffers cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampled = sampler.sample(logits, sampler.plan(rows))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = sampled.result()
    assert len(out.token_ids) == 256 and out.logprobs[3] is not None and len(out.logprobs[3].top) == 5
    assert sampled.token_ids.device.type == "cuda"  # what the next step's inputs take on the device
    assert out.token_ids == sampled.token_ids.tolist()
