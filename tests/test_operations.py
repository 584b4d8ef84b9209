"""Operations: Prometheus metrics on both processes, graceful drain on SIGTERM, NOT_SERVING until ready."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanovllm.common.serving import GrpcServer
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.metrics import scrape, value
from tests.services import CALL_TIMEOUT_S, library_errors, start_router, start_worker, wait_serving


def request(text: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return generate_pb2.GenerateRequest(text=text, sampling=sampling, return_token_ids=True)


def test_metrics_after_traffic(service) -> None:
    """Both /metrics endpoints carry the documented series, and they move by what the traffic did."""
    router_before, worker_before = (
        scrape(service.router.metrics_address),
        scrape(service.worker.metrics_address),
    )
    with grpc.insecure_channel(service.router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for i in range(3):
            list(stub.Generate(request(f"metrics {i}", 10), timeout=CALL_TIMEOUT_S))
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(generate_pb2.GenerateRequest(text="x", sampling={"top_p": 2.0})))
    router, worker = scrape(service.router.metrics_address), scrape(service.worker.metrics_address)

    def delta(after: dict, before: dict, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(router, router_before, "nanovllm:requests_total", status="length", api="grpc") == 3
    assert delta(router, router_before, "nanovllm:requests_total", status="invalid_argument", api="grpc") == 1
    assert delta(router, router_before, "nanovllm:time_to_first_token_seconds_count") == 3
    assert delta(router, router_before, "nanovllm:e2e_request_latency_seconds_count") == 3
    assert delta(router, router_before, "nanovllm:inter_token_latency_seconds_count") == 3 * 9
    assert value(router, "nanovllm:requests_in_flight", worker=service.worker.address) == 0
    assert 0 < delta(router, router_before, "nanovllm:e2e_request_latency_seconds_sum") < 3 * CALL_TIMEOUT_S

    assert delta(worker, worker_before, "nanovllm:generation_tokens_total") == 30
    assert delta(worker, worker_before, "nanovllm:prompt_tokens_total") > 0
    assert delta(worker, worker_before, "nanovllm:engine_step_seconds_count") >= 10
    assert value(worker, "nanovllm:num_requests_running") == 0
    assert value(worker, "nanovllm:num_requests_waiting") == 0
    assert value(worker, "nanovllm:kv_cache_usage_perc") == 0
    assert 0 <= value(worker, "nanovllm:prefix_cache_hit_rate") <= 1
    assert ("nanovllm:num_preemptions_total", ()) in worker


@pytest.fixture
def pair(qwen3_dir: Path, kernels, tmp_path: Path):
    worker = start_worker(qwen3_dir, "--drain-timeout", "60", log_path=tmp_path / "worker.log")
    router = start_router([worker.address], "--drain-timeout", "60", log_path=tmp_path / "router.log")
    wait_serving(worker.address)
    wait_serving(router.address)
    yield worker, router
    for server in (router, worker):
        if server.proc.poll() is None:
            server.kill()


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


@pytest.mark.parametrize("target", ["worker", "router"])
def test_sigterm_drains_in_flight_streams(pair, target: str, tmp_path: Path) -> None:
    """SIGTERM mid-stream: health goes NOT_SERVING, new requests get UNAVAILABLE, the stream in flight
    still completes with all its tokens (those of the same request run before, undisturbed), and the
    process exits 0 without an error in its log (a worker ends its routers' Connect streams itself rather
    than have the server cancel them)."""
    worker, router = pair
    draining = worker if target == "worker" else router
    with grpc.insecure_channel(router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        undisturbed = list(stub.Generate(request("drain me", 150), timeout=CALL_TIMEOUT_S))
        call = stub.Generate(request("drain me", 150), timeout=CALL_TIMEOUT_S)
        first = next(call)
        # The health watch is open before the signal, so its change arrives as an event however soon the
        # drained process exits (the stream in flight may end within milliseconds of it).
        with grpc.insecure_channel(draining.address) as probe:
            watch = health_pb2_grpc.HealthStub(probe).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            draining.proc.send_signal(signal.SIGTERM)
            for status in watch:
                if status.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    watch.cancel()
                    break
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request("too late", 5), timeout=CALL_TIMEOUT_S))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)
    assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 150
    assert [t for r in (first, *rest) for t in r.token_ids] == [t for r in undisturbed for t in r.token_ids]
    assert first.text + "".join(r.text for r in rest) == "".join(r.text for r in undisturbed)
    assert draining.proc.wait(timeout=60) == 0
    assert library_errors(tmp_path / f"{target}.log") == []


def test_a_server_is_not_serving_until_it_says_so() -> None:
    """The servers' plumbing (common/serving.py's GrpcServer, which router and worker both start before
    they load anything) answers health from the moment it listens: NOT_SERVING, until set_serving(True).
    Observed on one Watch stream, each status an event: no timing."""

    async def scenario() -> list[int]:
        server = GrpcServer([])
        address = await server.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
                seen = [(await watch.read()).status]
                await server.set_serving(True)
                seen.append((await watch.read()).status)
                watch.cancel()
                return seen
        finally:
            await server.stop(0)

    status = health_pb2.HealthCheckResponse
    assert asyncio.run(scenario()) == [status.NOT_SERVING, status.SERVING]


def test_worker_listens_before_it_loads_and_serves_once_loaded(
    qwen3_dir: Path, kernels, tmp_path: Path
) -> None:
    """A worker process answers health as soon as it listens (start_worker returns then) and its watch
    reaches SERVING once the model and KV cache are ready; the log shows the cache allocated before
    `worker_serving`. Whether a watch catches NOT_SERVING first depends on how fast the model loads, so
    that state is the test above's, on the server itself."""
    worker = start_worker(qwen3_dir, log_path=tmp_path / "worker.log")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            seen = []
            for status in watch:
                seen.append(status.status)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    watch.cancel()
                    break
        assert set(seen) <= {
            health_pb2.HealthCheckResponse.NOT_SERVING,
            health_pb2.HealthCheckResponse.SERVING,
        }
        assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
        lines = (tmp_path / "worker.log").read_text().splitlines()
        events = [json.loads(line).get("event") for line in lines if line.startswith("{")]
        assert events.index("kv_cache_allocated") < events.index("worker_serving")
    finally:
        assert worker.stop() == 0
