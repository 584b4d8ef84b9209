"""OpenTelemetry traces (common/tracing.py) from real router and worker processes into an OTLP collector
run by the test (a gRPC TraceService that keeps what it receives): one trace per request, the caller's
trace continued, the router's attempt span the parent of the worker's request span, a retry (a worker
refusing) and a resume (a worker dying mid-stream) recorded, sampling and the standard OTEL_* variables,
and bad configuration handled."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.otlp_collector import WAIT_S, Collector, Span, running_collector
from tests.services import (
    held_streams,
    library_errors,
    start_router,
    start_worker,
    wait_for_log,
    wait_serving,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
TOKENS = 12


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    with running_collector() as running:
        yield running


@pytest.fixture(scope="module", autouse=True)
def fast_batches() -> Iterator[None]:
    """Servers started here send their spans every 50 ms (the standard variable; 5 s by default)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield


@dataclass
class Traced:
    collector: Collector
    endpoint: str
    router: object
    worker: object
    logs: Path


@pytest.fixture(scope="module")
def traced(collector, qwen3_dir: Path, kernels, tmp_path_factory) -> Iterator[Traced]:
    spans, endpoint = collector
    logs = tmp_path_factory.mktemp("tracing-logs")
    worker = start_worker(qwen3_dir, "--otlp-traces-endpoint", endpoint, log_path=logs / "worker.log")
    router = start_router(
        [worker.address], "--otlp-traces-endpoint", endpoint, "--http-port", "0", log_path=logs / "router.log"
    )
    try:
        wait_serving(worker.address)
        wait_serving(router.address)
        yield Traced(spans, endpoint, router, worker, logs)
    finally:
        router.stop()
        worker.stop()
    assert library_errors(logs / "router.log") == []
    assert library_errors(logs / "worker.log") == []


def generate(
    address: str, metadata: tuple = (), text: str = "trace me"
) -> list[generate_pb2.GenerateResponse]:
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    request = generate_pb2.GenerateRequest(text=text, sampling=sampling)
    with grpc.insecure_channel(address) as channel:
        return list(
            generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=60)
        )


def named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def test_one_trace_continues_the_callers_traceparent_into_the_worker(traced: Traced) -> None:
    responses = generate(traced.router.address, (("traceparent", TRACEPARENT),))
    assert responses[-1].usage.completion_tokens == TOKENS
    spans = traced.collector.trace(TRACE_ID)
    (call,) = named(spans, "nanovllm.router.generate")
    (validate,) = named(spans, "nanovllm.router.validate")
    (route,) = named(spans, "nanovllm.router.route")
    (attempt,) = named(spans, "nanovllm.router.attempt")
    (request,) = named(spans, "nanovllm.worker.request")
    assert call.service == "nanovllm-router" and request.service == "nanovllm-worker"
    assert call.parent_id == CALLER_SPAN_ID  # the caller's span is the router span's parent
    assert validate.parent_id == route.parent_id == attempt.parent_id == call.span_id
    assert request.parent_id == attempt.span_id  # the worker continues the attempt carried in Submit
    assert call.attributes | {"nanovllm.ttft_s": 0} == call.attributes | {
        "nanovllm.api": "grpc",
        "nanovllm.outcome": "length",
        "nanovllm.completion_tokens": TOKENS,
        "nanovllm.attempts": 1,
        "nanovllm.resumes": 0,
        "nanovllm.worker": traced.worker.address,
        "nanovllm.ttft_s": 0,
    }
    assert 0 < call.attributes["nanovllm.ttft_s"] < WAIT_S
    assert route.attributes["nanovllm.worker"] == traced.worker.address
    assert attempt.attributes["nanovllm.attempt"] == "first"
    assert validate.attributes["nanovllm.prompt_tokens"] == call.attributes["nanovllm.prompt_tokens"]
    worker = request.attributes
    assert worker["nanovllm.finish_reason"] == "length" and worker["nanovllm.completion_tokens"] == TOKENS
    assert worker["nanovllm.prompt_tokens"] == call.attributes["nanovllm.prompt_tokens"]
    assert worker["nanovllm.prefill_chunks"] >= 1 and worker["nanovllm.decode_steps"] == TOKENS - 1
    assert worker["nanovllm.preemptions"] == 0 and worker["nanovllm.queue_s"] >= 0
    assert [e.name for e in request.span.events] == ["scheduled", "first_token"]
    # Router, attempt and worker spans nest in time too.
    assert (
        call.span.start_time_unix_nano
        <= attempt.span.start_time_unix_nano
        <= request.span.start_time_unix_nano
    )
    assert request.span.end_time_unix_nano <= call.span.end_time_unix_nano


def test_a_call_without_traceparent_starts_its_own_trace(traced: Traced) -> None:
    generate(traced.router.address, text="a trace of its own")

    def found(spans: list[Span]) -> bool:
        return any(
            s.name == "nanovllm.router.generate" and s.trace_id != TRACE_ID and not s.parent_id for s in spans
        )

    spans = traced.collector.wait_for(found, "no new trace")
    (call,) = [
        s for s in named(spans, "nanovllm.router.generate") if s.trace_id != TRACE_ID and not s.parent_id
    ]
    assert named(traced.collector.trace(call.trace_id), "nanovllm.worker.request")


