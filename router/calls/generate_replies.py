"""Worker updates turned into the public Generate call's GenerateResponse messages: text, reasoning and
tool-call deltas, token ids, logprobs, finish and usage. (OpenAI's Responses API is
router/faces/responses.py.)"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from nanovllm.common.v1 import worker_pb2
from nanovllm.router.calls.completion import CompletionText
from nanovllm.v1 import generate_pb2

_FINISH_REASONS = {
    worker_pb2.FINISH_REASON_STOP: generate_pb2.FINISH_REASON_STOP,
    worker_pb2.FINISH_REASON_LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    worker_pb2.FINISH_REASON_ABORT: generate_pb2.FINISH_REASON_CANCELLED,
}


def finish_name(reason: int) -> str:
    """ "stop", "length", "cancelled", "error" or "tool_calls": the outcome a finished call is counted and logged
    under."""
    return generate_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def build_response(
    update: worker_pb2.RequestUpdate,
    completion: CompletionText,
    request_id: str,
    with_token_ids: bool,
    num_tokens: int,
    cached_tokens: int,
) -> generate_pb2.GenerateResponse | None:
    """The response for one worker update of a request that has produced `num_tokens` so far (this
    update's included) and found `cached_tokens` of its prompt in the prefix cache, or None when it
    carries nothing to send yet. A response with finish_reason set is the call's last: the worker finished
    the request, or a stop string matched in the text."""
    finish = _FINISH_REASONS.get(update.finish_reason)
    delta = completion.push(update.new_token_ids, last=finish is not None)
    if completion.stopped:
        finish = generate_pb2.FINISH_REASON_STOP  # a stop string (the worker may still run it)
    if finish == generate_pb2.FINISH_REASON_STOP and completion.called_tools:
        finish = generate_pb2.FINISH_REASON_TOOL_CALLS
    response = generate_pb2.GenerateResponse(
        request_id=request_id, text=delta.text, reasoning_text=delta.reasoning, tool_calls=delta.tool_calls
    )
    if with_token_ids:
        response.token_ids.extend(update.new_token_ids)
    _add_logprobs(response.logprobs, update.logprobs)
    if finish is not None:
        response.finish_reason = finish
        response.usage.prompt_tokens = update.num_prompt_tokens
        response.usage.completion_tokens = num_tokens
        response.usage.cached_prompt_tokens = cached_tokens
        return response
    return response if delta or response.token_ids or response.logprobs else None


def add_prompt_logprobs(
    response: generate_pb2.GenerateResponse, update: worker_pb2.RequestUpdate, prompt_token_ids: list[int]
) -> None:
    """The prompt's tokens and their logprobs (SamplingParams.prompt_logprobs), on the call's first
    response."""
    response.prompt_token_ids.extend(prompt_token_ids)
    _add_logprobs(response.prompt_logprobs, update.prompt_logprobs)


def _add_logprobs(
    field: RepeatedCompositeFieldContainer[generate_pb2.TokenLogprob],
    entries: Iterable[worker_pb2.TokenLogprobs],
) -> None:
    """Worker TokenLogprobs into public TokenLogprob entries of `field`."""
    for lp in entries:
        entry = field.add(token_id=lp.token_id, logprob=lp.logprob)
        for token_id, value in zip(lp.top_token_ids, lp.top_logprobs):
            entry.top.add(token_id=token_id, logprob=value)
        if lp.HasField("rank"):
            entry.rank = lp.rank


def merge_responses(
    first: generate_pb2.GenerateResponse | None, later: generate_pb2.GenerateResponse | None
) -> generate_pb2.GenerateResponse | None:
    """One response saying what `first` and then `later` say: text, token ids and logprobs joined; finish
    and usage are the later one's."""
    if first is None or later is None:
        return later if first is None else first
    text, reasoning = first.text + later.text, first.reasoning_text + later.reasoning_text
    first.MergeFrom(later)  # appends repeated fields; set scalars and usage are taken from `later`
    first.text, first.reasoning_text = text, reasoning
    return first


def failed_response(
    request_id: str, completion: CompletionText, message: str
) -> generate_pb2.GenerateResponse:
    """The last response of a stream whose request failed after producing tokens: the text held back so
    far, and the error."""
    delta = completion.finish()
    return generate_pb2.GenerateResponse(
        request_id=request_id,
        text=delta.text,
        reasoning_text=delta.reasoning,
        finish_reason=generate_pb2.FINISH_REASON_ERROR,
        error=message,
    )
