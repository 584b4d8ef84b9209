"""A call's spans (common/tracing.py). A Generate call: the call, continuing the caller's traceparent, with a
child for its validation and tokenization, one per routing decision and one per attempt on a worker, whose
own request span is the attempt's child. The stream's numbers (time to first token, tokens, outcome) are
the call span's attributes: the call span is the stream. An Embed or Score call: one span, its outcome,
inputs and prompt tokens as attributes.

NO_SPANS stands in when tracing is off, so that the call's code is the same either way and costs a method
call that does nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from nanovllm.common.tracing import CARRIER_KEYS, carrier_of, context_from


class CallSpans:
    def __init__(
        self,
        tracer: Tracer,
        metadata: Sequence[tuple[str, str]],
        api: str,
        name: str = "nanovllm.router.generate",
    ) -> None:
        carrier = {key: value for key, value in metadata if key in CARRIER_KEYS}
        self._tracer = tracer
        self.call = tracer.start_span(
            name,
            context=context_from(carrier),
            kind=SpanKind.SERVER,
            attributes={"nanovllm.api": api},
        )
        self._context = trace.set_span_in_context(self.call)
        self._attempt: Span | None = None

    def child(self, name: str, **attributes: str | float | bool) -> Span:
        return self._tracer.start_span(name, context=self._context, attributes=attributes)

    def routed(self, worker: str, expected_hit_tokens: int, candidates: int, attempt: str) -> dict[str, str]:
        """A routing decision and the attempt it starts (`attempt`: first, retry or resume); the previous
        attempt ends. Returns the carrier the worker continues the trace from."""
        route: dict[str, str | float | bool] = {
            "nanovllm.worker": worker,
            "nanovllm.expected_hit_tokens": expected_hit_tokens,
            "nanovllm.candidates": candidates,
        }
        self.child("nanovllm.router.route", **route).end()
        self.end_attempt()
        self._attempt = self.child(
            "nanovllm.router.attempt", **{"nanovllm.worker": worker, "nanovllm.attempt": attempt}
        )
        return carrier_of(self._attempt)

    def moved(self, reason: str, resume: bool, tokens_so_far: int) -> None:
        """The current attempt failed (`reason`) and the request moves to another worker."""
        if self._attempt is not None:
            self._attempt.set_status(Status(StatusCode.ERROR, reason))
        self.call.add_event(
            "resume" if resume else "retry",
            {"nanovllm.reason": reason, "nanovllm.tokens_so_far": tokens_so_far},
        )

    def end_attempt(self) -> None:
        if self._attempt is not None:
            self._attempt.end()
            self._attempt = None

    def end(self, outcome: str, attributes: dict[str, str | int | float]) -> None:
        """End every span of the call; an outcome that is not a finish reason (or an answered Embed or Score
        call's `ok`) marks the call an error."""
        self.end_attempt()
        self.call.set_attributes({"nanovllm.outcome": outcome, **attributes})
        if outcome not in ("stop", "length", "tool_calls", "ok"):
            self.call.set_status(Status(StatusCode.ERROR, outcome))
        self.call.end()


class _NoSpans:
    """CallSpans' interface, doing nothing: tracing is off."""

    def child(self, name: str, **attributes: str | float | bool) -> Span:
        return trace.INVALID_SPAN

    def routed(self, worker: str, expected_hit_tokens: int, candidates: int, attempt: str) -> dict[str, str]:
        return {}

    def moved(self, reason: str, resume: bool, tokens_so_far: int) -> None:
        pass

    def end_attempt(self) -> None:
        pass

    def end(self, outcome: str, attributes: dict[str, str | int | float]) -> None:
        pass


NO_SPANS = _NoSpans()
AnySpans = CallSpans | _NoSpans  # what call_spans gives


def call_spans(
    tracer: Tracer | None, context: Any, api: str, name: str = "nanovllm.router.generate"
) -> AnySpans:
    """The spans of a call whose (gRPC or HTTP stand-in) context is `context`, its own span named `name`;
    NO_SPANS when tracing is off, without reading the call's metadata."""
    return NO_SPANS if tracer is None else CallSpans(tracer, context.invocation_metadata(), api, name)
