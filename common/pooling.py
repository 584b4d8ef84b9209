"""Pooling requests: a prompt's last token read as a vector instead of continued (embeddings, rerank
scores), and the arithmetic both the offline API and the router apply to what the worker returns.

The worker returns raw float32 values: for "embed", the last prompt token's hidden state after the final
norm; for "score", the output head's logits of the given token ids at that position (only those rows of
the head are multiplied). Normalising, Matryoshka truncation and the reranker's sigmoid happen here, on the
caller's side, so a worker serves every `dimensions` from one computation.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from nanovllm.common.errors import ConfigError, RequestError

PoolingKind = Literal["embed", "score"]
POOLING_KINDS: tuple[PoolingKind, ...] = ("embed", "score")

# Qwen3-Embedding's published query format (its model card's get_detailed_instruct): documents are
# embedded as they are, queries with a task instruction before them.
EMBED_QUERY_FORMAT = "Instruct: {instruction}\nQuery:{query}"
EMBED_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Reranker's published judge prompt (its model card's prefix, format_instruction and suffix): the
# score is P("yes") against P("no") as the assistant's first token after an empty thinking block.
RERANK_FORMAT = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
RERANK_INSTRUCTION = EMBED_INSTRUCTION
RERANK_TOKENS = ("yes", "no")  # the tokens whose logits the score compares, the relevant one first


@dataclass(frozen=True)
class PoolingParams:
    """What a pooling request returns. "embed": the last prompt token's final hidden state
    (hidden_size floats). "score": the output head's logits of `token_ids` at the last prompt token, in
    their order (len(token_ids) floats)."""

    kind: PoolingKind = "embed"
    token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise RequestError(f"pooling kind must be one of {list(POOLING_KINDS)}, got {self.kind!r}")
        if self.kind == "score" and not self.token_ids:
            raise RequestError("a score request needs the token ids whose logits it compares; got none")
        if self.kind == "embed" and self.token_ids:
            raise RequestError(f"an embed request takes no token ids; got {list(self.token_ids)}")


def normalized(values: Sequence[float], dimensions: int | None = None) -> list[float]:
    """The first `dimensions` values (all with None: Matryoshka truncation), scaled to unit L2 norm."""
    if dimensions is not None:
        if not 1 <= dimensions <= len(values):
            raise RequestError(
                f"dimensions must be in [1, {len(values)}] (the model's size), got {dimensions}"
            )
        values = values[:dimensions]
    norm = math.sqrt(math.fsum(v * v for v in values))
    if norm == 0.0:
        return [0.0] * len(values)
    return [v / norm for v in values]


def relevance(logits: Sequence[float]) -> float:
    """A reranker's score from its two logits (relevant first): sigmoid(yes - no), the two-way softmax's
    probability of the first."""
    diff = logits[0] - logits[1]
    if diff >= 0:
        return 1.0 / (1.0 + math.exp(-diff))
    e = math.exp(diff)
    return e / (1.0 + e)


def check_format(flag: str, text: str, fields: tuple[str, ...]) -> None:
    """A prompt format (a str.format template) uses exactly `fields`, else ConfigError naming `flag`."""
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as exc:
        raise ConfigError(f"{flag} is not a valid format: {exc}") from None
    if used != set(fields):
        want = ", ".join("{" + f + "}" for f in fields)
        raise ConfigError(f"{flag} must use exactly {want}; it uses {sorted(used)}")
