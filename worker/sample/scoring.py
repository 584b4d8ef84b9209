"""Scoring given tokens instead of picking new ones: the logprob of each prompt token under the model's raw
distribution given the tokens before it, and the most likely alternatives (SamplingParams.prompt_logprobs,
what an evaluation harness reads)."""

from __future__ import annotations

import torch

from nanovllm.worker.sequence import TokenLogprobs
from nanovllm.worker.step import PromptScoring

# Logits of at most this many elements are held at once (128 MiB in float32): a step scoring thousands of
# prompt tokens over a vocabulary of 150k would otherwise take gigabytes.
SLICE_ELEMENTS = 2**25


def slice_rows(vocab_size: int) -> int:
    """How many rows of logits one slice holds."""
    return max(1, SLICE_ELEMENTS // vocab_size)


class PromptScorer:
    """Takes a step's prompt-scoring logits slice by slice, in the order of `scoring`'s rows, and gives
    each sequence's logprobs."""

    def __init__(self, scoring: list[PromptScoring]) -> None:
        self.scoring = scoring
        self.targets = [t for s in scoring for t in s.targets]
        self.num_top = max(s.num_top for s in scoring)
        self._parts: list[torch.Tensor] = []
        self._done = 0

    def add(self, logits: torch.Tensor) -> None:
        """The next rows' logits (float32, the whole vocabulary)."""
        logp = logits.log_softmax(dim=-1)
        targets = torch.tensor(self.targets[self._done : self._done + len(logits)], device=logits.device)
        chosen = logp.gather(1, targets.unsqueeze(1))
        rank = (logp > chosen).sum(dim=1, keepdim=True) + 1
        values, ids = logp.topk(min(self.num_top, logp.shape[1]), dim=-1)
        # float64 holds token ids and ranks exactly: one tensor, one wait for the device at the end.
        parts = [chosen.double(), rank.double(), values.double(), ids.double()]
        self._parts.append(torch.cat(parts, dim=1))
        self._done += len(logits)

    def result(self) -> dict[int, list[TokenLogprobs]]:
        """By seq_id: the logprobs of the tokens its rows scored."""
        rows = torch.cat(self._parts).tolist() if self._parts else []
        top = self.num_top
        out: dict[int, list[TokenLogprobs]] = {}
        done = 0
        for s in self.scoring:
            entries = []
            for target, row in zip(s.targets, rows[done : done + len(s.targets)]):
                alternatives = zip(row[2 + top : 2 + top + s.num_top], row[2 : 2 + s.num_top])
                entries.append(
                    TokenLogprobs(target, row[0], [(int(t), v) for t, v in alternatives], int(row[1]))
                )
            out[s.seq_id] = entries
            done += len(s.targets)
        return out
