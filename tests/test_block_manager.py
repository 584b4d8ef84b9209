"""Acceptance 3: block manager invariants under arbitrary allocate/append/free/abort sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.core.block_manager import BlockManager
from nanovllm.worker.sequence import Sequence

BLOCK = 4


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", tokens, SamplingParams())


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    holders = {b.block_id: 0 for b in bm.blocks}
    for seq in live:
        for block_id in seq.block_table:
            holders[block_id] += 1
        assert len(set(seq.block_table)) == len(seq.block_table)
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], f"block {block.block_id}"
        assert (block.block_id in bm.free_queue) == (block.ref_count == 0)
    for block_hash, block_id in bm.cached.items():
        assert bm.blocks[block_id].block_hash == block_hash
    assert bm.num_free_blocks + sum(1 for b in bm.blocks if b.ref_count) == bm.num_blocks


def _compute(bm: BlockManager, seq: Sequence, n: int) -> bool:
    """Allocate and 'compute' n more tokens of seq, as a scheduled step would."""
    n = min(n, seq.num_tokens - seq.num_computed_tokens)
    if n <= 0:
        return True
    if not bm.allocate_slots(seq, n):
        return False
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return True


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "step", "finish", "abort"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 2), min_size=1, max_size=14),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12))
def test_every_block_is_free_or_held_by_exactly_its_holders(ops, num_blocks):
    bm = BlockManager(num_blocks, BLOCK)
    live: list[Sequence] = []
    next_id = 0
    reported: set[int] = set()  # the cached hashes as a router rebuilds them from the events
    for op, pick, tokens in ops:
        if op == "admit":
            seq = _seq(next_id, tokens)
            next_id += 1
            computed = bm.get_computed_blocks(seq)
            chunk = len(tokens) - len(computed) * BLOCK
            assert chunk >= 1, "the last prompt token is always computed"
            if bm.allocate_slots(seq, chunk, computed):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
        elif op == "step" and live:
            seq = live[pick % len(live)]
            seq.token_ids.append(tokens[0])  # a sampled token, computed next step
            if not _compute(bm, seq, 1):
                bm.free(seq)  # preempted
                live.remove(seq)
        elif op in ("finish", "abort") and live:
            seq = live.pop(pick % len(live))
            bm.free(seq)
            assert seq.block_table == []
        check_invariants(bm, live)
        if pick % 2:  # the events of several operations together add up the same
            events = bm.take_cache_events()
            assert not events.stored & events.evicted
            reported = (reported - events.evicted) | events.stored
            assert reported == set(bm.cached)
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks


def test_block_registered_only_after_its_kv_is_computed():
    """nano-vllm bug: blocks hashed at allocation let a twin request 'hit' KV that did not exist yet."""
    bm = BlockManager(16, BLOCK)
    a, b = _seq(0, list(range(10))), _seq(1, list(range(10)))
    assert bm.allocate_slots(a, 10)
    assert bm.get_computed_blocks(b) == []  # allocated, not computed: no hit
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(b) == a.block_table[:1]  # only the fully computed first block


def test_full_prefix_hit_still_computes_last_token():
    """nano-vllm bug: a prompt entirely in the cache left nothing to compute and no logits."""
    bm = BlockManager(16, BLOCK)
    a = _seq(0, list(range(8)))  # exactly two full blocks
    assert bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    b = _seq(1, list(range(8)))
    computed = bm.get_computed_blocks(b)
    assert len(computed) == 1  # the block holding the last token is recomputed
    assert bm.allocate_slots(b, 8 - BLOCK, computed)
    assert len(b.block_table) == 2


def test_freed_blocks_stay_cached_until_recycled_lru():
    bm = BlockManager(4, BLOCK)
    a = _seq(0, list(range(9)))
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    first, second = a.block_table[0], a.block_table[1]
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.get_computed_blocks(_seq(1, list(range(9)))) == [first, second]
    c = _seq(2, [7])
    assert bm.allocate_slots(c, 1)  # takes the oldest-freed block: never-used block 3 first
    assert bm.get_computed_blocks(_seq(3, list(range(9)))) == [first, second]
    d = _seq(4, [8] * 9)
    assert bm.allocate_slots(d, 9)  # needs 3 blocks: recycles a's tail first, then its second block
    assert bm.get_computed_blocks(_seq(5, list(range(9)))) == []
    assert bm.prefix_hit_tokens == 0 and bm.prefix_queried_tokens == 9 + 1 + 9
