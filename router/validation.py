"""Public requests (nanovllm.v1) checked and turned into engine terms: prompt token ids and
SamplingParams. Every failure is a ValueError whose message names the field and the numbers, or a
NoTokenizerError for what needs a tokenizer the model does not have."""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.router.tokenizer import ModelTokenizer
from nanovllm.v1 import generate_pb2
from nanovllm.worker.v1 import worker_pb2

MAX_STOP_STRINGS = 16


class NoTokenizerError(Exception):
    """The request needs the model's tokenizer (a text or chat prompt, stop strings) and it has none."""


@dataclass(frozen=True)
class ValidRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: list[str]


def prompt_token_ids(
    request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
    tokenizer: ModelTokenizer | None,
    model: str,
) -> list[int]:
    """The prompt's token ids; `tokenizer` is None for a model without one (`model` names it)."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind is None:
        raise ValueError("prompt is not set: give one of text, chat or token_ids")
    if tokenizer is None:
        raise NoTokenizerError(f"model {model} has no tokenizer: send prompt token ids")
    if kind == "text":
        return tokenizer.encode(request.text)
    if not request.chat.messages:
        raise ValueError("chat.messages is empty; a chat needs at least one message")
    return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in request.chat.messages])


def validate_generate(
    request: generate_pb2.GenerateRequest, tokenizer: ModelTokenizer | None, info: worker_pb2.WorkerInfo
) -> ValidRequest:
    ids = prompt_token_ids(request, tokenizer, info.model)
    n, limit = len(ids), info.max_model_len
    if n == 0:
        raise ValueError("the prompt has no tokens; it needs at least one")
    if n >= limit:
        raise ValueError(
            f"the prompt has {n} tokens but max_model_len is {limit}: at most {limit - 1} leave room to generate"
        )
    bad = next((t for t in ids if t >= info.vocab_size), None)
    if bad is not None:
        raise ValueError(f"token_ids holds {bad}, outside the vocabulary [0, {info.vocab_size})")
    s = request.sampling
    bad = next((t for t in s.stop_token_ids if t >= info.vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"sampling.stop_token_ids holds {bad}, outside the vocabulary [0, {info.vocab_size})"
        )
    stop = list(s.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"sampling.stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    empty = next((i for i, text in enumerate(stop) if not text), None)
    if empty is not None:
        raise ValueError(f"sampling.stop[{empty}] is empty; stop strings need at least one character")
    if stop and tokenizer is None:
        raise NoTokenizerError(
            f"model {info.model} has no tokenizer: sampling.stop needs one; use stop_token_ids"
        )
    params = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None,
        # Unset: as many as the context leaves, ending at EOS or max_model_len.
        max_tokens=s.max_tokens if s.HasField("max_tokens") else limit - n,
        min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )
    return ValidRequest(ids, params, stop)
