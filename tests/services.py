"""Real router and worker processes on loopback for the service tests.

Each server is started with --port 0 and reports the port it bound on stdout, so tests never race for
free ports. Readiness is the standard health service's Watch stream reaching SERVING, not a sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanovllm.cli import LISTENING_RE

START_TIMEOUT_S = 180.0  # the first worker of a session may compile the C++ kernels


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str  # gRPC
    metrics_address: str  # Prometheus /metrics over HTTP

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start(args: list[str], log_path: Path | None = None) -> ServerProcess:
    """Run `nanovllm <args>` and return once it listens (not necessarily serving yet)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stderr = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.cli", *args, "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    match = LISTENING_RE.search(line)
    if match is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"nanovllm {args[0]} exited before listening (log: {log_path})")
    return ServerProcess(proc, match.group(1), line.rsplit(" ", 1)[-1].strip())


def start_worker(model: Path, *extra: str, port: int = 0, log_path: Path | None = None) -> ServerProcess:
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
    return start([*args, *defaults, *extra], log_path)


def start_router(workers: list[str], *extra: str, log_path: Path | None = None) -> ServerProcess:
    args = ["router", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    for worker in workers:
        args += ["--worker", worker]
    return start([*args, *extra], log_path)


def wait_serving(address: str, timeout: float = START_TIMEOUT_S) -> None:
    """Block until the server's health is SERVING (it may first report NOT_SERVING while loading)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout, wait_for_ready=True)
        for status in watch:
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return
