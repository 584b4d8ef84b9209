"""What the router's and the worker's gRPC servers share: health, reflection, binding and signals."""

from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# A health service name that is SERVING for as long as the process runs, for liveness probes: "" (and the
# API's own name) follow readiness, which a router loses whenever every worker is down.
LIVENESS_SERVICE = "nanovllm.liveness"


# HTTP/2 keepalive: the server pings each connection every 20 s and drops it when a ping goes unanswered
# for 10 s, cancelling its calls, so a frozen or vanished peer (a stopped process still has its TCP
# connection) does not hold requests and KV cache until TCP gives up. Clients may ping every 5 s.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


class GrpcServer:
    """A grpc.aio server with the standard health service (NOT_SERVING until `set_serving(True)`) and
    server reflection for the given service names."""

    def __init__(self, service_names: list[str], max_receive_bytes: int = 4 * 1024 * 1024) -> None:
        # Without SO_REUSEPORT (gRPC's default is on) a second server on a port in use fails to start
        # instead of silently sharing the port with the first.
        options = [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_receive_bytes),
            *KEEPALIVE_OPTIONS,
        ]
        self.server = grpc.aio.server(options=options)
        self.health = health.aio.HealthServicer()
        self._service_names = service_names
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self.server)

    async def start(self, host: str, port: int) -> str:
        """Bind (port 0 picks a free one), start, and return the address actually listened on."""
        try:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:  # grpc's "Failed to bind"
            raise OSError(f"cannot listen on {host}:{port} (is another server using that port?)") from exc
        await self.server.start()
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
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


def stop_event_on_signals() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT (Ctrl-C), for the running event loop's main coroutine."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
