"""A router process put together and run: its parts built, listening, serving until told to stop, then
drained (serve_router)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from nanovllm.common.logging import LogConfig, get_logger
from nanovllm.common.server_config import RouterConfig
from nanovllm.common.serving import GrpcServer
from nanovllm.common.tls import ReloadingSslContext, server_credentials
from nanovllm.common.tracing import start_tracing
from nanovllm.router.calls.limits import TokenLimits
from nanovllm.router.calls.metrics import RouterMetrics
from nanovllm.router.faces.admin import AdminService
from nanovllm.router.faces.auth import Access, AuthInterceptor, TokenTable
from nanovllm.router.faces.generation import GenerationService
from nanovllm.router.faces.http_api import HttpApi, start_http
from nanovllm.router.faces.process_group import ProcessRole
from nanovllm.router.faces.response_store import open_response_store
from nanovllm.router.fleet.pool import WorkerPool
from nanovllm.v1 import generate_pb2, generate_pb2_grpc

if TYPE_CHECKING:
    from nanovllm.router.faces.http_api import _Server

log = get_logger(__name__)


def _access(config: RouterConfig, metrics: RouterMetrics) -> tuple[Access, list[grpc.aio.ServerInterceptor]]:
    """Auth (with a tokens file: every call but health and reflection needs a token) and the per-token
    limits; the tokens file is read here, so a bad one fails the start naming the file."""

    def denied(reason: str) -> None:
        metrics.access_denied.labels(reason=reason).inc()

    table = TokenTable(config.auth_tokens_file) if config.auth_tokens_file else None
    limits = TokenLimits(config.max_streams_per_token, config.tokens_per_minute_per_token)
    interceptors = [AuthInterceptor(table, denied)] if table is not None else []
    return Access(table, limits, denied), interceptors


def _worker_pool(config: RouterConfig, on_change: Callable[[bool], None]) -> WorkerPool:
    """The pool, over mutual TLS when configured: its files are checked here, so a bad one fails the start
    naming the file rather than every connection attempt."""
    if config.worker_tls.enabled:
        config.worker_tls.check(need_identity=True, need_ca=True)  # workers always ask for a certificate
    return WorkerPool(
        config.workers,
        on_change,
        config.routing,
        config.discovery_interval_s,
        config.worker_tls,
        config.worker_tls_server_name,
    )


class _Router:
    """One router process's parts: metrics, access, the gRPC server with the Generation and Admin
    services, the worker pool, the HTTP face when asked for, tracing."""

    def __init__(self, config: RouterConfig, role: ProcessRole) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.access, interceptors = _access(config, self.metrics)
        admin_tokens = TokenTable(config.admin_tokens_file) if config.admin_tokens_file else None
        self.server = GrpcServer(
            [generate_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("Generation", "Admin")],
            keepalive_time_s=config.keepalive_time_s,
            keepalive_timeout_s=config.keepalive_timeout_s,
            credentials=server_credentials(config.tls, require_client_cert=bool(config.tls_client_ca)),
            interceptors=interceptors,
            share_port=role.shares_port,
        )
        self.reached = asyncio.Event()  # a worker connected
        self.service: GenerationService | None = None

        def on_change(serving: bool) -> None:
            if serving:
                self.reached.set()
            if self.service is not None and not self.service.draining and role.all_listening:
                asyncio.get_running_loop().create_task(self.server.set_serving(serving))

        self.pool = _worker_pool(config, on_change)
        self.metrics.watch_workers(lambda: self.pool.workers)
        self.tracing = start_tracing(config.tracing, "nanovllm-router")
        tracer = self.tracing.tracer if self.tracing is not None else None
        self.service = GenerationService(self.pool, self.metrics, config, self.access, tracer)
        generate_pb2_grpc.add_GenerationServicer_to_server(self.service, self.server.server)
        generate_pb2_grpc.add_AdminServicer_to_server(
            AdminService(self.pool, admin_tokens), self.server.server
        )
        self.http: _Server | None = None

    async def listen(
        self, role: ProcessRole, on_listening: Callable[[str, str], None]
    ) -> dict[str, int | None]:
        """Bind the gRPC port (and the HTTP one); the ports bound, for the other processes."""
        config, announce, http_address = self.config, on_listening, None
        if config.http_port is not None:
            tls = (
                ReloadingSslContext.serving(config.tls, require_client_cert=bool(config.tls_client_ca))
                if config.tls.enabled
                else None
            )
            assert self.service is not None  # set in __init__
            api = HttpApi(self.service, open_response_store(config))
            self.http, http_address = await start_http(
                api, config.host, config.http_port, tls, share_port=role.shares_port
            )

            def announce(address: str, metrics_address: str) -> None:
                on_listening(address, f"{metrics_address}, http on {http_address}")

        health_port, metrics_port = role.health_and_metrics_ports
        address, metrics_address = await self.server.listen(
            config.host, config.port, health_port, self.metrics.registry, metrics_port, announce
        )
        self.address = address
        log.info(
            "router_serving",
            address=address,
            metrics=metrics_address,
            workers=config.workers,
            tls=config.tls.enabled,
            worker_tls=config.worker_tls.enabled,
            auth=self.access.table is not None,
        )
        return {"port": _port(address), "http_port": None if http_address is None else _port(http_address)}

    async def drain(self, role: ProcessRole) -> None:
        """NOT_SERVING, new calls UNAVAILABLE, calls in flight finish within the drain timeout; then
        everything stops."""
        config = self.config
        role.stop_others()  # they drain alongside
        assert self.service is not None  # set in __init__
        self.service.draining = True
        idle = self.service.idle.wait()
        await self.server.drain(
            "router", self.address, idle, config.drain_timeout_s, in_flight=self.service.in_flight
        )
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(config.shutdown_grace_s)
        await role.wait_for_others_to_exit(config.drain_timeout_s + config.shutdown_grace_s)
        await self.pool.close()
        self.service.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # sends the spans not yet sent


async def serve_router(
    config: RouterConfig, log_config: LogConfig, stop: asyncio.Event, on_listening: Callable[[str, str], None]
) -> None:
    """Listen, connect to the workers (health is SERVING while at least one is connected), serve until
    `stop` is set, then drain. With several processes, ProcessRole (router/faces/process_group.py) says
    when this one listens and serves."""
    role = ProcessRole(config, log_config, serve_router)
    router = _Router(config, role)
    await role.before_listening(router.pool, router.reached, stop)
    ports = await router.listen(role, on_listening)
    await role.after_listening(router.server, router.pool, ports, stop)
    await stop.wait()
    await router.drain(role)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])
