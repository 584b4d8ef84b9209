"""Which worker takes a request: the one where it costs least, counting the prefix cache against the load.

    cost(w) = uncached_tokens(w) + queued_request_cost * queue(w)

- uncached_tokens(w): the prompt tokens worker w would have to prefill, that is the prompt's length less
  the tokens its prefix cache holds (an exact count: workers report every block hash they store and evict,
  see common/block_hash.py);
- queue(w): requests waiting or running there, every router's included (the worker's own report plus what
  this router sent since);
- queued_request_cost: how many prefill tokens one queued request is worth.

So a worker holding a long shared prefix keeps winning until its queue is about prefix /
queued_request_cost requests longer than the others'; requests that share nothing go to the shortest
queue. On top of that, a hotspot guard: a worker whose queue is over `hotspot_ratio` times the mean
(and `hotspot_slack` requests above it) takes nothing new while a cooler one is available, so one hot
prefix in a burst spreads instead of piling onto the worker that cached it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from nanovllm.common.block_hash import prefix_hashes
from nanovllm.common.server_config import RoutingWeights


class Candidate(Protocol):
    address: str

    @property
    def queue_estimate(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int: ...


@dataclass(frozen=True)
class Decision:
    """The chosen worker and what the choice was based on (for the logs and metrics)."""

    worker: Candidate
    expected_hit_tokens: int
    cost: float
    candidates: int


def choose(
    candidates: Sequence[Candidate], token_ids: Sequence[int], weights: RoutingWeights
) -> Decision | None:
    """The cheapest worker for a request whose prompt (plus any tokens it already generated) is
    `token_ids`; None without candidates."""
    if not candidates:
        return None
    pool = _without_hotspots(candidates, weights)
    hashes = _HashesBySize(token_ids)
    best: Decision | None = None
    for worker in pool:
        hit = worker.cached_prefix_blocks(hashes(worker.block_size)) * worker.block_size
        cost = (len(token_ids) - hit) + weights.queued_request_cost * worker.queue_estimate
        if best is None or cost < best.cost:
            best = Decision(worker, hit, cost, len(pool))
    return best


def _without_hotspots(candidates: Sequence[Candidate], weights: RoutingWeights) -> list[Candidate]:
    queues = [w.queue_estimate for w in candidates]
    mean = sum(queues) / len(queues)
    limit = max(weights.hotspot_ratio * mean, mean + weights.hotspot_slack)
    cool = [w for w, q in zip(candidates, queues) if q <= limit]
    return cool or list(candidates)


class _HashesBySize:
    """The prompt's block hashes, computed once per block size in use. The last token is left out, as the
    worker's prefix cache does: at least one token is always computed, to yield logits."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = token_ids
        self._by_size: dict[int, list[int]] = {}

    def __call__(self, block_size: int) -> list[int]:
        if block_size not in self._by_size:
            usable = max(len(self._token_ids) - 1, 0)
            self._by_size[block_size] = prefix_hashes(self._token_ids[:usable], block_size)
        return self._by_size[block_size]
