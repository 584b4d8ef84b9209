"""The routing cost function (router/fleet/routing.py) on its own: cache hits against queues, the hotspot guard."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from nanovllm.common.block_hash import prefix_hashes
from nanovllm.common.errors import ConfigError
from nanovllm.common.server_config import RouterConfig, RoutingConfig
from nanovllm.router.fleet.routing import choose

BLOCK = 16
WEIGHTS = RoutingConfig(queued_request_cost=256.0, hotspot_ratio=1.25, hotspot_slack=2)


@dataclass
class Worker:
    """What routing reads of a worker connection: its queue and its reported cached block hashes."""

    address: str
    queue_estimate: int = 0
    cached_blocks: set[int] = field(default_factory=set)
    block_size: int = BLOCK
    offloaded_blocks: set[int] = field(default_factory=set)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        count = 0
        while count < len(hashes) and hashes[count] in self.cached_blocks:
            count += 1
        return count

    def offloaded_prefix_blocks(self, hashes: Sequence[int]) -> int:
        count = 0
        while count < len(hashes) and hashes[count] in self.offloaded_blocks:
            count += 1
        return count

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def caches(self, token_ids: list[int], salt: int | None = None) -> Worker:
        self.cached_blocks.update(prefix_hashes(token_ids, BLOCK, salt=salt))
        return self


PREFIX = list(range(100, 100 + 40 * BLOCK))  # 640 tokens


def test_nothing_shared_goes_to_the_shortest_queue():
    workers = [Worker("a", 3), Worker("b", 1), Worker("c", 2)]
    decision = choose(workers, list(range(50)), WEIGHTS)
    assert (decision.worker.address, decision.expected_hit_tokens) == ("b", 0)


def test_a_new_prefix_goes_to_the_emptiest_cache_among_equals():
    """All miss, all idle: not the first worker every time (it would hold every new prefix and evict them),
    but the one whose cache holds least."""
    workers = [Worker("a").caches(PREFIX), Worker("b"), Worker("c").caches(PREFIX[:BLOCK])]
    assert choose(workers, list(range(1, 60)), WEIGHTS).worker.address == "b"


def test_a_cached_prefix_outweighs_a_short_queue_but_not_a_long_one():
    prompt = PREFIX + [7, 8, 9]
    holder = Worker("holder", 1).caches(PREFIX)
    idle = Worker("idle", 0)
    decision = choose([idle, holder], prompt, WEIGHTS)
    assert decision.worker is holder and decision.expected_hit_tokens == len(PREFIX)
    # 640 cached tokens are worth 2.5 queued requests: three more in the queue tip it to the idle worker.
    holder.queue_estimate, idle.queue_estimate = 4, 1
    assert choose([idle, holder], prompt, WEIGHTS).worker is idle


def test_a_prefix_in_a_lower_tier_costs_less_than_a_miss_and_more_than_a_device_hit():
    """The 640-token prefix on one worker's device, on another's disk tier (its first 10 blocks on the
    device), on a third nowhere: device < offloaded < miss at equal queues. At 0.25 of a computed token
    the 480 offloaded tokens cost 120: against the miss's 643, 520 saved, two queued requests at 256."""
    prompt = PREFIX + [7, 8, 9]
    device = Worker("device").caches(PREFIX)
    offloaded = Worker("offloaded").caches(PREFIX[: 10 * BLOCK])
    offloaded.offloaded_blocks.update(prefix_hashes(PREFIX, BLOCK)[10:])
    cold = Worker("cold")
    assert choose([cold, offloaded, device], prompt, WEIGHTS).worker is device
    decision = choose([cold, offloaded], prompt, WEIGHTS)
    assert decision.worker is offloaded and decision.cost == 3 + 0.25 * 30 * BLOCK
    offloaded.queue_estimate = 2
    assert choose([cold, offloaded], prompt, WEIGHTS).worker is offloaded
    offloaded.queue_estimate = 3
    assert choose([cold, offloaded], prompt, WEIGHTS).worker is cold
    # Blocks in a lower tier count only after a leading run on the device (or from the first block).
    gap = Worker("gap").caches(PREFIX[:BLOCK])
    gap.offloaded_blocks.update(prefix_hashes(PREFIX, BLOCK)[2:])
    assert choose([gap], prompt, WEIGHTS).cost == len(prompt) - BLOCK


