"""Which worker takes a request: the one where it costs least, counting the prefix cache against the load.

    cost(w) = uncached_tokens(w) + offloaded_token_cost * offloaded_tokens(w) + queued_request_cost * queue(w)

- uncached_tokens(w): the prompt tokens worker w would have to prefill, that is the prompt's length less
  the leading tokens its prefix cache holds. The count is exact: workers report every block hash they store
  and evict (common/block_hash.py), and until they report them, the blocks of this router's own requests
  in flight there count as cached (the worker is computing them);
- offloaded_tokens(w): the tokens after those that w holds in its host-memory or disk tier
  (docs/kv-offload.md): copied back up, which costs less than computing them (offloaded_token_cost, 0.25
  by default, of a computed token) and more than a device hit;
- queue(w): requests waiting or running there, every router's included (the worker's own report plus what
  this router sent since, never fewer than this router's own requests there);
- queued_request_cost: how many prefill tokens one queued request is worth (default 64).

So a worker holding a long shared prefix keeps winning until its queue is about prefix /
queued_request_cost requests longer than the others' (16 for a 1,024-token prefix at the default);
requests that share nothing go to the shortest queue. On top of that, a hotspot guard: a worker whose
queue is over both `hotspot_ratio` times the mean and the mean plus `hotspot_slack` takes nothing new
while a cooler one is available, so one hot prefix in a burst spreads instead of piling onto the worker
that cached it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from nanovllm.common.block_hash import PromptImage, prefix_hashes
from nanovllm.common.server_config import RoutingConfig, RoutingPolicy


class Candidate(Protocol):
    address: str

    @property
    def queue_estimate(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int: ...

    def offloaded_prefix_blocks(self, hashes: Sequence[int]) -> int: ...

    @property
    def num_cached_blocks(self) -> int: ...


C = TypeVar("C", bound=Candidate)  # the pool's workers (WorkerConnection), which the decision hands back


@dataclass(frozen=True)
class Decision(Generic[C]):
    """The chosen worker and what the choice was based on (for the logs and metrics)."""

    worker: C
    expected_hit_tokens: int
    cost: float
    candidates: int
    block_hashes: Sequence[int] = ()  # the request's block hashes at the worker's block size


def choose(
    candidates: Sequence[C],
    token_ids: Sequence[int],
    config: RoutingConfig,
    turn: int = 0,
    cache_salt: int | None = None,
    images: Sequence[PromptImage] = (),
) -> Decision[C] | None:
    """The worker for a request whose prompt (plus any tokens it already generated) is `token_ids`, by
    the configured policy (`turn` counts the router's requests, for round-robin); None without
    candidates. `cache_salt`: where its block hashes start (its LoRA adapter's, common/block_hash.py);
    `images`: the prompt's, whose content its blocks' hashes cover."""
    if not candidates:
        return None
    if config.policy == RoutingPolicy.ROUND_ROBIN:
        return Decision(candidates[turn % len(candidates)], 0, 0.0, len(candidates))
    if config.policy == RoutingPolicy.LEAST_LOADED:
        worker = min(candidates, key=lambda w: w.queue_estimate)
        return Decision(worker, 0, float(worker.queue_estimate), len(candidates))
    return _cheapest(candidates, _HashesBySize(token_ids, cache_salt, images), config)


def _cheapest(candidates: Sequence[C], hashes: _HashesBySize, weights: RoutingConfig) -> Decision[C] | None:
    """The least cost; among equals, the emptiest prefix cache, so that new prefixes spread over the
    workers instead of all landing on the first (and evicting each other there)."""
    pool = _without_hotspots(candidates, weights)
    token_ids = hashes.token_ids
    best: tuple[float, int] | None = None
    decision: Decision[C] | None = None
    for worker in pool:
        blocks = hashes(worker.block_size)
        hit_blocks = worker.cached_prefix_blocks(blocks)
        hit = hit_blocks * worker.block_size
        offloaded = worker.offloaded_prefix_blocks(blocks[hit_blocks:]) * worker.block_size
        cost = (
            (len(token_ids) - hit - offloaded)
            + weights.offloaded_token_cost * offloaded
            + weights.queued_request_cost * worker.queue_estimate
        )
        if best is None or (cost, worker.num_cached_blocks) < best:
            best = (cost, worker.num_cached_blocks)
            decision = Decision(worker, hit, cost, len(pool), hashes(worker.block_size))
    return decision


def _without_hotspots(candidates: Sequence[C], weights: RoutingConfig) -> list[C]:
    queues = [w.queue_estimate for w in candidates]
    mean = sum(queues) / len(queues)
    limit = max(weights.hotspot_ratio * mean, mean + weights.hotspot_slack)
    cool = [w for w, q in zip(candidates, queues) if q <= limit]
    return cool or list(candidates)


class _HashesBySize:
    """The prompt's block hashes, computed once per block size in use. The last token is left out, as the
    worker's prefix cache does: at least one token is always computed, to yield logits."""

    def __init__(self, token_ids: Sequence[int], salt: int | None, images: Sequence[PromptImage]) -> None:
        self.token_ids = token_ids
        self._salt = salt
        self._images = images
        self._by_size: dict[int, list[int]] = {}

    def __call__(self, block_size: int) -> list[int]:
        if block_size not in self._by_size:
            usable = max(len(self.token_ids) - 1, 0)
            self._by_size[block_size] = prefix_hashes(
                self.token_ids[:usable], block_size, salt=self._salt, images=self._images
            )
        return self._by_size[block_size]
