"""What the router's and the worker's gRPC servers share: health, reflection, binding and signals."""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from nanovllm.common.logging import get_logger
from nanovllm.common.metrics import serve_metrics

log = get_logger(__name__)

# A health service name that is SERVING for as long as the process runs, for liveness probes: "" (and the
# API's own name) follow readiness, which a router loses whenever every worker is down.
LIVENESS_SERVICE = "nanovllm.liveness"


def keepalive_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """HTTP/2 keepalive: the server pings each connection every `time_s` and drops it when a ping goes
    unanswered for `timeout_s`, cancelling its calls, so a frozen or vanished peer (a stopped process still
    has its TCP connection) does not hold requests and KV cache until TCP gives up. Clients may ping every
    5 s. The server keeps pinging while it has no data to send (by default it stops after two pings
    without data): a frozen client's full flow-control window is exactly such a silence.

    gRPC core itself waits `grpc.http2.ping_timeout_ms` (one minute by default) for a ping's ack, not
    `grpc.keepalive_timeout_ms`, which it applies only as the socket's TCP_USER_TIMEOUT: that fires only
    once sent bytes go unacknowledged, i.e. once the peer's kernel receive buffer is full. A stream of
    small responses may never fill it (docs/reliability.md), so the ack deadline is set here too."""
    return [
        ("grpc.keepalive_time_ms", int(time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        *ping_ack_deadline(timeout_s),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def ping_ack_deadline(timeout_s: float) -> list[tuple[str, int]]:
    """The channel option that makes an HTTP/2 ping unanswered for `timeout_s` close the connection
    (see keepalive_options), for servers and clients alike."""
    return [("grpc.http2.ping_timeout_ms", int(timeout_s * 1000))]


# The largest request a public port takes: a gRPC message, or the router's HTTP body.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class _Unparsed(NamedTuple):
    """A request message whose bytes did not parse, handed to the handler in place of the message."""

    error: str


class RejectUnparsable(grpc.aio.ServerInterceptor):
    """Answers a request message that does not parse (invalid UTF-8 in a string field, truncated bytes)
    with INVALID_ARGUMENT, where grpc itself answers UNKNOWN: each method's deserializer returns _Unparsed
    instead of raising, and the method's handler, wrapped, aborts on it. For grpc.aio handlers (coroutines
    and async generators)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        kind = "_".join(
            "stream" if s else "unary" for s in (handler.request_streaming, handler.response_streaming)
        )
        behavior = getattr(handler, kind)

        def lenient(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError as exc:
                return _Unparsed(str(exc))

        async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Unparsed):
                message = f"the request could not be parsed ({request.error})"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            return request

        async def check_each(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async for request in requests:
                yield await check(request, context)

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return (
                check_each(request, context) if handler.request_streaming else await check(request, context)
            )

        async def streamed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behavior(await checked(request, context), context):
                yield response

        # otherwise a coroutine (a unary response, or one written with context.write)
        async def returned(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await checked(request, context), context)

        call = streamed if inspect.isasyncgenfunction(behavior) else returned
        return handler._replace(request_deserializer=lenient, **{kind: call})


class GrpcServer:
    """A grpc.aio server with the standard health service (NOT_SERVING until `set_serving(True)`),
    server reflection for the given service names, and INVALID_ARGUMENT for requests that do not parse.

    With `credentials` its port speaks TLS only (common/tls.py); `interceptors` run before the
    unparsable-request check. `start_health` adds a second, plaintext server with the health service alone,
    for probes that cannot speak TLS: it shares the same statuses."""

    def __init__(
        self,
        service_names: list[str],
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        keepalive_time_s: float = 20.0,
        keepalive_timeout_s: float = 10.0,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        share_port: bool = False,
    ) -> None:
        """`share_port`: SO_REUSEPORT, for several processes of one server (router/faces/process_group.py). Without
        it (gRPC's default is on) a second server on a port in use fails to start instead of silently
        sharing the port with the first."""
        options = [
            ("grpc.so_reuseport", int(share_port)),
            ("grpc.max_receive_message_length", max_receive_bytes),
            *keepalive_options(keepalive_time_s, keepalive_timeout_s),
        ]
        self.server = grpc.aio.server(options=options, interceptors=[*interceptors, RejectUnparsable()])
        self._credentials = credentials
        self._health_server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self._service_names = service_names
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self.server)

    async def start(self, host: str, port: int) -> str:
        """Bind (port 0 picks a free one), start, and return the address actually listened on."""
        bound = _bind(self.server, host, port, self._credentials)
        await self.server.start()
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        return f"{host}:{bound}"

    async def listen(
        self,
        host: str,
        port: int,
        health_port: int | None,
        registry: CollectorRegistry,
        metrics_port: int | None,
        on_listening: Callable[[str, str], None],
    ) -> tuple[str, str]:
        """Start the API port (NOT_SERVING), the plaintext health port and the /metrics endpoint when
        each is asked for, then report and return the API's and the metrics' addresses ("" for none)."""
        address = await self.start(host, port)
        try:
            if health_port is not None:
                log.info("health_listening", address=await self.start_health(host, health_port))
            metrics_address = "" if metrics_port is None else serve_metrics(registry, host, metrics_port)
        except BaseException:  # a port taken: stop what started, while the event loop still runs
            await self.stop(0)
            raise
        on_listening(address, metrics_address)
        return address, metrics_address

    async def drain(
        self, role: str, address: str, idle: Awaitable[object], timeout_s: float, **fields: object
    ) -> None:
        """NOT_SERVING at once (routers, clients and probes stop sending), then wait at most `timeout_s`
        for `idle` (the calls in flight finished); logged as `<role>_draining`, `<role>_drain_timeout`
        and `<role>_stopping`. The caller stops what is left."""
        await self.set_serving(False)
        log.info(f"{role}_draining", address=address, timeout_s=timeout_s, **fields)
        try:
            await asyncio.wait_for(idle, timeout_s)
        except asyncio.TimeoutError:
            log.warning(f"{role}_drain_timeout", timeout_s=timeout_s)
        log.info(f"{role}_stopping", address=address)

    async def start_health(self, host: str, port: int) -> str:
        """The plaintext health-only port; returns the address it listens on."""
        self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        bound = _bind(self._health_server, host, port, None)
        await self._health_server.start()
        return f"{host}:{bound}"

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:  # "" is the whole server, as probes ask for it
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    try:
        if credentials is None:
            return server.add_insecure_port(f"{host}:{port}")
        return server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as exc:  # grpc's "Failed to bind"
        raise OSError(f"cannot listen on {host}:{port} (is another server using that port?)") from exc


def stop_event_on_signals() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT (Ctrl-C), for the running event loop's main coroutine."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