def test_the_last_token_is_never_counted_as_cached():
    """The worker always computes the prompt's last token, so a prompt that is exactly a cached prefix
    hits one block less."""
    holder = Worker("holder").caches(PREFIX)
    assert choose([holder], PREFIX, WEIGHTS).expected_hit_tokens == len(PREFIX) - BLOCK


def test_an_adapters_prefix_counts_only_for_that_adapter():
    """A LoRA adapter's blocks chain from its cache salt: the worker that holds the prompt under the
    adapter wins its requests, the one that holds it under the base (or another adapter) does not."""
    prompt = PREFIX + [5]
    base, sql, chat = (
        Worker("base").caches(PREFIX),
        Worker("sql").caches(PREFIX, 11),
        Worker("chat").caches(PREFIX, 12),
    )
    decision = choose([base, chat, sql], prompt, WEIGHTS, cache_salt=11)
    assert decision.worker is sql and decision.expected_hit_tokens == len(PREFIX)
    assert choose([sql, chat, base], prompt, WEIGHTS).worker is base


def test_only_a_leading_run_of_blocks_counts():
    """A block hash chains everything before it: the same tokens after a different start are a miss."""
    holder = Worker("holder").caches([1] * BLOCK + PREFIX)
    assert choose([holder], PREFIX + [5], WEIGHTS).expected_hit_tokens == 0


def test_a_hotspot_takes_nothing_new_while_a_cooler_worker_is_there():
    prompt = list(range(100, 100 + 400 * BLOCK)) + [1]  # 6,400 cached tokens would outweigh 25 requests
    hot = Worker("hot", 9).caches(prompt[:-1])
    cool = [Worker("b", 3), Worker("c", 3)]
    # A hotspot's queue is over both 1.25 x the mean and the mean + 2.
    assert choose([hot, *cool], prompt, WEIGHTS).worker.address == "b"  # mean 5: 9 > 7
    hot.queue_estimate = 7
    assert choose([hot, *cool], prompt, WEIGHTS).worker.address == "b"  # mean 4.33: 7 > 6.33
    hot.queue_estimate = 6
    assert choose([hot, *cool], prompt, WEIGHTS).worker is hot  # mean 4: 6 <= 6, and the cache wins


def test_workers_with_other_block_sizes_are_matched_by_their_own_hashes():
    big = Worker("big", block_size=32)
    big.cached_blocks.update(prefix_hashes(PREFIX, 32))
    decision = choose([Worker("small"), big], PREFIX + [1], WEIGHTS)
    assert (decision.worker.address, decision.expected_hit_tokens) == ("big", len(PREFIX))


def test_the_comparison_policies_ignore_the_cache():
    holder = Worker("holder", 2).caches(PREFIX)
    others = [Worker("b", 1), Worker("c", 3)]
    prompt = PREFIX + [1]
    least = RoutingConfig(policy="least-loaded")
    assert choose([holder, *others], prompt, least).worker.address == "b"
    turns = RoutingConfig(policy="round-robin")
    assert [choose([holder, *others], prompt, turns, turn).worker.address for turn in range(4)] == [
        "holder",
        "b",
        "c",
        "holder",
    ]


def test_an_unknown_policy_is_refused():
    with pytest.raises(
        ConfigError, match="--routing must be one of cost, least-loaded, round-robin, got 'best'"
    ):
        RouterConfig(workers=["w:1"], routing=RoutingConfig(policy="best"))
