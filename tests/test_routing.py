"""Routing on the workers' own reports: every worker pushes its queue to every router, so a router
places a request by the whole fleet's load, its peers' requests included, not by its own share."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.metrics import by_label, scrape, total
from tests.model_factory import build_model
from tests.services import (
    CALL_TIMEOUT_S,
    start_router,
    start_worker,
    wait_for_workers,
    wait_idle,
    wait_serving,
    worker_load,
)

LONG_CONTEXT = 16384  # streams that run for seconds even on a tiny model


def _queue_seen_by(router_metrics: str) -> dict[str, float]:
    """The router's nanovllm:worker_queue gauge, by worker address."""
    return by_label(scrape(router_metrics), "nanovllm:worker_queue", "worker")


def _wait_for_running(addresses: list[str], expected: list[int], timeout: float = 30.0) -> None:
    """The workers' running counts (GetLoad reads the engine's state as of its last step)."""
    deadline = time.monotonic() + timeout
    while (running := [worker_load(a).num_running for a in addresses]) != expected:
        assert time.monotonic() < deadline, f"workers run {running}, expected {expected}"
        time.sleep(0.02)


def _wait_for_view(router_metrics: str, expected: dict[str, float], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := _queue_seen_by(router_metrics)) != expected:
        assert time.monotonic() < deadline, f"router sees {seen}, expected {expected}"
        time.sleep(0.02)


@pytest.mark.slow
def test_second_router_routes_around_the_first_routers_load(kernels, tmp_path: Path) -> None:
    """Router A puts two long streams on one worker and one on the other. Router B, which has sent nothing
    yet, must see that (from the workers' reports) and put its stream on the less busy worker; counting
    only its own requests it would see two idle workers."""
    model = build_model("qwen3", tmp_path / "model", seed=1, max_position=LONG_CONTEXT)
    workers = [
        start_worker(model, "--max-model-len", str(LONG_CONTEXT), log_path=tmp_path / f"worker{i}.log")
        for i in range(2)
    ]
    addresses = [w.address for w in workers]
    routers = [start_router(addresses, log_path=tmp_path / f"router{i}.log") for i in range(2)]
    channels = [grpc.insecure_channel(r.address) for r in routers]
    calls = []
    try:
        for server in (*workers, *routers):
            wait_serving(server.address)
        sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=LONG_CONTEXT - 100, ignore_eos=True)
        a, b = (generate_pb2_grpc.GenerationStub(c) for c in channels)
        for router in routers:
            wait_for_workers(router.address, 2)
        for i in range(3):  # A alternates between the workers as their queues grow
            calls.append(
                a.Generate(
                    generate_pb2.GenerateRequest(text=f"a{i}", sampling=sampling), timeout=CALL_TIMEOUT_S
                )
            )
            next(calls[-1])
        deadline = time.monotonic() + 30
        while sorted(running := [worker_load(address).num_running for address in addresses]) != [1, 2]:
            assert time.monotonic() < deadline, f"workers run {running}"
            time.sleep(0.02)
        _wait_for_view(routers[1].metrics_address, dict(zip(addresses, map(float, running))))
        calls.append(
            b.Generate(generate_pb2.GenerateRequest(text="b", sampling=sampling), timeout=CALL_TIMEOUT_S)
        )
        next(calls[-1])
        _wait_for_running(addresses, [2, 2])
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
        for address in addresses:
            wait_idle(address)
        for server in (*routers, *workers):
            server.kill()


def _cached_blocks_seen_by(router_metrics: str) -> dict[str, float]:
    return by_label(scrape(router_metrics), "nanovllm:worker_cached_blocks", "worker")


@pytest.mark.slow
def test_a_cached_prefix_draws_its_requests_to_the_worker_that_holds_it(kernels, tmp_path: Path) -> None:
    """Worker 0 caches a 480-token prefix (reported block by block to the router) and is made busier by
    one long stream that shares it: another request sharing the prefix still goes there (its hit is worth
    more than one queued request), and finds the prefix cached; a request sharing nothing goes to the idle
    worker 1."""
    model = build_model("qwen3", tmp_path / "model", seed=1, max_position=LONG_CONTEXT)
    workers = [
        start_worker(model, "--max-model-len", str(LONG_CONTEXT), log_path=tmp_path / f"worker{i}.log")
        for i in range(2)
    ]
    addresses = [w.address for w in workers]
    router = start_router(addresses, log_path=tmp_path / "router.log")
    channel = grpc.insecure_channel(router.address)
    stub = generate_pb2_grpc.GenerationStub(channel)
    prefix = [100 + i % 300 for i in range(480)]

    def ask(prompt: list[int], max_tokens: int = 2) -> generate_pb2.GenerateResponse:
        sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling)
        return list(stub.Generate(request, timeout=CALL_TIMEOUT_S))[-1]

    long_call = None
    try:
        for server in (*workers, router):
            wait_serving(server.address)
        wait_for_workers(router.address, 2)
        assert ask(prefix + [1]).usage.cached_prompt_tokens == 0  # both idle: worker 0, the first
        deadline = time.monotonic() + 30
        while _cached_blocks_seen_by(router.metrics_address) != {addresses[0]: 30.0, addresses[1]: 0.0}:
            assert time.monotonic() < deadline, _cached_blocks_seen_by(router.metrics_address)
            time.sleep(0.02)
        sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=LONG_CONTEXT - 1000, ignore_eos=True)
        long_call = stub.Generate(
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prefix + [5, 6]), sampling=sampling
            ),
            timeout=CALL_TIMEOUT_S,
        )
        next(long_call)  # shares the prefix: worker 0
        _wait_for_running(addresses, [1, 0])
        assert ask(prefix + [2, 3]).usage.cached_prompt_tokens == 480  # on worker 0 despite its queue
        assert ask([7 + i % 200 for i in range(480)]).usage.cached_prompt_tokens == 0
        _wait_for_running(addresses, [1, 0])  # GetLoad may still count the fresh prompt's ended request
        while _cached_blocks_seen_by(router.metrics_address)[addresses[1]] != 30.0:  # the fresh prompt's
            assert time.monotonic() < deadline + 30, _cached_blocks_seen_by(router.metrics_address)
            time.sleep(0.02)
        metrics = router.metrics_address
        assert total(scrape(metrics), "nanovllm:routing_expected_hit_tokens_total") == 2 * 480  # both sharers
        assert total(scrape(metrics), "nanovllm:cached_prompt_tokens_total") == 2 * 480
    finally:
        if long_call is not None:
            long_call.cancel()
        channel.close()
        for address in addresses:
            wait_idle(address)
        for server in (router, *workers):
            server.kill()
