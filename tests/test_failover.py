"""Two workers behind one router: a draining or killed worker costs clients nothing but latency, since
requests without a token yet move to the other worker; and a frozen client does not hold its request."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nanovllm.common.errors import ConfigError
from nanovllm.common.server_config import RouterConfig
from nanovllm.v1 import generate_pb2
from tests.model_factory import build_model
from tests.services import (
    ServerProcess,
    run_calls,
    start_router,
    start_worker,
    wait_idle,
    wait_serving,
    worker_load,
)


@pytest.fixture
def two_workers(
    qwen3_dir: Path, kernels, tmp_path: Path
) -> Iterator[tuple[list[ServerProcess], ServerProcess]]:
    workers = [start_worker(qwen3_dir, log_path=tmp_path / f"worker{i}.log") for i in range(2)]
    router = start_router([w.address for w in workers], log_path=tmp_path / "router.log")
    try:
        for server in (*workers, router):
            wait_serving(server.address)
        yield workers, router
    finally:
        for server in (router, *workers):
            if server.proc.poll() is None:
                server.kill()


def test_draining_worker_fails_no_call(two_workers) -> None:
    """SIGTERM one of two workers in the middle of 100 calls: every call succeeds (the worker tells the
    router at once; a submit that crosses that notice is refused and retried on the other worker)."""
    workers, router = two_workers
    results = asyncio.run(
        run_calls(router.address, 100, 8, lambda: workers[0].proc.send_signal(signal.SIGTERM))
    )
    failures = [r for _, r in results if r != generate_pb2.FINISH_REASON_LENGTH]
    assert failures == []
    assert workers[0].proc.wait(timeout=60) == 0
    wait_idle(workers[1].address)


def test_killed_worker_fails_no_new_call(two_workers) -> None:
    """SIGKILL one of two workers in the middle of 100 calls: no call sent after the kill fails; calls that
    had no token yet when it died are retried on the other worker."""
    workers, router = two_workers
    killed_at: list[float] = []

    def kill() -> None:
        workers[0].proc.kill()
        killed_at.append(time.monotonic())

    results = asyncio.run(run_calls(router.address, 100, 8, kill))
    after = [r for sent, r in results if sent > killed_at[0]]
    assert len(after) >= 50
    assert [r for r in after if r != generate_pb2.FINISH_REASON_LENGTH] == []
    wait_idle(workers[1].address)


LONG_CONTEXT = 16384  # long enough that generating to the end takes many seconds even for a tiny model
# How long a test waits for a cut-off stream's worker to become idle. Not a measure of speed: a stream
# that is not cut off runs to its end (about a minute on the slowest CPU here) and then fails its
# outcome assertion, which says more than a timeout would.
DRAIN_TIMEOUT_S = 600.0

# A client process streaming one long generation; it prints "streaming" after the first response, then
# does what `then` says. `options` are its channel's.
CLIENT = """
import sys, time, grpc
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1], options={options})
sampling = generate_pb2.SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True, {sampling})
call = generate_pb2_grpc.GenerationStub(channel).Generate(generate_pb2.GenerateRequest(text="c", sampling=sampling))
next(call)
print("streaming", flush=True)
{then}
"""


@contextmanager
def long_stream(
    tmp_path: Path, client_options: str, then: str, *router_flags: str, sampling: str = ""
) -> Iterator[tuple]:
    """A worker that can generate for many seconds, a router with `router_flags`, and a client process
    already streaming from it (`sampling`: more SamplingParams fields, as keyword arguments). Yields
    (worker, client, the router's log events as a function)."""
    model = build_model("qwen3", tmp_path / "model", seed=1, max_position=LONG_CONTEXT)
    worker = start_worker(model, "--max-model-len", str(LONG_CONTEXT), log_path=tmp_path / "worker.log")
    router = start_router([worker.address], *router_flags, log_path=tmp_path / "router.log")
    client = None
    try:
        wait_serving(router.address)
        script = CLIENT.format(
            options=client_options, max_tokens=LONG_CONTEXT - 100, sampling=sampling, then=then
        )
        client = subprocess.Popen(
            [sys.executable, "-c", script, router.address], stdout=subprocess.PIPE, text=True
        )
        assert client.stdout.readline().strip() == "streaming"

        def events() -> list[dict]:
            """The router's log events so far; the last piece may be a line it is still writing."""
            lines = (tmp_path / "router.log").read_text().split("\n")[:-1]
            return [json.loads(line) for line in lines]

        yield worker, client, events
    finally:
        if client is not None:
            client.kill()
            client.wait()
        router.kill()
        worker.kill()


def finished(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("event") == "request_finished"]


def errors(events: list[dict]) -> list[dict]:
    """Error-level events: a call cut off by the router is its outcome, not a fault of the router."""
    return [e for e in events if e.get("level") == "error"]


# Responses of a few dozen bytes (text only) can all fit in a frozen client's kernel receive buffer, which
# some hosts let grow to tens of MiB, so no write ever blocks; with logprobs=20 every response is large.
@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["", "logprobs=20"], ids=["small_responses", "large_responses"])
def test_frozen_client_is_dropped_by_keepalive(kernels, tmp_path: Path, sampling: str) -> None:
    """A stopped client process keeps its TCP connection open, but answers no HTTP/2 ping: the router closes
    the connection after keepalive time + keepalive timeout, whatever the buffers between them absorb,
    which cancels the call and frees its KV blocks."""
    keepalive = ("--keepalive-time", "1", "--keepalive-timeout", "1")
    then = "for _ in call: pass"
    with long_stream(tmp_path, "[]", then, *keepalive, sampling=sampling) as (worker, client, events):
        client.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert worker_load(worker.address).num_running == 1
        wait_idle(worker.address, timeout=DRAIN_TIMEOUT_S)
        print(f"SIGSTOP to idle worker: {time.monotonic() - stopped:.2f} s")
        assert client.poll() is None  # still there, still stopped
        done = finished(events())
        assert [e["outcome"] for e in done] == ["client_cancelled"]
        assert done[0]["completion_tokens"] < LONG_CONTEXT - 100  # cut off, not run to the end
        assert errors(events()) == []


