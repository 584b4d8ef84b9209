"""Worker updates turned into public responses: text deltas, token ids, logprobs, finish and usage."""

from __future__ import annotations

from nanovllm.router.reasoning import ReasoningSplit
from nanovllm.router.text_stream import TextStream
from nanovllm.v1 import generate_pb2
from nanovllm.worker.v1 import worker_pb2

_FINISH_REASONS = {
    worker_pb2.FINISH_REASON_STOP: generate_pb2.FINISH_REASON_STOP,
    worker_pb2.FINISH_REASON_LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    worker_pb2.FINISH_REASON_ABORT: generate_pb2.FINISH_REASON_CANCELLED,
}


def finish_name(reason: int) -> str:
    """ "stop", "length", "cancelled" or "error": the outcome a finished call is counted and logged under."""
    return generate_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def build_response(
    update: worker_pb2.RequestUpdate,
    stream: TextStream,
    split: ReasoningSplit | None,
    request_id: str,
    with_token_ids: bool,
    num_tokens: int,
    cached_tokens: int,
) -> generate_pb2.GenerateResponse | None:
    """The response for one worker update of a request that has produced `num_tokens` so far (this
    update's included) and found `cached_tokens` of its prompt in the prefix cache, or None when it carries nothing to send yet. A response with finish_reason set
    is the call's last: the worker finished the request, or a stop string matched in the text."""
    text = stream.push(update.new_token_ids)
    finish = _FINISH_REASONS.get(update.finish_reason)
    if finish is not None and not stream.stopped:
        text += stream.finish()
    if stream.stopped:
        finish = generate_pb2.FINISH_REASON_STOP  # a stop string (the worker may still run it)
    reasoning, text = _split(split, text, last=finish is not None)
    response = generate_pb2.GenerateResponse(request_id=request_id, text=text, reasoning_text=reasoning)
    if with_token_ids:
        response.token_ids.extend(update.new_token_ids)
    for lp in update.logprobs:
        entry = response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
        for token_id, value in zip(lp.top_token_ids, lp.top_logprobs):
            entry.top.add(token_id=token_id, logprob=value)
    if finish is not None:
        response.finish_reason = finish
        response.usage.prompt_tokens = update.num_prompt_tokens
        response.usage.completion_tokens = num_tokens
        response.usage.cached_prompt_tokens = cached_tokens
        return response
    return response if text or reasoning or response.token_ids or response.logprobs else None


def _split(split: ReasoningSplit | None, text: str, last: bool) -> tuple[str, str]:
    """(reasoning, answer) of released text; everything held back too when the stream ends."""
    if split is None:
        return "", text
    reasoning, answer = split.push(text)
    if last:
        more_reasoning, more_answer = split.finish()
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
    return reasoning, answer


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


def error_response(
    request_id: str, stream: TextStream, split: ReasoningSplit | None, message: str
) -> generate_pb2.GenerateResponse:
    """The last response of a stream whose request failed after producing tokens: the text held back so
    far, and the error."""
    reasoning, text = _split(split, stream.finish(), last=True)
    return generate_pb2.GenerateResponse(
        request_id=request_id,
        text=text,
        reasoning_text=reasoning,
        finish_reason=generate_pb2.FINISH_REASON_ERROR,
        error=message,
    )
