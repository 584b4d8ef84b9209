"""Workers found through DNS: the router looks a name up every --discovery-interval and uses the workers
that appear and drops those that vanish, without a restart. A small DNS server in the test answers for the
name (as a Kubernetes headless Service would: one A record per worker); the workers listen on their own
loopback addresses."""

from __future__ import annotations

import asyncio
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dns.message
import dns.rrset
import grpc
import pytest

from nanovllm.common.server_config import RoutingConfig
from nanovllm.router.fleet.discovery import WorkerTarget
from nanovllm.router.fleet.pool import WorkerPool
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.metrics import by_label, scrape
from tests.model_factory import build_model
from tests.services import CALL_TIMEOUT_S, start_router, start_worker, wait_idle, wait_serving, worker_load

NAME = "workers.nanovllm.test."
LONG_CONTEXT = 16384
# A bound on a hang, not a speed: with --discovery-interval 0.5 a change is seen within a lookup or two,
# and the test prints how long it took.
WAIT_S = 60.0


class _Records(socketserver.BaseRequestHandler):
    """Answers A queries for NAME from the server's `addresses` (none at all while it is `silent`);
    NXDOMAIN for anything else."""

    def handle(self) -> None:
        if self.server.silent:  # a resolver that does not answer: lookups time out
            return
        data, sock = self.request
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        if question.name.to_text() == NAME:
            ips = sorted(self.server.addresses)
            if ips:
                response.answer.append(dns.rrset.from_text_list(NAME, 1, "IN", "A", ips))
        else:
            response.set_rcode(dns.rcode.NXDOMAIN)
        sock.sendto(response.to_wire(), self.client_address)


@contextmanager
def dns_server() -> Iterator[socketserver.UDPServer]:
    server = socketserver.ThreadingUDPServer(("127.0.0.1", 0), _Records)
    server.addresses = set()
    server.silent = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _seen_workers(router_metrics: str) -> set[str]:
    return set(by_label(scrape(router_metrics), "nanovllm:worker_queue", "worker"))


def _num_workers(stub: generate_pb2_grpc.GenerationStub) -> int:
    return stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10).num_workers


def _within(seconds: float, condition, what: str) -> float:
    """Wait for `condition()`; returns how long it took, failing past `seconds`."""
    start = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - start
        assert elapsed < seconds, f"{what}: not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("10.0.0.1:50061", WorkerTarget("10.0.0.1", 50061)),
        ("[::1]:7", WorkerTarget("::1", 7)),
        ("svc.ns.svc.cluster.local:50061", WorkerTarget("svc.ns.svc.cluster.local", 50061)),
        ("dns://10.0.0.10/svc:50061", WorkerTarget("svc", 50061, ("10.0.0.10", 53))),
        ("dns://127.0.0.1:5353/svc:1", WorkerTarget("svc", 1, ("127.0.0.1", 5353))),
        ("dns:///svc:2", WorkerTarget("svc", 2)),
    ],
)
def test_worker_targets_parse(text: str, parsed: WorkerTarget) -> None:
    assert WorkerTarget.parse(text) == parsed


@pytest.mark.parametrize("text", ["svc", "svc:", "svc:0", "svc:70000", ":50061", "dns://ns/svc"])
def test_a_bad_worker_target_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="must be HOST:PORT with a port in 1-65535"):
        WorkerTarget.parse(text)


@pytest.mark.slow
def test_workers_under_a_dns_name_are_used_and_dropped_without_a_restart(kernels, tmp_path: Path) -> None:
    model = build_model("qwen3", tmp_path / "model", seed=1, max_position=LONG_CONTEXT)
    worker_args = ("--max-model-len", str(LONG_CONTEXT))
    first = start_worker(model, *worker_args, "--host", "127.0.0.2", log_path=tmp_path / "worker-a.log")
    port = int(first.address.rsplit(":", 1)[1])
    second = start_worker(
        model, *worker_args, "--host", "127.0.0.3", port=port, log_path=tmp_path / "worker-b.log"
    )
    servers = [first, second]
    with dns_server() as records:
        records.addresses = {"127.0.0.2"}
        target = f"dns://127.0.0.1:{records.server_address[1]}/{NAME.rstrip('.')}:{port}"
        router = start_router([target], "--discovery-interval", "0.5", log_path=tmp_path / "router.log")
        servers.append(router)
        channel = grpc.insecure_channel(router.address)
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            for server in servers:
                wait_serving(server.address)
            assert _num_workers(stub) == 1 and _seen_workers(router.metrics_address) == {first.address}

            records.addresses = {"127.0.0.2", "127.0.0.3"}  # a worker added
            added_s = _within(WAIT_S, lambda: _num_workers(stub) == 2, "the added worker used")

            # A long stream on the first worker (both idle, it is first), then the first is removed.
            sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
            call = stub.Generate(
                generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6]), sampling=sampling),
                timeout=CALL_TIMEOUT_S,
            )
            next(call)
            running_on = [worker_load(w.address).num_running for w in (first, second)]
            records.addresses = {"127.0.0.3"}
            removed_s = _within(WAIT_S, lambda: _num_workers(stub) == 1, "the removed worker dropped")
            short = generate_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            for i in range(4):  # new calls all go to the remaining worker
                request = generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=[9, i]), sampling=short
                )
                assert list(stub.Generate(request, timeout=CALL_TIMEOUT_S))[-1].usage.completion_tokens == 2
            *_, last = call  # the stream on the removed worker was left to finish
            assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert last.usage.completion_tokens == 600
            _within(WAIT_S, lambda: _seen_workers(router.metrics_address) == {second.address}, "closed")
            print(f"worker added: used after {added_s:.2f} s; removed: dropped after {removed_s:.2f} s")
            assert running_on == [1, 0]
            for worker in (first, second):
                wait_idle(worker.address)
        finally:
            channel.close()
            for server in servers:
                server.kill()


def test_a_failed_lookup_keeps_the_workers_an_empty_answer_drops_them() -> None:
    """The pool's refresh on its own (no worker needs to run: connections are not started): a DNS server
    that does not answer leaves the workers as they were; one that answers with no record retires them."""

    async def scenario(records: socketserver.UDPServer) -> list[list[str]]:
        target = f"dns://127.0.0.1:{records.server_address[1]}/{NAME.rstrip('.')}:7000"
        pool = WorkerPool([target], lambda serving: None, RoutingConfig())
        seen = []
        for addresses in ({"127.0.0.2", "127.0.0.3"}, None, set()):  # None: the server stays silent
            records.silent = addresses is None
            records.addresses = addresses or set()
            await pool.refresh()
            seen.append(sorted(w.address for w in pool.workers))
        await pool.close()
        return seen

    with dns_server() as records:
        assert asyncio.run(scenario(records)) == [
            ["127.0.0.2:7000", "127.0.0.3:7000"],
            ["127.0.0.2:7000", "127.0.0.3:7000"],
            [],
        ]
