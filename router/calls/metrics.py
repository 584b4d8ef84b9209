"""The router's Prometheus metrics: requests by outcome and the latencies clients see."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from nanovllm.common.metrics import LATENCY_BUCKETS


class _WorkerView:
    """Per-worker gauges read at scrape time from the workers the router has then (they come and go with
    discovery)."""

    def __init__(self, workers: Callable[[], list]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queue = GaugeMetricFamily(
            "nanovllm:worker_queue",
            "Requests waiting or running on each worker, all routers' included, as this router routes on it",
            labels=["worker"],
        )
        cached = GaugeMetricFamily(
            "nanovllm:worker_cached_blocks",
            "KV blocks in each worker's prefix cache, as the worker reported them to this router",
            labels=["worker"],
        )
        offloaded = GaugeMetricFamily(
            "nanovllm:worker_offloaded_blocks",
            "KV blocks in each worker's host-memory and disk tiers, as the worker reported them to this router",
            labels=["worker"],
        )
        for worker in self._workers():
            queue.add_metric([worker.address], worker.queue_estimate)
            cached.add_metric([worker.address], worker.num_cached_blocks)
            offloaded.add_metric([worker.address], len(worker.offloaded_blocks))
        yield from (queue, cached, offloaded)


class RouterMetrics:
    """The metrics this process counts into; `registry` is what its /metrics serves: these, or with several
    router processes (router/faces/process_group.py) the sum of every process's."""

    def __init__(self) -> None:
        counted = CollectorRegistry()
        self.requests = Counter(
            "nanovllm:requests",
            "Generate calls by outcome: stop, length, cancelled, error, tool_calls (finish reasons), or the gRPC status "
            "of a failed call (invalid_argument, unavailable, resource_exhausted, internal, client_cancelled, stalled); "
            "api: the face it came through, grpc or http (the OpenAI-compatible API)",
            ["status", "api"],
            registry=counted,
        )
        self.time_to_first_token = Histogram(
            "nanovllm:time_to_first_token_seconds",
            "Time from receiving a Generate call to sending its first token",
            buckets=LATENCY_BUCKETS,
            registry=counted,
        )
        self.inter_token_latency = Histogram(
            "nanovllm:inter_token_latency_seconds",
            "Time between successive tokens of one stream (per token)",
            buckets=LATENCY_BUCKETS,
            registry=counted,
        )
        self.e2e_request_latency = Histogram(
            "nanovllm:e2e_request_latency_seconds",
            "Time from receiving a Generate call to its last response",
            buckets=LATENCY_BUCKETS,
            registry=counted,
        )
        self.retries = Counter(
            "nanovllm:request_retries",
            "Requests moved to another worker before their first token, by why: worker_lost, "
            "worker_unavailable (draining), worker_full (its queue)",
            ["reason"],
            registry=counted,
        )
        self.resumes = Counter(
            "nanovllm:request_resumes",
            "Streams moved to another worker mid-generation, with the tokens they had, by why: worker_lost, "
            "worker_unavailable, worker_full (the new worker refused it and it moved again)",
            ["reason"],
            registry=counted,
        )
        self.prompt_tokens = Counter(
            "nanovllm:prompt_tokens",
            "Prompt tokens of the calls that produced a token",
            registry=counted,
        )
        self.expected_hit_tokens = Counter(
            "nanovllm:routing_expected_hit_tokens",
            "Prompt tokens routing expected the chosen worker's prefix cache to hold",
            registry=counted,
        )
        self.cached_prompt_tokens = Counter(
            "nanovllm:cached_prompt_tokens",
            "Prompt tokens the workers found in their prefix cache (the achieved hits)",
            registry=counted,
        )
        self.access_denied = Counter(
            "nanovllm:access_denied",
            "Calls refused before any work, by why: unauthenticated (no bearer token), permission_denied "
            "(an unknown token), stream_limit, token_rate_limit (per-token limits)",
            ["reason"],
            registry=counted,
        )
        self.pooling_requests = Counter(
            "nanovllm:pooling_requests",
            "Embed and Score calls (/v1/embeddings, /v1/rerank, /score and gRPC) by kind (embed, score) and "
            "outcome: ok, or the status of a failed call (invalid_argument, unavailable, ...); api: grpc or http",
            ["kind", "status", "api"],
            registry=counted,
        )
        self.pooling_latency = Histogram(
            "nanovllm:pooling_request_latency_seconds",
            "Time from receiving an Embed or Score call to its answer, by kind",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=counted,
        )
        self.pooling_inputs = Counter(
            "nanovllm:pooling_inputs",
            "Inputs (texts or token-id lists embedded, documents scored) of the Embed and Score calls answered",
            ["kind"],
            registry=counted,
        )
        self.pooling_prompt_tokens = Counter(
            "nanovllm:pooling_prompt_tokens",
            "Prompt tokens of the Embed and Score calls answered (instruction formats included)",
            ["kind"],
            registry=counted,
        )
        self.requests_in_flight = Gauge(
            "nanovllm:requests_in_flight",
            "Generate calls in flight on each worker",
            ["worker"],
            registry=counted,
            multiprocess_mode="livesum",
        )
        self.registry = counted
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")  # set by router/faces/process_group.py
        if shared:
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry, shared)

    def watch_workers(self, workers: Callable[[], list]) -> None:
        """Export nanovllm:worker_queue and nanovllm:worker_cached_blocks for the workers `workers()` gives."""
        self.registry.register(_WorkerView(workers))