# A small receive window that does not grow: unread responses soon hold the router's writes back.
SMALL_WINDOW = '[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]'


@pytest.mark.slow
@pytest.mark.parametrize(
    "stall_timeout, reason",
    [("1", "took no response for 1.0 s (stall timeout)"), ("600", "responses wait behind one the client")],
)
def test_client_that_stops_reading_is_cut_off(
    kernels, tmp_path: Path, stall_timeout: str, reason: str
) -> None:
    """A live client that takes no response for --stall-timeout seconds, or lets more than 4,096 responses
    pile up behind one it does not take, has its stream cut off and its request aborted on the worker (KV
    blocks freed) long before the generation would have ended."""
    sleeping = "time.sleep(600)  # alive (it answers keepalive pings) but reading nothing"
    stall = ("--stall-timeout", stall_timeout)
    with long_stream(tmp_path, SMALL_WINDOW, sleeping, *stall) as (worker, client, events):
        wait_idle(worker.address, timeout=DRAIN_TIMEOUT_S)
        done = finished(events())
        assert [e["outcome"] for e in done] == ["stalled"]
        assert done[0]["completion_tokens"] < LONG_CONTEXT - 100
        assert [reason in e["reason"] for e in events() if e.get("event") == "client_stalled"] == [True]
        assert client.poll() is None  # the client itself is fine: only its stream was cut
        assert errors(events()) == []


@pytest.mark.parametrize("stall_timeout", [0.0, -1.0])
def test_a_stall_timeout_must_be_positive(stall_timeout: float) -> None:
    with pytest.raises(
        ConfigError, match=f"--stall-timeout must be more than 0 seconds, got {stall_timeout:g}"
    ):
        RouterConfig(workers=["w:1"], stall_timeout_s=stall_timeout)


@pytest.mark.parametrize("wait", [-1.0, float("nan")])
def test_a_resume_wait_must_not_be_negative(wait: float) -> None:
    with pytest.raises(ConfigError, match=f"--resume-wait must be 0 seconds or more, got {wait:g}"):
        RouterConfig(workers=["w:1"], resume_wait_s=wait)
    assert RouterConfig(workers=["w:1"], resume_wait_s=0.0).resume_wait_s == 0.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"retry_backoff_s": -0.5}, "--retry-backoff must be 0 seconds or more, got -0.5"),
        ({"retry_backoff_s": float("nan")}, "--retry-backoff must be 0 seconds or more, got nan"),
        ({"max_buffered_responses": 0}, "--max-buffered-responses must be at least 1, got 0"),
        ({"tokenizer_threads": 0}, "--tokenizer-threads must be at least 1, got 0"),
    ],
)
def test_retry_backoff_buffer_and_tokenizer_threads_are_checked(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig(workers=["w:1"], **settings)
