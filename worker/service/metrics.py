"""The worker's Prometheus metrics, updated by the engine thread after every step."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanovllm.common.metrics import LATENCY_BUCKETS
from nanovllm.worker.step import EngineLoad, KVTierStats, StepStats


class _KVTierView:
    """The prefix cache's lower tiers (EngineLoad.kv_tiers), read at scrape time from the engine's last
    load."""

    def __init__(self, tiers: Callable[[], dict[str, KVTierStats]]) -> None:
        self._tiers = tiers

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        name = "nanovllm:kv_tier_"
        hits = CounterMetricFamily(name + "hits", "Blocks copied up from each tier on a hit", labels=["tier"])
        moved = CounterMetricFamily(
            name + "bytes",
            "Bytes copied down to (down) and up from (up) each tier",
            labels=["tier", "direction"],
        )
        seconds = CounterMetricFamily(
            name + "seconds",
            "Engine-thread seconds spent queueing copies down (down) and copying up (up), by tier",
            labels=["tier", "direction"],
        )
        faults = CounterMetricFamily(
            name + "faults", "Faults by tier and kind, each served by recomputation", labels=["tier", "kind"]
        )
        blocks = GaugeMetricFamily(name + "blocks", "Blocks each tier holds", labels=["tier"])
        for tier, stats in self._tiers().items():
            hits.add_metric([tier], stats.hits)
            moved.add_metric([tier, "down"], stats.bytes_down)
            moved.add_metric([tier, "up"], stats.bytes_up)
            seconds.add_metric([tier, "down"], stats.seconds_down)
            seconds.add_metric([tier, "up"], stats.seconds_up)
            for kind, count in stats.faults.items():
                faults.add_metric([tier, kind], count)
            blocks.add_metric([tier], stats.blocks)
        yield from (hits, moved, seconds, faults, blocks)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_requests_waiting = Gauge("nanovllm:num_requests_waiting", "Requests waiting", registry=r)
        self.num_requests_running = Gauge("nanovllm:num_requests_running", "Requests running", registry=r)
        self.kv_cache_usage_perc = Gauge(
            "nanovllm:kv_cache_usage_perc", "Share of KV-cache blocks in use, 0 to 1", registry=r
        )
        self.prefix_cache_hit_rate = Gauge(
            "nanovllm:prefix_cache_hit_rate",
            "Share of prompt tokens served from the prefix cache since start, 0 to 1",
            registry=r,
        )
        self.state_snapshot_usage_perc = Gauge(
            "nanovllm:state_snapshot_usage_perc",
            "A hybrid model's: share of the rows kept for state snapshots that hold one, 0 to 1",
            registry=r,
        )
        self.state_snapshot_bytes = Gauge(
            "nanovllm:state_snapshot_bytes",
            "A hybrid model's: bytes of the state snapshots held (each rank's share)",
            registry=r,
        )
        self.num_preemptions = Counter("nanovllm:num_preemptions", "Preempted requests", registry=r)
        self.prompt_tokens = Counter("nanovllm:prompt_tokens", "Prompt tokens computed", registry=r)
        self.generation_tokens = Counter("nanovllm:generation_tokens", "Tokens generated", registry=r)
        self.spec_draft_tokens = Counter(
            "nanovllm:spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "nanovllm:spec_decode_num_accepted_tokens",
            "Proposed tokens that verification kept (each saves one forward pass)",
            registry=r,
        )
        self.step_time = Histogram(
            "nanovllm:engine_step_seconds", "Time of one engine step", buckets=LATENCY_BUCKETS, registry=r
        )
        self._preemptions_seen = 0
        self._kv_tiers: dict[str, KVTierStats] = {}

    def watch_kv_tiers(self) -> None:
        """Export the lower tiers' hits, traffic, faults and sizes (nanovllm:kv_tier_*), as of the last
        observed load."""
        self.registry.register(_KVTierView(lambda: self._kv_tiers))

    def observe_step(self, stats: StepStats, step_s: float, num_generated: int) -> None:
        self.prompt_tokens.inc(stats.num_prefill_tokens)
        self.generation_tokens.inc(num_generated)
        self.spec_draft_tokens.inc(stats.num_spec_proposed)
        self.spec_accepted_tokens.inc(stats.num_spec_accepted)
        self.step_time.observe(step_s)

    def observe_load(self, load: EngineLoad) -> None:
        self.num_requests_waiting.set(load.num_waiting)
        self.num_requests_running.set(load.num_running)
        total = load.kv_blocks_used + load.kv_blocks_free
        self.kv_cache_usage_perc.set(load.kv_blocks_used / total if total else 0.0)
        self.prefix_cache_hit_rate.set(load.prefix_cache_hit_rate)
        rows = load.state_snapshot_rows
        self.state_snapshot_usage_perc.set(load.state_snapshots / rows if rows else 0.0)
        self.state_snapshot_bytes.set(load.state_snapshot_bytes)
        self.num_preemptions.inc(load.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = load.num_preemptions
        self._kv_tiers = load.kv_tiers
