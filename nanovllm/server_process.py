"""Server processes started from Python: `nanovllm serve` starts its worker and router this way, and so
do the tests and the benchmarks. A server prints one line to stdout once bound ("nanovllm <what>
listening on HOST:PORT, metrics on HOST:PORT", and ", http on HOST:PORT" for a router's HTTP API), so
`--port 0` never races for a free port."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LISTENING = "listening on"
LISTENING_RE = re.compile(r"listening on (\S+?),? ")


class ServerExited(RuntimeError):
    """A server exited before it listened (its own message, on its stderr, says why)."""


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str  # gRPC
    metrics_address: str  # Prometheus /metrics over HTTP
    http_address: str | None = None  # a router's OpenAI-compatible HTTP API, when on

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the server drains), then wait for its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait_until_serving(address: str, alive: Callable[[], bool], poll_s: float = 0.2) -> bool:
    """Poll the server's health until it is SERVING (True), or until `alive()` turns false (False): a
    worker may take minutes to load, or die loading, and then nothing would ever report SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while alive():
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return True
            except grpc.RpcError:
                pass  # not listening yet, or busy: ask again
            time.sleep(poll_s)
    return False


# Set by `spawn` to its own pid: the server started stops when that process dies (stop_with_parent).
PARENT_VARIABLE = "NANOVLLM_STOP_WITH_PID"


def stop_with_parent() -> None:
    """In a server `spawn` started (the `nanovllm` command calls this first): SIGTERM (it drains) when the
    process that started it dies, even by SIGKILL, so that no server outlives it. Set here, not in a
    preexec_fn: forking a process that runs gRPC threads without exec'ing at once aborts in gRPC's fork
    handlers."""
    parent = os.environ.pop(PARENT_VARIABLE, None)
    if parent is None or sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(args: list[str], log_path: Path | None = None, cpus: set[int] | None = None) -> ServerProcess:
    """Run `nanovllm <args>` and return once it listens (not necessarily serving yet); it stops when this
    process dies. Its stderr goes to `log_path` (appended) when given, else to this process's stderr; with
    `cpus`, it may run on those CPUs only (its affinity mask)."""
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child's stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.cli", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_VARIABLE: str(os.getpid())},
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),  # noqa: PLW1509
    )
    if log is not None:
        log.close()  # the child holds its own copy
    return await_listening(proc, args[0], log_path)


def await_listening(proc: subprocess.Popen, command: str, log_path: Path | None) -> ServerProcess:
    """The server once its first stdout line says where it listens; killed, and ServerExited, if it exits
    first (its log, when it has one, says why)."""
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    match = LISTENING_RE.search(line)
    if match is None:
        proc.kill()
        proc.wait()
        where = f" (log: {log_path})" if log_path else ""
        raise ServerExited(f"nanovllm {command} exited with {proc.returncode} before listening{where}")
    metrics = re.search(r"metrics on ([^,\s]+)", line)
    http = re.search(r"http on ([^,\s]+)", line)
    return ServerProcess(proc, match.group(1), metrics.group(1) if metrics else "", http and http.group(1))
