"""A router of several processes on its ports (`--processes`, router/faces/process_group.py), in front of the shared
test worker: every process serves gRPC and HTTP calls, /metrics sums them all, a process that dies is
started again, and none outlives the first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.metrics import scrape, total, value
from tests.services import CALL_TIMEOUT_S, START_TIMEOUT_S, library_errors, start_router, wait_serving

# Each connection lands on one of two processes by a hash of its ports: with 32 connections all land on one
# process with probability 2^-31.
CONNECTIONS = 32
PROMPT = generate_pb2.TokenIds(ids=[11, 42, 7, 99, 3])


def events(log_path: Path, name: str) -> list[dict]:
    """The complete JSON log lines of `name` so far (the processes may be writing a line right now)."""
    text = log_path.read_text()
    lines = text[: text.rfind("\n") + 1].splitlines()
    return [record for record in map(json.loads, lines) if record["event"] == name]


def wait_for_event(log_path: Path, name: str, count: int) -> list[dict]:
    """Until `count` lines of `name` are in the log (a condition the router reaches on its own)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(found := events(log_path, name)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} {name} lines did not come within {START_TIMEOUT_S} s: {found}")
        time.sleep(0.05)
    return found


def generate_on_own_connections(address: str, connections: int) -> list[list[int]]:
    """One greedy call on each of `connections` connections (channels that share no subchannel)."""
    request = generate_pb2.GenerateRequest(
        token_ids=PROMPT,
        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        return_token_ids=True,
    )
    outputs = []
    for _ in range(connections):
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            responses = list(
                generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT_S)
            )
        assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        outputs.append([t for r in responses for t in r.token_ids])
    return outputs


def complete_on_own_connections(address: str, connections: int) -> list[str]:
    """One greedy /v1/completions call on each of `connections` HTTP connections."""
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=CALL_TIMEOUT_S) as response:
        model = json.load(response)["data"][0]["id"]
    body = {"model": model, "prompt": list(PROMPT.ids), "max_tokens": 6, "temperature": 0}
    texts = []
    for _ in range(connections):  # urllib opens a connection for each request
        request = urllib.request.Request(
            f"http://{address}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
            choice = json.load(response)["choices"][0]
        assert choice["finish_reason"] == "length"
        texts.append(choice["text"])
    return texts


def test_every_process_serves_and_metrics_count_them_all(service, tmp_path: Path) -> None:
    """Calls on 32 gRPC and 32 HTTP connections are served by both processes, each the same tokens as the
    one-process router gives; the first process's /metrics counts them all; neither has torch loaded;
    SIGTERM stops both."""
    log_path = tmp_path / "router.log"
    router = start_router([service.worker.address], "--processes", "2", "--http-port", "0", log_path=log_path)
    try:
        wait_serving(router.address)
        started = events(log_path, "router_process_started")
        assert [record["index"] for record in started] == [1]
        single = generate_on_own_connections(service.router.address, 1)[0]
        assert generate_on_own_connections(router.address, CONNECTIONS) == [single] * CONNECTIONS
        single_text = complete_on_own_connections(service.router.http_address, 1)[0]
        assert complete_on_own_connections(router.http_address, CONNECTIONS) == [single_text] * CONNECTIONS
        samples = scrape(router.metrics_address)
        for api in ("grpc", "http"):
            assert value(samples, "nanovllm:requests_total", status="length", api=api) == CONNECTIONS
        assert total(samples, "nanovllm:time_to_first_token_seconds_count") == 2 * CONNECTIONS
        finished = wait_for_event(log_path, "request_finished", 2 * CONNECTIONS)
        for api in ("grpc", "http"):
            assert {record["router_process"] for record in finished if record["api"] == api} == {0, 1}
        for pid in (
            router.proc.pid,
            started[0]["pid"],
        ):  # after serving: no torch (nor transformers, its user)
            assert "/torch/" not in Path(f"/proc/{pid}/maps").read_text()
    finally:
        code = router.stop()
    assert code == 0
    assert not psutil.pid_exists(started[0]["pid"])  # the first process waited for it
    assert len(events(log_path, "router_stopping")) == 2
    assert library_errors(log_path) == []


@pytest.mark.slow
def test_a_process_that_dies_is_started_again_and_none_outlives_the_first(service, tmp_path: Path) -> None:
    log_path = tmp_path / "router.log"
    router = start_router([service.worker.address], "--processes", "2", log_path=log_path)
    try:
        wait_serving(router.address)
        os.kill(events(log_path, "router_process_started")[0]["pid"], signal.SIGKILL)
        exited = wait_for_event(log_path, "router_process_exited", 1)[0]
        assert exited["exit_code"] == -signal.SIGKILL
        again = wait_for_event(log_path, "router_serving", 3)[-1]
        assert again["router_process"] == 1
        assert len(generate_on_own_connections(router.address, 8)) == 8
        replacement = psutil.Process(events(log_path, "router_process_started")[-1]["pid"])
    finally:
        router.kill()  # SIGKILL: the first process cannot stop the others itself
    replacement.wait(timeout=START_TIMEOUT_S)  # told by the kernel that its parent died


def test_sigterm_while_a_process_waits_to_start_again_stops_everything(service, tmp_path: Path) -> None:
    """SIGTERM right after a process died (the first waits 1 s before starting it again): the first
    process stops without starting it, exits 0, and leaves no process behind."""
    log_path = tmp_path / "router.log"
    router = start_router([service.worker.address], "--processes", "2", log_path=log_path)
    try:
        wait_serving(router.address)
        first = psutil.Process(router.proc.pid)
        os.kill(events(log_path, "router_process_started")[0]["pid"], signal.SIGKILL)
        wait_for_event(log_path, "router_process_exited", 1)
    finally:
        code = router.stop()
    assert code == 0
    assert not first.is_running()
    started = events(log_path, "router_process_started")
    assert all(not psutil.pid_exists(record["pid"]) for record in started)
    assert library_errors(log_path) == []


@pytest.mark.parametrize("count", ["0", "-2"])
def test_fewer_than_one_process_is_refused(count: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nanovllm.cli", "router", "--worker", "127.0.0.1:1", "--processes", count],
        check=False,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode != 0
    assert f"--processes must be at least 1, got {count}" in result.stderr
