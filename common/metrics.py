"""Prometheus exposition shared by the router and the worker: a per-process registry served over HTTP.

Each process owns its CollectorRegistry (passed explicitly, not prometheus_client's global one). Metric
names follow vLLM's where a user would compare (`nanovllm:` instead of `vllm:`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

# Latency buckets (seconds) wide enough for a CPU serving long prompts and a GPU serving short ones.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> str:
    """Serve /metrics on a daemon thread (port 0 picks a free one); returns the address bound."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"cannot serve /metrics on {host}:{port}: {exc.strerror}") from exc
    return f"{host}:{server.server_port}"
