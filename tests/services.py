"""Real router and worker processes on loopback for the service tests.

Each server is started with --port 0 and reports the port it bound on stdout, so tests never race for
free ports. Readiness is the standard health service's Watch stream reaching SERVING, not a sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanovllm.common.v1 import worker_pb2, worker_pb2_grpc
from nanovllm.server_process import ServerProcess
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.cpus import SUITE_CPUS
from tests.prewarmed import Prewarmed

START_TIMEOUT_S = 180.0  # the first worker of a session may compile the C++ kernels


PREWARMED = Prewarmed()  # the interpreters servers fork from (tests/prewarmed.py)


def unpin_test_process() -> None:
    """Give every thread of this process the suite's CPUs back (an engine still running takes its slice
    again at its next step)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), SUITE_CPUS)
        except OSError:  # a thread that just exited
            continue


def start(args: list[str], log_path: Path | None = None, cpus: set[int] | None = None) -> ServerProcess:
    """`nanovllm <args>` with JSON logs to `log_path` (or nowhere), once it listens; on `cpus`, by default
    the suite's. Forked from this test process's prewarmed interpreter (tests/prewarmed.py)."""
    if log_path is None:
        log_path = Path(os.devnull)
    return PREWARMED.spawn([*args, "--log-format", "json"], log_path, SUITE_CPUS if cpus is None else cpus)


def start_worker(
    model: Path, *extra: str, port: int = 0, log_path: Path | None = None, cpus: set[int] | None = None
) -> ServerProcess:
    args = [
        "worker",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        "0",
    ]
    # float32 unless `extra` says otherwise (a later flag wins): tests compare served tokens with the offline
    # engine's, and only float32 is invariant to how the two happen to batch requests.
    defaults = ["--kv-cache-memory", "32MiB", "--max-model-len", "512", "--dtype", "float32"]
    return start([*args, *defaults, *extra], log_path, cpus)


def start_router(
    workers: list[str], *extra: str, log_path: Path | None = None, cpus: set[int] | None = None
) -> ServerProcess:
    args = ["router", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    for worker in workers:
        args += ["--worker", worker]
    if "--response-store" not in extra:  # a test's stored responses beside its logs, never in ~/.cache
        store = "off" if log_path is None else str(log_path.with_suffix(".responses.sqlite"))
        args += ["--response-store", store]
    return start([*args, *extra], log_path, cpus)


def library_errors(log_path: Path) -> list[dict]:
    """Error-level records that the standard logging module wrote into a server's JSON log (asyncio's
    "Task exception was never retrieved", grpc's unhandled exceptions): faults of the server itself, never
    the expected outcome of a call. Read after the process exited, so that every line is complete."""
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    return [e for e in events if "logger" in e and e["level"] == "error"]


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one with `credentials`."""
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


def wait_serving(
    address: str, timeout: float = START_TIMEOUT_S, credentials: grpc.ChannelCredentials | None = None
) -> None:
    """Block until the server's health is SERVING (it may first report NOT_SERVING while loading)."""
    with open_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout, wait_for_ready=True)
        for status in watch:
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return


def worker_load(address: str, credentials: grpc.ChannelCredentials | None = None) -> worker_pb2.WorkerLoad:
    with open_channel(address, credentials) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def wait_idle(
    address: str, timeout: float = 30.0, credentials: grpc.ChannelCredentials | None = None
) -> worker_pb2.WorkerLoad:
    """Poll the worker's load until nothing runs and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        load = worker_load(address, credentials)
        if load.num_running == 0 and load.num_waiting == 0 and load.kv_blocks_used == 0:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {address} still busy after {timeout} s: {load}")
        time.sleep(0.02)


SHORT_CALL = generate_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# A bound on one call, not a measure of speed: a hang shows up as DEADLINE_EXCEEDED, not a stuck suite.
CALL_TIMEOUT_S = 120.0


def collect(
    address: str, request: generate_pb2.GenerateRequest, timeout: float = CALL_TIMEOUT_S
) -> tuple[list, grpc.RpcError | None]:
    """All responses of one Generate call, and the error that ended it (None when it finished)."""
    responses = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(request, timeout=timeout):
                responses.append(response)  # noqa: PERF402 - keep what came before an error
        except grpc.RpcError as exc:
            return responses, exc
    return responses, None


def wait_for_workers(router: str, count: int, timeout: float = 60.0) -> None:
    """Until the router has `count` workers connected (its health is SERVING from the first)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(router) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        while stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10).num_workers < count:
            assert time.monotonic() < deadline, f"the router did not connect {count} workers in {timeout} s"
            time.sleep(0.02)


