"""A request's span on the worker (common/tracing.py): the child of the router's attempt span, from the
Submit's arrival to the request's end, written once when it ends from its RequestTimeline (queue time,
prefill chunks, decode steps, preemptions), not a span per token or per step."""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from nanovllm.common.tracing import context_from
from nanovllm.worker.step import RequestOutput


def record_request_span(
    tracer: Tracer,
    carrier: dict[str, str],
    client_id: str,
    resumed_tokens: int,
    out: RequestOutput,
) -> None:
    """Record the finished request `out` as a span continuing the router's `carrier`."""
    timeline = out.timeline
    if timeline is None:  # refused before it was scheduled: no timeline, the span is the refusal
        start = end = time.time_ns()
        attributes: dict[str, str | int | float] = {}
    else:
        start, end = timeline.arrival_ns, time.time_ns()
        queued_ns = (timeline.scheduled_ns or end) - timeline.arrival_ns
        attributes = {
            "nanovllm.queue_s": round(queued_ns / 1e9, 6),
            "nanovllm.prefill_chunks": timeline.prefill_chunks,
            "nanovllm.decode_steps": timeline.decode_steps,
            "nanovllm.preemptions": timeline.preemptions,
        }
    span = tracer.start_span(
        "nanovllm.worker.request",
        context=context_from(carrier),
        kind=SpanKind.SERVER,
        start_time=start,
        attributes={
            "nanovllm.request_id": client_id,
            "nanovllm.prompt_tokens": out.num_prompt_tokens,
            "nanovllm.cached_tokens": out.num_cached_tokens,
            "nanovllm.completion_tokens": out.num_output_tokens,
            "nanovllm.resumed_tokens": resumed_tokens,
            "nanovllm.finish_reason": out.finish_reason.value if out.finish_reason else "error",
            **attributes,
        },
    )
    if timeline is not None and timeline.scheduled_ns:
        span.add_event("scheduled", timestamp=timeline.scheduled_ns)
    if timeline is not None and timeline.first_token_ns:
        span.add_event("first_token", timestamp=timeline.first_token_ns)
    if out.error is not None:
        span.set_status(Status(StatusCode.ERROR, out.error))
    span.end(end_time=end)
