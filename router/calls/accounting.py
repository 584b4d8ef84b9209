"""A call's accounting: the metrics it moves, its outcome and its final log line (and span). A Generate call's
is RequestTrace, an Embed or Score call's PoolingTrace."""

from __future__ import annotations

import time

from prometheus_client import Gauge

from nanovllm.common.logging import get_logger
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.calls.limits import Lease
from nanovllm.router.calls.metrics import RouterMetrics
from nanovllm.router.calls.spans import AnySpans
from nanovllm.v1 import generate_pb2

log = get_logger(__name__)


class RequestTrace:
    """Created once a call passed validation; `close` must run however the call ends (it counts once)."""

    def __init__(
        self,
        metrics: RouterMetrics,
        request_id: str,
        prompt_tokens: int,
        lease: Lease,
        api: str,
        content: str | None = None,
    ) -> None:
        """`lease` is charged every token; `api` is the face the call came through (grpc, http); `content` (the prompt, only with --log-request-content) goes
        into the final log line."""
        self.metrics = metrics
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.lease = lease
        self.api = api
        self.content = content
        self.start = self._last_token_at = time.perf_counter()
        self.first_token_s: float | None = None
        self._first_tokens = 0  # tokens in the first response (more than one when updates merged)
        self.queue_s = self.prefill_s = 0.0  # the workers' (WorkerTimings), summed over attempts
        self.num_tokens = 0
        self.cached_tokens = 0
        self.expected_hit_tokens = 0
        self.outcome = "client_cancelled"  # unless the call ends otherwise
        self.worker = ""
        self.attempts = 0
        self.resumes = 0  # times the stream moved to another worker after its first token
        self._in_flight: Gauge | None = None
        self._closed = False

    def on_worker(self, address: str, expected_hit_tokens: int) -> None:
        """The request went to (another) worker, where routing expected that many cached prompt tokens."""
        self.expected_hit_tokens = expected_hit_tokens
        if self._in_flight is not None:
            self._in_flight.dec()
        self.worker, self.attempts = address, self.attempts + 1
        self._in_flight = self.metrics.requests_in_flight.labels(worker=address)
        self._in_flight.inc()

    def on_tokens(self, count: int, cached_tokens: int) -> None:
        """`cached_tokens` counts while no token has come: a resumed stream keeps its first worker's."""
        if self.first_token_s is None:
            self.cached_tokens = cached_tokens
        if not count:
            return
        self.lease.charge(count)
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s, self._first_tokens = now - self.start, count
            self.metrics.expected_hit_tokens.inc(self.expected_hit_tokens)
            self.metrics.cached_prompt_tokens.inc(cached_tokens)
            self.metrics.prompt_tokens.inc(self.prompt_tokens)
            self.metrics.time_to_first_token.observe(self.first_token_s)
        else:
            gap = (now - self._last_token_at) / count
            for _ in range(count):
                self.metrics.inter_token_latency.observe(gap)
        self._last_token_at = now
        self.num_tokens += count

    def on_worker_timings(self, timings: worker_pb2.WorkerTimings) -> None:
        """A worker finished the request and said how long it queued and prefilled there."""
        self.queue_s += timings.queue_s
        self.prefill_s += timings.prefill_s

    def timings(self) -> generate_pb2.Timings:
        """The call's Timings (generate.proto), for its last response."""
        out = generate_pb2.Timings(queue_s=self.queue_s, prefill_s=self.prefill_s)
        if self.first_token_s is not None:
            out.time_to_first_token_s = self.first_token_s
            out.decode_s = self._last_token_at - self.start - self.first_token_s
            decoded = self.num_tokens - self._first_tokens
            if decoded and out.decode_s > 0:
                out.decode_tokens_per_s = decoded / out.decode_s
        return out

    def on_finish(self, outcome: str) -> None:
        """The call completed with a finish reason (stop, length, cancelled, error, tool_calls)."""
        self.outcome = outcome
        self.metrics.e2e_request_latency.observe(time.perf_counter() - self.start)

    def close(self) -> None:
        """Count the outcome and log the call; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight is not None:
            self._in_flight.dec()
        self.metrics.requests.labels(status=self.outcome, api=self.api).inc()
        content = {} if self.content is None else {"prompt": self.content}
        log.info(
            "request_finished",
            client=self.lease.name,
            outcome=self.outcome,
            **self.summary(),
            total_s=round(time.perf_counter() - self.start, 4),
            **content,
        )

    def span_ending(self) -> tuple[str, dict[str, str | int | float]]:
        """The call span's outcome and attributes: the summary, less the api its span started with."""
        summary = self.summary()
        summary.pop("api")
        return self.outcome, {f"nanovllm.{key}": value for key, value in summary.items() if value is not None}

    def summary(self) -> dict[str, str | int | float | None]:
        """What the call did, for its log line and its span."""
        return {
            "request_id": self.request_id[:64],
            "api": self.api,
            "worker": self.worker,
            "attempts": self.attempts,
            "resumes": self.resumes,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.num_tokens,
            "cached_tokens": self.cached_tokens,
            "expected_hit_tokens": self.expected_hit_tokens,
            "ttft_s": None if self.first_token_s is None else round(self.first_token_s, 4),
        }


class PoolingTrace:
    """One Embed or Score call, admitted: `finish` counts it once, logs its `pooling_finished` line and ends
    its span, however the call ended."""

    def __init__(self, metrics: RouterMetrics, kind: str, api: str, client: str, spans: AnySpans) -> None:
        """`kind`: embed or score; `api`: grpc or http; `client`: the caller's token name."""
        self.metrics, self.kind, self.api, self.client, self.spans = metrics, kind, api, client, spans
        self.start = time.perf_counter()

    def finish(self, outcome: str, inputs: int, prompt_tokens: int) -> None:
        """`outcome`: ok, or the failed call's status (invalid_argument, unavailable, client_cancelled, ...);
        the inputs and prompt tokens count only for an answered call."""
        total_s = time.perf_counter() - self.start
        self.metrics.pooling_requests.labels(kind=self.kind, status=outcome, api=self.api).inc()
        if outcome == "ok":
            self.metrics.pooling_latency.labels(kind=self.kind).observe(total_s)
            self.metrics.pooling_inputs.labels(kind=self.kind).inc(inputs)
            self.metrics.pooling_prompt_tokens.labels(kind=self.kind).inc(prompt_tokens)
        summary: dict[str, str | int] = {
            "kind": self.kind,
            "api": self.api,
            "inputs": inputs,
            "prompt_tokens": prompt_tokens,
        }
        log.info(
            "pooling_finished", client=self.client, outcome=outcome, **summary, total_s=round(total_s, 4)
        )
        self.spans.end(outcome, {f"nanovllm.{key}": value for key, value in summary.items()})


def request_content(request: generate_pb2.GenerateRequest) -> str:
    """The prompt as text for the log (only with --log-request-content): the text, the chat messages as
    `role: content` lines, or the token ids."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "chat":
        return "\n".join(f"{m.role}: {m.content or _parts_text(m)}" for m in request.chat.messages)
    return " ".join(map(str, request.token_ids.ids)) if kind == "token_ids" else ""


def _parts_text(message: generate_pb2.ChatMessage) -> str:
    """A message's parts for the log: the text, each image as its size."""
    return "".join(
        part.text if part.WhichOneof("part") == "text" else f"[image: {len(part.image.data)} bytes]"
        for part in message.parts
    )
