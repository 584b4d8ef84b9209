"""OpenTelemetry traces: one trace per request, across the router and the worker (docs/operations.md#traces).

Off unless an OTLP endpoint is configured (TracingConfig): then the process gets a TracerProvider whose
spans leave through a batch processor (its own thread: a request never waits on the collector) and the
OTLP/gRPC exporter. New traces are sampled at --trace-sample-ratio; a caller's W3C traceparent decides for
its own trace. The router hands the context to the worker inside Submit as the W3C carrier (`traceparent`,
`tracestate`): one stream per router connection carries many requests, so its headers cannot.

The standard variables apply: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT when no flag
names an endpoint, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES for the resource, and the exporter's own
OTEL_EXPORTER_OTLP_* settings (headers, certificates, timeout).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from nanovllm.common.logging import get_logger
from nanovllm.common.server_config import TracingConfig

log = get_logger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
CARRIER_KEYS = ("traceparent", "tracestate")  # the W3C headers, as gRPC metadata and HTTP headers name them
EXPORT_TIMEOUT_S = 5.0  # per export: a collector that is down delays no more than this at shutdown


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
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}),
        sampler=ParentBased(TraceIdRatioBased(config.trace_sample_ratio)),
    )
    # Imported here, with tracing on: a tenth of a second of every router's and worker's start otherwise.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    timeout = float(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", EXPORT_TIMEOUT_S))
    exporter = OTLPSpanExporter(endpoint=target, insecure=not target.startswith("https://"), timeout=timeout)
    provider.add_span_processor(BatchSpanProcessor(_WarnOnce(exporter, target)))
    # The exporter logs each failed batch (and each retry); _WarnOnce says it once instead.
    logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
    log.info("tracing_on", endpoint=target, service=name, sample_ratio=config.trace_sample_ratio)
    return Tracing(provider.get_tracer("nanovllm"), provider)


class _WarnOnce(SpanExporter):
    """The OTLP exporter, its failures told once: an unreachable collector must not flood the logs of a
    service that serves on regardless. A later success is logged, so that the next failure is told too."""

    def __init__(self, exporter: SpanExporter, target: str) -> None:
        self._exporter, self._target = exporter, target
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._exporter.export(spans)
        failed = result is not SpanExportResult.SUCCESS
        if failed and not self._failing:
            log.warning(
                "tracing_export_failed",
                endpoint=self._target,
                spans_dropped=len(spans),
                hint="is the OTLP collector reachable? spans are dropped until it is; serving goes on",
            )
        elif not failed and self._failing:
            log.info("tracing_export_recovered", endpoint=self._target)
        self._failing = failed
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._exporter.force_flush(timeout_millis)


def context_from(carrier: Mapping[str, str]) -> Context:
    """The trace context in a W3C carrier (gRPC metadata, HTTP headers or Submit.trace_context); an empty
    context when it holds none, so that a span started in it begins a trace."""
    return _PROPAGATOR.extract({k: v for k, v in carrier.items() if k in CARRIER_KEYS})


def carrier_of(span: Span) -> dict[str, str]:
    """The W3C carrier of `span`'s context, for a span in another process to continue."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier
