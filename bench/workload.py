"""The benchmark workload: random token prompts and exact output lengths, reproducible from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

from nanovllm import SamplingParams

# Token ids below this are often special (bos/eos/pad) in real vocabularies; keep prompts clear of them.
FIRST_PROMPT_TOKEN = 10


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


@dataclass(frozen=True)
class Sampling:
    """How every request of a workload picks its tokens: greedy at temperature 0."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def label(self) -> str:
        if self.temperature == 0.0:
            return "greedy"
        return f"temperature {self.temperature:g}" + (f", top_p {self.top_p:g}" if self.top_p < 1.0 else "")

    def params(self, max_tokens: int) -> SamplingParams:
        """Exactly `max_tokens` tokens: ignore_eos keeps the workload independent of the weights."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, max_tokens=max_tokens, ignore_eos=True
        )

    def hf_generation(self) -> dict[str, object]:
        """The same choice in transformers' GenerationConfig terms (its default top_k of 50 turned off)."""
        if self.temperature == 0.0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


GREEDY = Sampling()


def greedy(max_tokens: int) -> SamplingParams:
    """Exactly `max_tokens` greedy tokens."""
    return GREEDY.params(max_tokens)
