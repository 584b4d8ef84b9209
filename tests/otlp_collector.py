"""An OTLP/gRPC trace collector in the calling process, for tests/test_tracing.py and bench/tracing.py: it
keeps every span it receives, with its service's name."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

WAIT_S = 60.0


@dataclass
class Span:
    service: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attributes(self) -> dict[str, object]:
        values = {}
        for kv in self.span.attributes:
            kind = kv.value.WhichOneof("value")
            values[kv.key] = getattr(kv.value, kind)
        return values

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._changed = threading.Condition()

    def Export(self, request, context):
        with self._changed:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource_spans.scope_spans:
                    self.spans.extend(Span(service, s) for s in scope.spans)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, what: Callable[[list[Span]], bool], message: str) -> list[Span]:
        with self._changed:
            if not self._changed.wait_for(lambda: what(self.spans), timeout=WAIT_S):
                raise AssertionError(
                    f"{message}; the collector has {[(s.service, s.name) for s in self.spans]}"
                )
            return list(self.spans)

    def trace(self, trace_id: str, worker_spans: int = 1) -> list[Span]:
        """The spans of one trace, once its router call and `worker_spans` worker spans are in."""

        def complete(spans: list[Span]) -> bool:
            mine = [s for s in spans if s.trace_id == trace_id]
            return any(s.name == "nanovllm.router.generate" for s in mine) and (
                sum(s.name == "nanovllm.worker.request" for s in mine) >= worker_spans
            )

        return [s for s in self.wait_for(complete, f"trace {trace_id} incomplete") if s.trace_id == trace_id]


@contextmanager
def running_collector() -> Iterator[tuple[Collector, str]]:
    """A collector served on a free local port, and the endpoint to give --otlp-traces-endpoint."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield service, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)
