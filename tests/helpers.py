"""Shared test utilities: a teacher-forcing driver and the transformers reference."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.worker.llm import load_tokenizer
from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import ScheduledSequence, SchedulerOutput

# The chats the real-model tests ask (SmolLM2-135M-Instruct): short questions of different kinds.
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
    "Explain what a neural network is in one sentence.",
]


@lru_cache(maxsize=4)
def chat_prompts(model_dir: Path) -> list[list[int]]:
    """QUESTIONS as the model's chat template renders them, tokenized."""
    tokenizer = load_tokenizer(model_dir)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return [tokenizer.encode(t) for t in texts]


@lru_cache(maxsize=16)
def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model for `model_dir` in `dtype` (the weights cast as transformers casts them)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(model_dir)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,  # like ignore_eos: run to max_new_tokens without banning EOS
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def teacher_forced_logits(
    llm: LLM, batch: list[list[int]], chunk: int, lora_names: list[str | None] | None = None
) -> list[torch.Tensor]:
    """Feed each sequence through the engine's own runner `chunk` tokens per step, all sequences in the
    same step, and collect the logits of every position. chunk=1 exercises the decode path. `lora_names`:
    each sequence's LoRA adapter (None: the base model)."""
    engine = llm.engine
    seqs = [Sequence(-1 - i, f"tf{i}", list(ids), greedy(1)) for i, ids in enumerate(batch)]
    for seq, name in zip(seqs, lora_names or []):
        seq.adapter = engine.adapters[name] if name is not None else None
    rows: list[list[torch.Tensor]] = [[] for _ in batch]
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):
        items = []
        for seq in seqs:
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            if n == 0:
                continue
            if not engine.block_manager.allocate_slots(seq, n):
                raise RuntimeError("test KV cache too small")
            items.append(ScheduledSequence(seq, seq.num_computed_tokens, n))
        items.sort(key=lambda s: s.num_new_tokens != 1)
        sched = SchedulerOutput(items, num_decodes=sum(s.num_new_tokens == 1 for s in items))
        with torch.inference_mode():  # every scheduled token's logits (teacher forcing)
            logits = engine.runner.forward(engine.runner.step_inputs(sched, all_logits=True))
        offset = 0
        for item in sched.scheduled:
            index = seqs.index(item.seq)
            rows[index].append(logits[offset : offset + item.num_new_tokens])
            offset += item.num_new_tokens
            item.seq.num_computed_tokens += item.num_new_tokens
    for seq in seqs:
        engine.block_manager.free(seq)
    return [torch.cat(r) for r in rows]


def cuts(text: str, count: int) -> list[list[str]]:
    """Every way to cut text into count + 1 pieces at distinct positions (empty pieces included)."""
    return [
        [text[a:b] for a, b in zip((0, *points), (*points, len(text)))]
        for points in itertools.combinations_with_replacement(range(len(text) + 1), count)
    ]


def top5_rule(name: str, ours: list[dict], theirs: list[dict]) -> float:
    """vLLM's rule for 16-bit (or quantized) outputs against a reference run of the same prompts, both
    greedy with logprobs=5: each prompt's two token sequences are walked side by side, and at the first
    position where they part (same context up to there) each token must be in the other's top-5; the walk
    of that prompt stops there. Returns the largest |logprob difference| of a token in both top-5s, up to
    and at the parting, for the caller to hold to its dtype's bound."""
    worst = 0.0
    for index, (a, b) in enumerate(zip(ours, theirs)):
        for pos, (ta, tb, la, lb) in enumerate(
            zip(a["token_ids"], b["token_ids"], a["logprobs"], b["logprobs"])
        ):
            top_a, top_b = dict(la.top), dict(lb.top)
            worst = max([worst, *(abs(top_a[t] - top_b[t]) for t in top_a.keys() & top_b.keys())])
            if ta != tb:
                assert ta in top_b and tb in top_a, (
                    f"{name} prompt {index} position {pos}: {ta} (top-5 {la.top}) against {tb} (top-5 {lb.top})"
                )
                break
    return worst


@contextmanager
def counting_proposals(llm: LLM) -> Iterator[list[int]]:
    """[proposed, accepted]: the speculative tokens of the steps `llm` runs inside the block."""
    counts = [0, 0]
    step = llm.engine.step

    def counting_step():
        result = step()
        counts[0] += result.stats.num_spec_proposed
        counts[1] += result.stats.num_spec_accepted
        return result

    llm.engine.step = counting_step
    try:
        yield counts
    finally:
        llm.engine.step = step


def decode_layers_on_and_off(
    model_dir: Path, batch: list[list[int]], params: SamplingParams, **llm_kwargs: object
) -> list[list[tuple[list[int], list[dict]]]]:
    """Tokens and top logprobs of batch[0] alone, then of the whole batch, from an engine whose decode
    steps run the layers as one C++ call (worker/models/decode_layers.py) and from one that runs them
    module by module: [on, off]. Every KV block comes back in both."""
    runs = []
    for fused in (True, False):
        llm = LLM(str(model_dir), **llm_kwargs)
        model = llm.engine.runner.model.model
        assert model.decode_layers is not None
        if not fused:
            model.decode_layers = None
        outs = [
            llm.generate([batch[0]], params, use_tqdm=False)[0],
            *llm.generate(batch, params, use_tqdm=False),
        ]
        runs.append([(out["token_ids"], [dict(lp.top) for lp in out["logprobs"]]) for out in outs])
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return runs