async def run_calls(
    address: str, count: int, concurrency: int, during: Callable[[], None]
) -> list[tuple[float, object]]:
    """`count` short greedy calls, `concurrency` at a time; `during()` runs once a fifth of them have
    finished (to stop or kill a server under load). Returns (send time, the last response's finish reason
    or "CODE: details" of the error) per call."""
    results: list[tuple[float, object]] = []
    fired = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                sent = time.monotonic()
                request = generate_pb2.GenerateRequest(text=f"call {i}", sampling=SHORT_CALL)
                try:
                    responses = [r async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)]
                    results.append((sent, responses[-1].finish_reason))
                except grpc.aio.AioRpcError as exc:
                    results.append((sent, f"{exc.code().name}: {exc.details()}"))
                if len(results) == count // 5 and not fired.is_set():
                    fired.set()
                    during()

        await asyncio.gather(*(one(i) for i in range(count)))
    return results


def wait_for_log(path: Path, event: str, timeout: float = 30.0, **fields: object) -> dict:
    """The first JSON log line of `event` (with these field values) in the file, once it is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            entry = json.loads(line) if line.startswith("{") else {}
            if entry.get("event") == event and all(entry.get(k) == v for k, v in fields.items()):
                return entry
        time.sleep(0.05)
    raise AssertionError(f"no {event} {fields} in {path} after {timeout} s")


@contextmanager
def held_streams(
    model: Path, tmp_path: Path, *router_flags: str, worker_flags: tuple[str, ...] = ()
) -> Iterator[tuple]:
    """Workers A and B and a router over both, where B is frozen (SIGSTOP) until `kill_a()` freezes A, thaws
    B, waits for the router to connect it and SIGKILLs A: streams started before that all run on A, and A
    makes no progress while the router connects B, however long that takes on a loaded host."""
    a, b = (start_worker(model, *worker_flags, log_path=tmp_path / f"worker-{n}.log") for n in "ab")
    servers: list[ServerProcess] = [a, b]
    try:
        wait_serving(b.address)
        b.proc.send_signal(signal.SIGSTOP)
        router = start_router([a.address, b.address], *router_flags, log_path=tmp_path / "router.log")
        servers.append(router)
        wait_serving(router.address)

        def kill_a() -> None:
            a.proc.send_signal(signal.SIGSTOP)
            b.proc.send_signal(signal.SIGCONT)
            wait_for_workers(router.address, 2)
            a.proc.kill()

        yield a, b, router, kill_a
    finally:
        for server in servers:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)
                server.kill()


@contextmanager
def router_and_worker(
    model: Path, logs: Path, worker_flags: tuple[str, ...] = (), router_flags: tuple[str, ...] = ()
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """One worker serving `model` behind one router, both SERVING, logging into `logs`; stopped (drained) at
    the end, when neither log may hold an error from a library."""
    worker = start_worker(model, *worker_flags, log_path=logs / "worker.log")
    router = start_router([worker.address], *router_flags, log_path=logs / "router.log")
    try:
        wait_serving(worker.address)
        wait_serving(router.address)
        yield worker, router
    finally:
        router.stop()
        worker.stop()
    assert library_errors(logs / "router.log") == []
    assert library_errors(logs / "worker.log") == []


def serve_addresses(stdout: IO[str]) -> tuple[str, str, str]:
    """The router's gRPC, HTTP and metrics addresses from what `nanovllm serve` prints (the HTTP one on the
    third line after the first, once the router answers)."""
    banner = stdout.readline()
    router, metrics = banner.split("router at ")[1].split(",")[0], banner.split("metrics on ")[1].split()[0]
    lines = [stdout.readline() for _ in range(3)]
    return router, lines[2].split("http://")[1].split("/")[0], metrics
