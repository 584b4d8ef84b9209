"""The public gRPC service (nanovllm.v1.Generation): tokenizes, routes to a worker, streams text back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import structlog
from opentelemetry.trace import Tracer

from nanovllm.common.logging import LogConfig, get_logger
from nanovllm.common.server_config import RouterConfig
from nanovllm.common.serving import GrpcServer
from nanovllm.common.tls import ReloadingSslContext, server_credentials
from nanovllm.common.tracing import start_tracing
from nanovllm.common.wire import fields_to_message
from nanovllm.router.admin import AdminService
from nanovllm.router.auth import Access, AuthInterceptor, TokenTable
from nanovllm.router.call import GenerateCall, ModelRefused, reject, resolve_model
from nanovllm.router.catalog import ModelChoice
from nanovllm.router.http_api import HttpApi, start_http
from nanovllm.router.limits import TokenLimits
from nanovllm.router.metrics import RouterMetrics
from nanovllm.router.pool import WorkerPool
from nanovllm.router.processes import KILL_AFTER_S, RouterProcesses
from nanovllm.router.tokenizer import auto_tokenizer
from nanovllm.router.tool_calls import check_tools
from nanovllm.router.validation import NoTokenizerError, check_prompt_size, prompt_token_ids
from nanovllm.v1 import generate_pb2, generate_pb2_grpc

log = get_logger(__name__)
T = TypeVar("T")


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        pool: WorkerPool,
        metrics: RouterMetrics,
        config: RouterConfig,
        access: Access,
        tracer: Tracer | None = None,
    ) -> None:
        """`tracer`: the calls' spans go there (None: tracing is off)."""
        self.pool = pool
        self.tracer = tracer
        self.metrics = metrics
        self.config = config
        self.access = access  # who calls (auth) and whether their limits allow another stream
        self.draining = False
        self._in_flight = 0
        self.idle = asyncio.Event()  # set while no Generate call is in flight
        self.idle.set()
        self._tokenizers = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    async def _model(self, name: str, context: grpc.aio.ServicerContext) -> ModelChoice:
        """What `name` selects, or the call ended with the status that says why (router/call.py)."""
        try:
            return resolve_model(self.pool, name)
        except ModelRefused as exc:
            await context.abort(exc.code, str(exc))
        raise AssertionError("context.abort returns only by raising")

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, *args)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self.generate(request, context, "grpc")

    async def generate(self, request: generate_pb2.GenerateRequest, context: Any, api: str) -> None:
        """One Generate call, for either face: `context` is the gRPC call's, or the HTTP face's stand-in
        (router/http_api.py CallContext); `api` names the face (grpc, http) in metrics and logs."""
        if self.draining:
            message = "the router is shutting down; retry"
            await reject(context, self.metrics, api, grpc.StatusCode.UNAVAILABLE, message)
        lease = await self.access.admit(context)
        self._in_flight += 1
        self.idle.clear()
        try:
            call = GenerateCall(
                request,
                context,
                lease,
                self.pool,
                self.metrics,
                self.config,
                self._off_loop,
                api,
                self.tracer,
            )
            await call.run()
        finally:
            lease.close()
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        model = await self._model(request.model, context)
        tokenizer, info = model.base.tokenizer, model.base.info
        try:
            check_prompt_size(request, self.config.limits, info.max_model_len)
            tools = check_tools(request.chat) if request.WhichOneof("prompt") == "chat" else None
            ids = await self._off_loop(prompt_token_ids, request, tokenizer, info.model, tools)
        except NoTokenizerError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelInfo:
        model = await self._model(request.model, context)
        workers = sum(model.served_by(w) for w in self.pool.available)
        return fields_to_message(
            model.base.info, generate_pb2.ModelInfo, num_workers=workers, model=model.name
        )

    async def ListModels(
        self, request: generate_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelList:
        return generate_pb2.ModelList(
            models=[
                generate_pb2.ServedModel(name=s.name, parent=s.parent, num_workers=s.num_workers)
                for s in self.pool.catalog.served()
            ]
        )


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


async def serve_router(
    config: RouterConfig, log_config: LogConfig, stop: asyncio.Event, on_listening: Callable[[str, str], None]
) -> None:
    """Listen, connect to the workers (health is SERVING while at least one is connected), serve until
    `stop` is set, then drain: NOT_SERVING, new calls UNAVAILABLE, calls in flight finish within the
    drain timeout.

    With several processes (router/processes.py) the first one starts the others once it listens, and is
    SERVING only once they listen too, so that clients connecting then are dealt to all of them; the others
    listen on the public port alone, and only once they reach a worker. `stop` stops them all."""
    first = config.process_index == 0
    if config.processes > 1:  # each log line says which process wrote it
        structlog.contextvars.bind_contextvars(router_process=config.process_index)
    metrics = RouterMetrics()
    access, interceptors = _access(config, metrics)
    admin_tokens = TokenTable(config.admin_tokens_file) if config.admin_tokens_file else None
    server = GrpcServer(
        [generate_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("Generation", "Admin")],
        keepalive_time_s=config.keepalive_time_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
        credentials=server_credentials(config.tls, require_client_cert=bool(config.tls_client_ca)),
        interceptors=interceptors,
        share_port=config.processes > 1,
    )
    service: GenerationService | None = None
    others: RouterProcesses | None = None
    reached = asyncio.Event()  # a worker connected

    def on_change(serving: bool) -> None:
        if serving:
            reached.set()
        if service is not None and not service.draining and (others is None or others.listening):
            asyncio.get_running_loop().create_task(server.set_serving(serving))

    pool = _worker_pool(config, on_change)
    metrics.watch_workers(lambda: pool.workers)
    tracing = start_tracing(config.tracing, "nanovllm-router")
    service = GenerationService(pool, metrics, config, access, tracing and tracing.tracer)
    generate_pb2_grpc.add_GenerationServicer_to_server(service, server.server)
    generate_pb2_grpc.add_AdminServicer_to_server(AdminService(pool, admin_tokens), server.server)
    preloading = asyncio.create_task(asyncio.to_thread(auto_tokenizer))  # overlaps the workers' start-up
    if not first:
        pool.start()
        await _first_of(reached.wait(), stop.wait())
    http = None
    announce = on_listening
    if config.http_port is not None:
        tls = (
            ReloadingSslContext.serving(config.tls, require_client_cert=bool(config.tls_client_ca))
            if config.tls.enabled
            else None
        )
        http, http_address = await start_http(
            HttpApi(service), config.host, config.http_port, tls, share_port=config.processes > 1
        )

        def announce(address: str, metrics_address: str) -> None:
            on_listening(address, f"{metrics_address}, http on {http_address}")

    address, metrics_address = await server.listen(
        config.host,
        config.port,
        config.health_port if first else None,
        metrics.registry,
        config.metrics_port if first else None,
        announce,
    )
    if first:
        if config.processes > 1:
            ports = {"port": _port(address), "http_port": None if http is None else _port(http_address)}
            others = RouterProcesses(serve_router, config, log_config, ports)
            others.start()
        pool.start()
    else:
        await server.set_serving(bool(pool.available))
    log.info(
        "router_serving",
        address=address,
        metrics=metrics_address,
        workers=config.workers,
        tls=config.tls.enabled,
        worker_tls=config.worker_tls.enabled,
        auth=access.table is not None,
    )
    if others is not None:
        await _first_of(others.all_listening(), stop.wait())
        await server.set_serving(bool(pool.available) and others.listening)
    await stop.wait()
    if others is not None:
        others.stop()  # they drain alongside
    service.draining = True
    idle = service.idle.wait()
    await server.drain("router", address, idle, config.drain_timeout_s, in_flight=service.in_flight)
    if http is not None:
        await http.stop()
    await server.stop(config.shutdown_grace_s)
    if others is not None:
        await others.wait(config.drain_timeout_s + config.shutdown_grace_s + KILL_AFTER_S)
    await pool.close()
    service.close()
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)  # sends the spans not yet sent
    await preloading


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def _first_of(*waits: Coroutine[Any, Any, object]) -> None:
    """Return when any of `waits` is done; the rest are cancelled."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