def test_the_http_face_continues_a_traceparent_header(traced: Traced) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    body = json.dumps({"prompt": "traced over http", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://{traced.router.http_address}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    (call,) = named(traced.collector.trace(trace_id), "nanovllm.router.generate")
    assert call.parent_id == "b7ad6b7169203331" and call.attributes["nanovllm.api"] == "http"


def test_a_refused_call_is_an_error_span(traced: Traced) -> None:
    trace_id = "11111111111111111111111111111111"
    request = generate_pb2.GenerateRequest(text="x", sampling={"top_p": 2.0})
    with grpc.insecure_channel(traced.router.address) as channel, pytest.raises(grpc.RpcError):
        list(
            generate_pb2_grpc.GenerationStub(channel).Generate(
                request, metadata=(("traceparent", f"00-{trace_id}-{CALLER_SPAN_ID}-01"),), timeout=60
            )
        )
    spans = traced.collector.wait_for(
        lambda spans: any(s.trace_id == trace_id and s.name == "nanovllm.router.generate" for s in spans),
        "no span for the refused call",
    )
    (call,) = [s for s in named(spans, "nanovllm.router.generate") if s.trace_id == trace_id]
    assert call.attributes["nanovllm.outcome"] == "invalid_argument"
    assert call.span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert not [s for s in spans if s.trace_id == trace_id and s.name.startswith("nanovllm.worker")]


def test_an_embed_call_is_one_span_continuing_the_callers_trace(traced: Traced) -> None:
    trace_id = "22222222222222222222222222222222"
    with grpc.insecure_channel(traced.router.address) as channel:
        embedded = generate_pb2_grpc.GenerationStub(channel).Embed(
            generate_pb2.EmbedRequest(texts=["one", "two"]),
            metadata=(("traceparent", f"00-{trace_id}-{CALLER_SPAN_ID}-01"),),
            timeout=60,
        )
    spans = traced.collector.wait_for(
        lambda spans: any(s.trace_id == trace_id and s.name == "nanovllm.router.embed" for s in spans),
        "no span for the Embed call",
    )
    (call,) = [s for s in named(spans, "nanovllm.router.embed") if s.trace_id == trace_id]
    assert call.parent_id == CALLER_SPAN_ID
    assert call.attributes == {
        "nanovllm.api": "grpc",
        "nanovllm.kind": "embed",
        "nanovllm.outcome": "ok",
        "nanovllm.inputs": 2,
        "nanovllm.prompt_tokens": embedded.prompt_tokens,
    }
    assert call.span.status.code != trace_pb2.Status.STATUS_CODE_ERROR


@pytest.mark.slow
def test_a_stream_resumed_after_its_worker_died_shows_both_attempts(
    collector, qwen3_dir: Path, kernels, tmp_path: Path
) -> None:
    spans, endpoint = collector
    trace_id = "22222222222222222222222222222222"
    flags = ("--otlp-traces-endpoint", endpoint)
    with held_streams(qwen3_dir, tmp_path, *flags, worker_flags=flags) as (a, b, router, kill_a):

        async def run() -> list[generate_pb2.GenerateResponse]:
            sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            request = generate_pb2.GenerateRequest(text="resume me", sampling=sampling)
            metadata = (("traceparent", f"00-{trace_id}-{CALLER_SPAN_ID}-01"),)
            async with grpc.aio.insecure_channel(router.address) as channel:
                call = generate_pb2_grpc.GenerationStub(channel).Generate(
                    request, metadata=metadata, timeout=120
                )
                responses = []
                async for response in call:
                    responses.append(response)
                    if len(responses) == 4:  # mid-stream: A dies, B goes on (the stream waits meanwhile)
                        await asyncio.to_thread(kill_a)
                return responses

        responses = asyncio.run(run())
        assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        trace = spans.trace(trace_id)  # only B's span: A died before it could send one
    (call,) = named(trace, "nanovllm.router.generate")
    attempts = sorted(named(trace, "nanovllm.router.attempt"), key=lambda s: s.span.start_time_unix_nano)
    assert [s.attributes["nanovllm.attempt"] for s in attempts] == ["first", "resume"]
    assert [s.attributes["nanovllm.worker"] for s in attempts] == [a.address, b.address]
    assert attempts[0].span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    (event,) = [e for e in call.span.events if e.name == "resume"]
    assert {kv.key: kv.value.string_value for kv in event.attributes}["nanovllm.reason"] == "worker_lost"
    assert call.attributes["nanovllm.resumes"] == 1 and call.attributes["nanovllm.outcome"] == "length"
    (request,) = named(trace, "nanovllm.worker.request")
    assert request.parent_id == attempts[1].span_id and request.service == "nanovllm-worker"
    assert request.attributes["nanovllm.resumed_tokens"] > 0


@pytest.mark.slow
def test_an_unreachable_collector_is_one_warning_and_serving_goes_on(
    qwen3_dir: Path, kernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "router.log"
    # Batches every 50 ms, each given up after a second (rather than 5 s and 5 s): several failed exports
    # while the calls run, which must still be one warning.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    worker = start_worker(qwen3_dir, log_path=tmp_path / "worker.log")
    router = start_router([worker.address], "--otlp-traces-endpoint", "http://127.0.0.1:1", log_path=log)
    try:
        wait_serving(worker.address)
        wait_serving(router.address)
        for i in range(3):
            assert generate(router.address, text=f"untraced {i}")[-1].usage.completion_tokens == TOKENS
        wait_for_log(log, "tracing_export_failed")
    finally:
        router.stop()
        worker.stop()
    warnings = [line for line in log.read_text().splitlines() if "tracing_export_failed" in line]
    assert len(warnings) == 1, warnings
    assert library_errors(log) == []


def test_a_bad_sample_ratio_fails_the_start_naming_it() -> None:
    for ratio in ("1.5", "-0.1", "nan"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "nanovllm.cli",
                "router",
                "--worker",
                "127.0.0.1:1",
                "--trace-sample-ratio",
                ratio,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "NANOVLLM_PORT": "0", "NANOVLLM_METRICS_PORT": "0"},
        )
        assert (
            done.returncode != 0 and f"--trace-sample-ratio must be in [0, 1], got {ratio}" in done.stderr
        ), done


def test_standard_variables_and_a_zero_ratio(
    traced: Traced, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_SERVICE_NAME configure a router without flags; with
    --trace-sample-ratio 0 it starts no trace of its own, yet follows a caller's sampled traceparent."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", traced.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-router")
    router = start_router(
        [traced.worker.address], "--trace-sample-ratio", "0", log_path=tmp_path / "router.log"
    )
    try:
        wait_serving(router.address)
        before = {
            n: len(named(traced.collector.spans, n))
            for n in ("nanovllm.router.generate", "nanovllm.worker.request")
        }
        generate(router.address, text="not sampled")
        trace_id = "33333333333333333333333333333333"
        generate(router.address, (("traceparent", f"00-{trace_id}-{CALLER_SPAN_ID}-01"),), text="sampled")
        spans = traced.collector.trace(trace_id)
    finally:
        router.stop()
    (call,) = named(spans, "nanovllm.router.generate")
    assert call.service == "edge-router"
    assert len(named(spans, "nanovllm.worker.request")) == 1  # the worker follows the caller's decision too
    # The unsampled call made no span on either side: only the sampled one's were added (the router
    # flushed at its stop, and the worker sent the sampled call's span after the unsampled one ended).
    after = {n: len(named(traced.collector.spans, n)) for n in before}
    assert after == {n: count + 1 for n, count in before.items()}


@pytest.mark.slow
def test_a_retry_before_the_first_token_shows_both_attempts(
    collector, qwen3_dir: Path, kernels, tmp_path: Path
) -> None:
    """Worker A refuses every request (its queue holds none), so the router retries on B: the trace holds
    A's attempt as an error, a retry event naming worker_full, and B's attempt with B's request span."""
    spans, endpoint = collector
    flags = ("--otlp-traces-endpoint", endpoint)
    a = start_worker(qwen3_dir, *flags, "--max-queued-requests", "0", log_path=tmp_path / "a.log")
    b = start_worker(qwen3_dir, *flags, log_path=tmp_path / "b.log")
    router = start_router(
        [a.address, b.address], *flags, "--routing", "round-robin", log_path=tmp_path / "r.log"
    )
    try:
        wait_serving(a.address)
        wait_serving(b.address)
        wait_serving(router.address)
        trace_ids = [f"{i:032x}" for i in (0x44, 0x45)]  # round-robin: one of the two goes to A first
        for trace_id in trace_ids:
            assert generate(router.address, (("traceparent", f"00-{trace_id}-{CALLER_SPAN_ID}-01"),))
        traces = [spans.trace(trace_id) for trace_id in trace_ids]
    finally:
        router.stop()
        a.stop()
        b.stop()
    (retried,) = [t for t in traces if len(named(t, "nanovllm.router.attempt")) == 2]
    attempts = sorted(named(retried, "nanovllm.router.attempt"), key=lambda s: s.span.start_time_unix_nano)
    assert [(s.attributes["nanovllm.attempt"], s.attributes["nanovllm.worker"]) for s in attempts] == [
        ("first", a.address),
        ("retry", b.address),
    ]
    assert attempts[0].span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    (call,) = named(retried, "nanovllm.router.generate")
    (event,) = [e for e in call.span.events if e.name == "retry"]
    assert {kv.key: kv.value.string_value for kv in event.attributes}["nanovllm.reason"] == "worker_full"
    assert call.attributes["nanovllm.attempts"] == 2 and call.attributes["nanovllm.outcome"] == "length"
    (request,) = named(retried, "nanovllm.worker.request")  # A refused at the door: no span of its own
    assert request.parent_id == attempts[1].span_id
