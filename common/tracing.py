"""OpenTelemetry traces: one trace per request, across the router and the worker (docs/operations.md#traces).

Off unless an OTLP endpoint is configured (TracingConfig): then the process gets a TracerProvider that
exports its spans (common/trace_export.py, the SDK's half, imported only then). New traces are sampled
at --trace-sample-ratio; a caller's W3C traceparent decides for its own trace. The router hands the context to the worker inside Submit as the W3C carrier (`traceparent`,
`tracestate`): one stream per router connection carries many requests, so its headers cannot.

The standard variables apply: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT when no flag
names an endpoint, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES for the resource, and the exporter's own
OTEL_EXPORTER_OTLP_* settings (headers, certificates, timeout).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from nanovllm.common.server_config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

_PROPAGATOR = TraceContextTextMapPropagator()
CARRIER_KEYS = ("traceparent", "tracestate")  # the W3C headers, as gRPC metadata and HTTP headers name them


@dataclass
class Tracing:
    """The process's tracer and what stops it (flushing the spans not yet sent)."""

    tracer: Tracer
    provider: TracerProvider

    def shutdown(self) -> None:
        self.provider.shutdown()


def endpoint(config: TracingConfig) -> str | None:
    return (
        config.otlp_traces_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def start_tracing(config: TracingConfig, service_name: str) -> Tracing | None:
    """A tracer exporting to the configured collector, or None when tracing is off (no endpoint)."""
    target = endpoint(config)
    if not target:
        return None
    # The SDK and the exporter only with tracing on: they cost every router's and worker's start 0.15 s.
    from nanovllm.common.trace_export import exporting_provider

    provider = exporting_provider(target, os.environ.get("OTEL_SERVICE_NAME") or service_name, config)
    return Tracing(provider.get_tracer("nanovllm"), provider)


def context_from(carrier: Mapping[str, str]) -> Context:
    """The trace context in a W3C carrier (gRPC metadata, HTTP headers or Submit.trace_context); an empty
    context when it holds none, so that a span started in it begins a trace."""
    return _PROPAGATOR.extract({k: v for k, v in carrier.items() if k in CARRIER_KEYS})


def carrier_of(span: Span) -> dict[str, str]:
    """The W3C carrier of `span`'s context, for a span in another process to continue."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier
