"""The OpenTelemetry SDK's half of tracing: a TracerProvider whose spans leave through a batch processor
(its own thread: a request never waits on the collector) and the OTLP/gRPC exporter. Imported only when
tracing is on (common/tracing.py), so a process that does not trace never loads the SDK."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from nanovllm.common.logging import get_logger
from nanovllm.common.server_config import TracingConfig

log = get_logger(__name__)

EXPORT_TIMEOUT_S = 5.0  # per export: a collector that is down delays no more than this at shutdown


def exporting_provider(target: str, service_name: str, config: TracingConfig) -> TracerProvider:
    """A provider sampling new traces at the configured ratio and exporting them to `target`."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.trace_sample_ratio)),
    )
    timeout = float(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", EXPORT_TIMEOUT_S))
    exporter = OTLPSpanExporter(endpoint=target, insecure=not target.startswith("https://"), timeout=timeout)
    provider.add_span_processor(BatchSpanProcessor(_WarnOnce(exporter, target)))
    # The exporter logs each failed batch (and each retry); _WarnOnce says it once instead.
    logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
    log.info("tracing_on", endpoint=target, service=service_name, sample_ratio=config.trace_sample_ratio)
    return provider


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
