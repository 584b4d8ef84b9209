"""Several router processes on one public port (`--processes N`).

One Python process streams only so many responses a second: gRPC's per-message work holds its event
loop, and on a GPU machine the workers produce tokens faster than that (docs/performance.md). So the router
can run as N processes. Each binds the public gRPC port, and the HTTP port when there is one, with
SO_REUSEPORT, and the kernel deals every new client connection to one of them; each connects to every
worker and routes on its own view of them, as router replicas do. The first process (index 0) starts the
others, starts again one that exits, and stops them when it stops. It alone serves the plaintext health
port and /metrics, whose counters and histograms are summed over all processes through prometheus_client's
multiprocess mode.

What each process keeps for itself, as each replica does: per-token limits, and the Admin service's record
of the adapters loaded through it.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import multiprocessing
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from nanovllm.common.logging import LogConfig, get_logger
from nanovllm.common.server_config import RouterConfig

if TYPE_CHECKING:  # at run time, not before shared_metrics: it imports prometheus_client
    from nanovllm.common.serving import GrpcServer

log = get_logger(__name__)

FIRST_RESTART_DELAY_S = 1.0  # a process that exits is started again after this, doubling while it fails
MAX_RESTART_DELAY_S = 30.0
STEADY_S = 60.0  # a process that ran this long before exiting is started again after the first delay
LISTEN_POLL_S = 0.02  # how often the first process looks whether the others listen yet, while they start
KILL_AFTER_S = 5.0  # past the drain timeout, a process that has not exited is killed
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch to its multiprocess mode

Serve = Callable[..., Coroutine[Any, Any, None]]  # router/faces/server.py serve_router


@contextmanager
def shared_metrics() -> Iterator[str]:
    """A fresh directory for every process's metric values, named in the environment that prometheus_client
    reads when it is first imported (this process's and every process it starts), removed afterwards."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before its multiprocess directory was set")
    with tempfile.TemporaryDirectory(prefix="nanovllm-router-metrics-") as directory:
        os.environ[METRICS_DIR_VARIABLE] = directory
        try:
            yield directory
        finally:
            del os.environ[METRICS_DIR_VARIABLE]


class ProcessRole:
    """This process's part in the router's group (`--processes N`; alone, it is the first with nobody to
    wait for). The first process (index 0) serves health and /metrics, starts the others once it listens,
    and is SERVING only once they listen too, so that clients connecting then are dealt to all of them;
    the others listen on the public port alone, and only once they reach a worker."""

    def __init__(self, config: RouterConfig, log_config: LogConfig, serve: Serve) -> None:
        self.config, self._log_config, self._serve = config, log_config, serve
        self.first = config.process_index == 0
        self.shares_port = config.processes > 1
        self._others: RouterProcesses | None = None
        if self.shares_port:  # each log line says which process wrote it
            structlog.contextvars.bind_contextvars(router_process=config.process_index)

    @property
    def all_listening(self) -> bool:
        """Whether every process of the group listens (health may say SERVING)."""
        return self._others is None or self._others.listening

    @property
    def health_and_metrics_ports(self) -> tuple[int | None, int | None]:
        return (self.config.health_port, self.config.metrics_port) if self.first else (None, None)

    async def before_listening(self, pool: Pool, reached: asyncio.Event, stop: asyncio.Event) -> None:
        """Another process than the first waits for a worker (or the stop) before it listens."""
        if not self.first:
            pool.start()
            await first_of(reached.wait(), stop.wait())

    async def after_listening(
        self, server: GrpcServer, pool: Pool, ports: dict[str, int | None], stop: asyncio.Event
    ) -> None:
        """The first process starts the others on the ports it bound, connects to the workers, and says
        SERVING once the others listen; another says SERVING once it has a worker."""
        if not self.first:
            await server.set_serving(bool(pool.available))
            return
        if self.shares_port:
            self._others = RouterProcesses(self._serve, self.config, self._log_config, ports)
            self._others.start()
        pool.start()
        if self._others is not None:
            await first_of(self._others.all_listening(), stop.wait())
            await server.set_serving(bool(pool.available) and self._others.listening)

    def stop_others(self) -> None:
        if self._others is not None:
            self._others.stop()

    async def wait_for_others_to_exit(self, drain_s: float) -> None:
        if self._others is not None:
            await self._others.wait(drain_s + KILL_AFTER_S)


class Pool(Protocol):
    """What the role needs of the worker pool (router/fleet/pool.py WorkerPool)."""

    @property
    def available(self) -> Sequence[object]: ...

    def start(self) -> None: ...


async def first_of(*waits: Coroutine[Any, Any, object]) -> None:
    """Return when any of `waits` is done; the rest are cancelled."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()


class RouterProcesses:
    """The first process's record of the others: processes 1 .. config.processes - 1, each running `serve`
    with the same configuration on the ports the first one bound (`ports`: port, and http_port)."""

    def __init__(
        self, serve: Serve, config: RouterConfig, log_config: LogConfig, ports: dict[str, Any]
    ) -> None:
        self._serve, self._log_config = serve, log_config
        self._configs = [
            dataclasses.replace(config, **ports, process_index=index) for index in range(1, config.processes)
        ]
        self._context = multiprocessing.get_context("spawn")  # no fork of a process that runs gRPC threads
        self._listened = {config.process_index: self._context.Event() for config in self._configs}
        self.listening = False  # every process listened (once)
        self._running: dict[int, BaseProcess] = {}
        self._stopping = asyncio.Event()
        self._watchers: list[asyncio.Task] = []

    def start(self) -> None:
        self._watchers = [asyncio.create_task(self._keep(config)) for config in self._configs]

    async def all_listening(self) -> None:
        """Return once every process has listened; a process listens once it has reached a worker."""
        while not all(event.is_set() for event in self._listened.values()):
            await asyncio.sleep(LISTEN_POLL_S)
        self.listening = True

    def stop(self) -> None:
        """SIGTERM to each process: it drains as the first one does."""
        self._stopping.set()
        for process in self._running.values():
            if process.is_alive():
                process.terminate()

    async def wait(self, timeout_s: float) -> None:
        """Wait for the processes to exit after `stop`, killing any left after `timeout_s`."""
        _, late = await asyncio.wait(self._watchers, timeout=timeout_s)
        if late:
            for process in self._running.values():
                log.warning("router_process_killed", pid=process.pid, timeout_s=timeout_s)
                process.kill()
            await asyncio.wait(late)

    async def _keep(self, config: RouterConfig) -> None:
        """Run one process, starting it again whenever it exits until `stop`."""
        delay = FIRST_RESTART_DELAY_S
        loop = asyncio.get_running_loop()
        while True:
            process = self._context.Process(
                target=run_process,
                args=(self._serve, config, self._log_config, self._listened[config.process_index]),
                name=f"router-{config.process_index}",
            )
            process.start()
            self._running[config.process_index] = process
            started = loop.time()
            log.info("router_process_started", index=config.process_index, pid=process.pid)
            await _exited(process)
            assert process.pid is not None  # started
            _forget_metrics(process.pid)
            del self._running[config.process_index]
            if self._stopping.is_set():
                return
            delay = FIRST_RESTART_DELAY_S if loop.time() - started >= STEADY_S else delay
            log.warning(
                "router_process_exited",
                index=config.process_index,
                pid=process.pid,
                exit_code=process.exitcode,
                restart_in_s=delay,
            )
            try:  # the delay, unless the router stops first
                await asyncio.wait_for(self._stopping.wait(), delay)
                return
            except asyncio.TimeoutError:
                delay = min(2 * delay, MAX_RESTART_DELAY_S)


def run_process(serve: Serve, config: RouterConfig, log_config: LogConfig, listened: EventType) -> None:
    """A started process's body: `serve` until SIGTERM or SIGINT, or until the first process dies;
    `listened` is set once it listens."""
    from nanovllm.common.serving import stop_event_on_signals

    log_config.apply()
    _die_with_parent()

    async def main() -> None:
        await serve(config, log_config, stop_event_on_signals(), lambda address, metrics: listened.set())

    asyncio.run(main())


def _die_with_parent() -> None:
    """SIGTERM to this process when the first one dies, even by SIGKILL: no orphan keeps the port."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # it died before the request above
        os.kill(os.getpid(), signal.SIGTERM)


async def _exited(process: BaseProcess) -> None:
    """Wait, without a thread, until `process` exits: its sentinel becomes readable then."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(process.sentinel, wake)
    try:
        await done
    finally:
        loop.remove_reader(process.sentinel)
    process.join()


def _forget_metrics(pid: int) -> None:
    """Drop an exited process's gauge values (its counters and histograms keep counting in the sum)."""
    if METRICS_DIR_VARIABLE in os.environ:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
