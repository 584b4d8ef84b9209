"""Prompt logprobs (SamplingParams.prompt_logprobs, worker/sample/scoring.py): each prompt token's logprob
given the tokens before it is transformers' teacher-forced log-softmax on the same weights, whether the
prompt is computed in one step, in 7-token chunks, beside another request that cached its prefix, or on two
tensor-parallel ranks; the alternatives are transformers' most likely tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.sequence import TokenLogprobs
from tests.helpers import hf_model

# float32 against float32: the engine and transformers sum in other orders, a few float32 rounding steps
# on logits of magnitude ~10 (1e-6 each), through a log-softmax over the vocabulary; 1e-4 leaves a margin
# of ten over what a correct engine shows (measured 8e-6) and catches a position off by one (~1).
F32_TOLERANCE = 1e-4
TOP = 5


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (37, 64, 9)]


def _reference(model_dir: Path, prompt: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' log-softmax at each position but the last: row i scores prompt token i + 1."""
    with torch.inference_mode():
        logits = hf_model(model_dir, dtype)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def _scored(llm: LLM, prompts: list[list[int]]) -> list[list[TokenLogprobs | None]]:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o["num_cached_tokens"] == 0 for o in outs)  # a prompt to score is computed whole
    return [o["prompt_logprobs"] for o in outs]


def _assert_matches(
    scored: list[TokenLogprobs | None], prompt: list[int], reference: torch.Tensor, tolerance: float
) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    for i, entry in enumerate(scored[1:]):
        assert entry.token_id == prompt[i + 1]
        assert abs(entry.logprob - reference[i, prompt[i + 1]].item()) <= tolerance, i
        # The alternatives: transformers' top values, and each one's value is its own there (near-ties may
        # swap two tokens' places, never their values).
        assert len(entry.top) == TOP
        best = reference[i].topk(TOP).values.tolist()
        assert all(abs(v - b) <= tolerance for (_, v), b in zip(entry.top, best)), i
        assert all(abs(v - reference[i, t].item()) <= tolerance for t, v in entry.top), i
        # Its rank: the tokens above it in transformers' distribution, up to the tolerance.
        target = reference[i, prompt[i + 1]]
        above = int((reference[i] > target + tolerance).sum()), int((reference[i] > target - tolerance).sum())
        assert above[0] + 1 <= entry.rank <= above[1] + 1, (i, entry.rank, above)


def _engine(model_dir: Path, **settings: object) -> LLM:
    settings = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": "16MiB", **settings}
    return LLM(str(model_dir), **settings)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("how", ["whole", "chunks-of-7", "behind-a-cached-prefix", "speculating"])
def test_prompt_logprobs_are_transformers_teacher_forced_ones(model_dirs, arch, how) -> None:
    model_dir = model_dirs[arch]
    prompts = _prompts()
    settings = {"speculative_method": "ngram", "num_speculative_tokens": 3} if how == "speculating" else {}
    llm = _engine(model_dir, max_num_batched_tokens=7 if how == "chunks-of-7" else 8192, **settings)
    if how == "behind-a-cached-prefix":  # the device holds the first 32 tokens of the first two prompts
        llm.generate([p[:33] for p in prompts[:2]], SamplingParams(max_tokens=1), use_tqdm=False)
    for prompt, scored in zip(prompts, _scored(llm, prompts)):
        _assert_matches(scored, prompt, _reference(model_dir, prompt), F32_TOLERANCE)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


def test_on_two_ranks_the_split_vocabulary_scores_as_one(qwen3_dir) -> None:
    prompts = _prompts(1)
    llm = _engine(qwen3_dir, tensor_parallel_size=2, max_num_batched_tokens=16)
    for prompt, scored in zip(prompts, _scored(llm, prompts)):
        _assert_matches(scored, prompt, _reference(qwen3_dir, prompt), F32_TOLERANCE)
    llm.shutdown()


def test_smollm2_real_weights(smollm2_dir) -> None:
    """The embedded SmolLM2-135M's real weights, a sentence of real text."""
    llm = _engine(smollm2_dir, max_model_len=256, max_num_batched_tokens=16)
    prompt = llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    (scored,) = _scored(llm, [prompt])
    _assert_matches(scored, prompt, _reference(smollm2_dir, prompt), F32_TOLERANCE)
    llm.shutdown()


def test_bf16_on_the_torch_layers_is_transformers_to_the_rounding(qwen3_dir) -> None:
    """In bfloat16 on the PyTorch layers a prompt's logits are transformers' to the bit
    (tests/test_dtypes.py), up to the LM head's rows computed in another batch: the logprobs differ by
    at most two bf16 rounding steps of the largest logit, through the log-softmax."""
    prompt = _prompts(2)[1]
    llm = _engine(qwen3_dir, dtype="bfloat16", attention_backend="torch", device="cpu")
    (scored,) = _scored(llm, [prompt])
    with torch.inference_mode():
        logits = hf_model(qwen3_dir, torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    step = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7).item()  # bf16: 8 significant bits
    _assert_matches(scored, prompt, logits.log_softmax(dim=-1)[:-1], 2 * 2 * step)
    llm.shutdown()


def test_a_preempted_request_reports_each_prompt_token_once(qwen3_dir) -> None:
    """A KV cache of 8 blocks of 16 for prompts of 64 and 37 tokens growing by 40 each: one is preempted
    and recomputed, its prompt scored again; its logprobs are reported once, each the reference's."""
    cfg = ModelConfig.from_pretrained_dir(str(qwen3_dir))
    block_bytes = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    llm = _engine(qwen3_dir, kv_cache_memory=8 * block_bytes, kvcache_block_size=16)
    prompts = _prompts(3)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _assert_matches(out["prompt_logprobs"], prompt, _reference(qwen3_dir, prompt), F32_TOLERANCE)
    llm.shutdown()
