"""Server processes forked from an interpreter that has already imported what servers import.

The suite starts about 85 workers and 80 routers, each on one CPU. Started fresh (`python -m nanovllm.cli`),
a worker listened 1.8 s after its start and a router 0.56 s, mostly importing (torch alone 1.5 s): 200 s
of the suite's 815 s of test time (2026-11-30, AVX-512 EPYC). So each test process keeps a prewarmed
interpreter per command (this file as a script) that imports those libraries once and forks a child per
server; the child takes the server's stdio, environment, working directory and CPUs, then runs
`nanovllm.cli` as `python -m` would (runpy, as __main__, with the server's argv) and exits as a Python
process does. Everything from the flags on is the server's own start. The commands that users run
(`nanovllm serve`, `nanovllm client`) still start fresh in the tests that run them.

A fork copies one thread only: the prewarmed interpreter forks only while it runs no other thread (the
modules it imports start none; it checks before each fork), as a process running gRPC's or OpenMP's
threads could not be forked safely. It stops when the test process dies (as servers do when their
parent dies: nanovllm/server_process.py's stop_with_parent), and so do its children.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from nanovllm.server_process import (
    PARENT_VARIABLE,
    ServerExited,
    ServerProcess,
    await_listening,
    stop_with_parent,
)

# What each command imports before it serves. A router: libraries only, not the package's modules, which
# import prometheus_client (it reads its multiprocess directory when first imported, and a router of
# several processes sets that directory first: router/faces/process_group.py); and no torch, which a
# router never maps (tests/test_router_processes.py), so routers fork from an interpreter of their own.
ROUTER_PRELOAD = (
    "grpc",
    "grpc.aio",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "google.protobuf.json_format",
    "structlog",
    "tokenizers",
    "jinja2",
    "starlette.applications",
    "uvicorn",
    "xxhash",
)
# A worker: torch too, and the package's modules that `nanovllm worker` imports (nanovllm/cli.py's
# run_worker; none reads the environment when imported), prometheus_client with them (one process a worker).
PRELOAD = {
    "router": ROUTER_PRELOAD,
    "worker": (
        *ROUTER_PRELOAD,
        "torch",
        "numpy",
        "safetensors.torch",
        "psutil",
        "nanovllm.client",
        "nanovllm.flags",
        "nanovllm.common.serving",
        "nanovllm.worker.device",
        "nanovllm.worker.models.gguf.cache",
        "nanovllm.worker.runner.host_memory",
        "nanovllm.worker.service.server",
    ),
}
_PID = struct.Struct("i")


class PrewarmedProcess:
    """A server forked by the prewarmed interpreter: the subprocess.Popen methods the tests use. Its exit
    status comes from the interpreter (its parent), which writes it to `status` when it reaps it."""

    def __init__(self, pid: int, status: int, stdout: IO[str]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None:
            os.set_blocking(self._status, False)
            try:
                self._read_status()
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            os.set_blocking(self._status, True)
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def _read_status(self) -> None:
        data = os.read(self._status, _PID.size)
        if len(data) != _PID.size:
            raise ServerExited(f"the prewarmed interpreter died before reporting server {self.pid}'s exit")
        (self.returncode,) = _PID.unpack(data)
        os.close(self._status)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Prewarmed:
    """This test process's prewarmed interpreters, one per command, each started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: dict[str, socket.socket] = {}
        self._processes: dict[str, subprocess.Popen] = {}
        atexit.register(self.close)

    @property
    def pids(self) -> set[int]:
        return {process.pid for process in self._processes.values()}

    def _connect(self, command: str) -> socket.socket:
        if command not in self._sockets:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._processes[command] = subprocess.Popen(
                [sys.executable, __file__, command, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                # numpy's OpenBLAS (torch imports numpy) starts a thread server on import unless it has
                # one thread: with it the interpreter could not fork; servers run no BLAS of numpy's.
                env={
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    "OPENBLAS_NUM_THREADS": "1",
                    PARENT_VARIABLE: str(os.getpid()),
                },
            )
            theirs.close()
            self._sockets[command] = ours
        return self._sockets[command]

    def close(self) -> None:
        """Each interpreter reads the end of its socket and exits (servers still running get SIGTERM)."""
        with self._lock:
            for command, sock in self._sockets.items():
                sock.close()
                self._processes[command].wait(timeout=30)
            self._sockets.clear()
            self._processes.clear()

    def spawn(self, args: list[str], log_path: Path, cpus: set[int]) -> ServerProcess:
        """nanovllm/server_process.py's spawn, forked: `nanovllm <args>` with stderr appended to
        `log_path`, on `cpus`, returned once it listens."""
        read, write = os.pipe()
        status_read, status_write = os.pipe()
        request = {
            "argv": args,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "cpus": sorted(cpus),
        }
        with open(log_path, "ab") as log, open(os.devnull, "rb") as stdin, self._lock:
            sock = self._connect(args[0])
            fds = [stdin.fileno(), write, log.fileno(), status_write]
            socket.send_fds(sock, [json.dumps(request).encode()], fds)
            reply = sock.recv(_PID.size)
        os.close(write)
        os.close(status_write)
        if len(reply) != _PID.size:
            raise ServerExited(f"the prewarmed interpreter did not start nanovllm {args[0]}")
        (pid,) = _PID.unpack(reply)
        stdout = open(read, encoding="utf-8")  # noqa: SIM115 - the handle keeps it, as Popen keeps its stdout
        return await_listening(PrewarmedProcess(pid, status_read, stdout), args[0], log_path)


def _serve(command: str, sock: socket.socket) -> tuple[dict, list[int]]:
    """Fork a child per request until the test process closes the socket; returns (in the child only)
    its request and its stdin, stdout and stderr."""
    import importlib

    for name in PRELOAD[command]:
        importlib.import_module(name)
    if command == "router" and "prometheus_client" in sys.modules:
        raise SystemExit("prewarmed interpreter: a router's preloaded module imports prometheus_client")
    if "nanovllm.cli" in sys.modules:  # runpy would warn on stderr, which the tests read as JSON logs
        raise SystemExit("prewarmed interpreter: a preloaded module imports nanovllm.cli")
    statuses: dict[int, int] = {}  # a running child's pid -> where its exit status goes

    def reap(signum: int, frame: object) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd = statuses.pop(pid, None)
            if fd is not None:
                with contextlib.suppress(OSError):  # the test process no longer holds its handle
                    os.write(fd, _PID.pack(os.waitstatus_to_exitcode(status)))
                os.close(fd)

    signal.signal(signal.SIGCHLD, reap)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        if not message:
            raise SystemExit(0)
        threads = os.listdir("/proc/self/task")
        if len(threads) != 1:
            raise SystemExit(f"prewarmed interpreter: {len(threads)} threads, a fork would not be safe")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # its status recorded before it is reaped
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            sock.close()
            for fd in [*statuses.values(), fds[3]]:
                os.close(fd)
            return json.loads(message), fds[:3]
        for fd in fds[:3]:
            os.close(fd)
        statuses[pid] = fds[3]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        sock.send(_PID.pack(pid))


def _become(request: dict, fds: list[int]) -> None:
    """In the child: the server's stdio, environment, directory and CPUs, as `spawn` gives them."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.environ[PARENT_VARIABLE] = str(os.getppid())
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts it first
    os.sched_setaffinity(0, request["cpus"])
    sys.argv = ["nanovllm", *request["argv"]]


if __name__ == "__main__":
    stop_with_parent()
    sys.path[0] = os.getcwd()  # not tests/: its modules must not shadow a library's
    with socket.socket(fileno=int(sys.argv[2])) as control:
        child_request, child_fds = _serve(sys.argv[1], control)
    _become(child_request, child_fds)
    import runpy

    runpy.run_module("nanovllm.cli", run_name="__main__", alter_sys=True)
