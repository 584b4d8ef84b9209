"""The prefix cache's lower tiers (worker/core/kv_tiers.py, worker/runner/kv_offload.py, kv_disk.py): a conversation whose prefix
was evicted from a small device cache into host memory or onto disk continues with the tokens of an engine
whose device cache holds everything; every block is accounted for in each tier afterwards; the disk tier
survives a restart with the same model and is ignored with another; a bad file or a disk that cannot be
written is logged once and recomputed."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from nanovllm import LLM, SamplingParams
from nanovllm.common.block_hash import prefix_hashes
from nanovllm.common.errors import ConfigError
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.runner.kv_disk import DiskTier
from tests.helpers import counting_proposals
from tests.metrics import scrape, value
from tests.model_factory import build_model
from tests.services import CALL_TIMEOUT_S, open_channel, router_and_worker, wait_idle

BLOCK = 8
DEVICE_BLOCKS = 20  # 160 tokens: about two of the conversations below; they hold 6 x 96 tokens by the end
TURNS = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def _block_bytes(model_dir: Path) -> int:
    cfg = ModelConfig.from_pretrained_dir(str(model_dir))
    return 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * 4  # float32


def _conversations(seed: int = 0) -> list[list[int]]:
    """Six conversations opening with a shared 40-token system prompt, 20 tokens of their own each."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 200) for _ in range(40)]
    return [system + [rng.randrange(3, 200) for _ in range(20)] for _ in range(6)]


def _llm(model_dir: Path, device_blocks: int | None = DEVICE_BLOCKS, **tiers) -> LLM:
    memory = device_blocks * _block_bytes(model_dir) if device_blocks else "8MiB"
    return LLM(
        str(model_dir),
        max_model_len=128,
        kvcache_block_size=BLOCK,
        dtype="float32",
        kv_cache_memory=memory,
        **tiers,
    )


def _turns(llm: LLM, turns: range = range(TURNS), seed: int = 0) -> tuple[list[list[int]], int]:
    """Each conversation's outputs of `turns` (each turn adds the last output and three user tokens),
    and the prompt tokens served from the prefix cache in them."""
    history = _conversations(seed)
    outputs, cached = [], 0
    for turn in range(max(turns) + 1):
        if turn in turns:
            results = llm.generate(history, GREEDY, use_tqdm=False)
        else:  # a turn run elsewhere: take its tokens from the reference
            results = [{"token_ids": t, "num_cached_tokens": 0} for t in _reference_turn(turn, seed)]
        for i, result in enumerate(results):
            if turn in turns:
                outputs.append(result["token_ids"])
                cached += result["num_cached_tokens"]
            history[i] = history[i] + result["token_ids"] + [7 + turn, 8, 9]
    return outputs, cached


_REFERENCE: dict[tuple[int, int], list[list[int]]] = {}


def _reference_turn(turn: int, seed: int) -> list[list[int]]:
    return _REFERENCE[(turn, seed)]


@pytest.fixture(scope="module")
def reference(qwen3_dir) -> list[list[int]]:
    """Every turn's outputs from an engine whose device cache holds everything."""
    llm = _llm(qwen3_dir, device_blocks=None)
    outputs, _ = _turns(llm)
    llm.shutdown()
    for turn in range(TURNS):
        _REFERENCE[(turn, 0)] = outputs[turn * 6 : (turn + 1) * 6]
    return outputs


def _assert_accounted(llm: LLM) -> None:
    """Every device block is free again and held once; each lower tier's index matches its storage (a
    hybrid model's host state rows each beside a held block, the disk's bytes those of its files)."""
    engine = llm.engine
    bm = engine.block_manager
    assert engine.load().kv_blocks_used == 0 and bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.cached.values()) == sorted(set(bm.cached.values()))
    assert all(bm.blocks[b].block_hash == h for h, b in bm.cached.items())
    engine.drain_kv_tiers()
    tiers, directory = (
        bm.lower_tiers,
        engine.runner.kv_offload.disk.directory if bm.lower_tiers.disk else None,
    )
    if tiers.host is not None:
        slots = list(tiers.host.index.values()) + tiers.host.free_slots
        assert sorted(slots) == list(range(tiers.host.capacity))
        rows = list(tiers.host.states.values()) + tiers.host.free_state_rows
        assert sorted(rows) == list(range(tiers.host.state_capacity))
        assert set(tiers.host.states) <= set(tiers.host.index)
    if tiers.disk is not None:
        sizes = {int(p.stem, 16): p.stat().st_size for p in directory.glob("*.kv")}
        assert set(sizes) == set(tiers.disk.index)
        assert all(sizes[h] == tiers.disk.size(has_state) for h, has_state in tiers.disk.index.items())
        assert sum(sizes.values()) == tiers.disk.held_bytes <= tiers.disk.capacity
        assert not [p for p in directory.glob("*.tmp") if not p.is_symlink()]  # none half-written


@pytest.mark.parametrize(
    "tiers",
    [
        pytest.param({"kv_host_memory": "4MiB"}, id="host"),
        pytest.param({"kv_disk_path": "{tmp}"}, id="disk"),
        pytest.param({"kv_host_memory": 12, "kv_disk_path": "{tmp}"}, id="host-and-disk"),
    ],
)
def test_evicted_prefixes_come_back_from_each_tier_with_the_same_tokens(
    qwen3_dir, reference, tiers, tmp_path
):
    tiers = {k: str(tmp_path) if v == "{tmp}" else v for k, v in tiers.items()}
    if tiers.get("kv_host_memory") == 12:  # 12 blocks: the host tier evicts, the disk tier serves
        tiers["kv_host_memory"] = 12 * _block_bytes(qwen3_dir)
    small = _llm(qwen3_dir)
    small_outputs, small_cached = _turns(small)
    small.shutdown()
    assert small_outputs == reference  # recomputed: the same tokens, fewer hits

    llm = _llm(qwen3_dir, **tiers)
    outputs, cached = _turns(llm)
    assert outputs == reference
    stats = llm.engine.load().kv_tiers
    hits = {tier: s.hits for tier, s in stats.items()}
    assert sum(hits.values()) > 0
    if "kv_disk_path" in tiers:
        assert hits["disk"] > 0
    if "kv_host_memory" in tiers and "kv_disk_path" not in tiers:
        assert hits["host"] > 0
    assert cached > small_cached
    _assert_accounted(llm)
    llm.shutdown()


@pytest.mark.parametrize(
    "tiers",
    [pytest.param({"kv_host_memory": "4MiB"}, id="host"), pytest.param({"kv_disk_path": "{tmp}"}, id="disk")],
)
def test_with_two_ranks_each_copies_its_share_and_the_tokens_are_one_ranks(
    qwen3_dir, reference, tiers, tmp_path
):
    """Tensor parallelism: every rank copies its share of each block (its KV heads) to and from its own
    host slots and disk directory, in the places rank 0's scheduler chose. The tokens are those of one
    rank with everything on the device; each tier serves hits; every block is accounted for."""
    tiers = {k: str(tmp_path) if v == "{tmp}" else v for k, v in tiers.items()}
    llm = _llm(qwen3_dir, tensor_parallel_size=2, **tiers)
    outputs, _ = _turns(llm)
    assert outputs == reference
    tier = "disk" if "kv_disk_path" in tiers else "host"
    assert llm.engine.load().kv_tiers[tier].hits > 0
    _assert_accounted(llm)
    llm.shutdown()
    if tier == "disk":
        assert len({p.parent for p in tmp_path.rglob("*.kv")}) == 2  # a directory per rank


def test_a_file_bad_on_one_rank_only_is_recomputed_on_every_rank(qwen3_dir, reference, tmp_path):
    """Rank 1's files are made garbage after a first run: rank 0's are intact, so only rank 1 finds out,
    when it loads one. Every rank learns it before the forward pass, the blocks from there are computed
    again on both, and the tokens are unchanged; rank 0 deletes its own copy of each such block."""
    first = _llm(qwen3_dir, tensor_parallel_size=2, kv_disk_path=str(tmp_path))
    _turns(first, range(1))
    first.shutdown()
    directories = {p.parent for p in tmp_path.rglob("*.kv")}
    llm = _llm(qwen3_dir, tensor_parallel_size=2, kv_disk_path=str(tmp_path))
    (rank1,) = directories - {llm.engine.runner.kv_offload.disk.directory}
    for path in rank1.glob("*.kv"):
        path.write_bytes(random.Random(0).randbytes(path.stat().st_size))
    outputs, cached = _turns(llm, range(1, 2))
    assert outputs == reference[6:12]
    faults = llm.engine.load().kv_tiers["disk"].faults
    assert faults["other_rank"] >= 1 and set(faults) == {"other_rank"}  # rank 0's own files were fine
    assert cached < 6 * 8 * BLOCK  # what came from disk in one rank's run (see the restart test) is not
    _assert_accounted(llm)
    llm.shutdown()


def test_a_draft_model_catches_up_over_blocks_that_came_from_a_tier(qwen3_dir, reference):
    """The draft's KV is not offloaded: a block copied up from a tier holds the target's KV only, and the
    draft computes its own over a new request's prompt as it always does. With the model as its own draft
    (greedy, so it proposes the target's picks): the reference's tokens, hits from the host tier, and
    nearly every proposal accepted, which a draft reading another block's KV would not get."""
    # Room for DEVICE_BLOCKS blocks of both models' KV.
    llm = _llm(
        qwen3_dir, 2 * DEVICE_BLOCKS, kv_host_memory="4MiB", speculative_method="draft",
        speculative_model=str(qwen3_dir), num_speculative_tokens=3, speculative_max_batch=8,
    )  # fmt: skip
    with counting_proposals(llm) as counts:
        outputs, _ = _turns(llm)
    proposed, accepted = counts
    assert outputs == reference
    assert llm.engine.load().kv_tiers["host"].hits > 0
    assert accepted >= 0.9 * proposed > 0, (proposed, accepted)
    _assert_accounted(llm)
    llm.shutdown()


def test_the_disk_tier_survives_a_restart_with_the_same_model_only(qwen3_dir, reference, tmp_path):
    first = _llm(qwen3_dir, kv_disk_path=str(tmp_path))
    _turns(first, range(1))
    _assert_accounted(first)
    first.shutdown()

    again = _llm(qwen3_dir, kv_disk_path=str(tmp_path))
    directory = again.engine.runner.kv_offload.disk.directory
    assert len(again.engine.block_manager.lower_tiers.disk.index) == 5 + 6 * 3
    outputs, cached = _turns(again, range(1, 2))
    assert outputs == reference[6:12]
    # Turn 0 computed each history's first 69 tokens: 8 full blocks, the 5 of the system prompt shared.
    # Each of turn 1's prompts finds all 8 (on the device or on disk); each of the 5 + 6 x 3 distinct ones
    # came from disk at least once.
    assert cached == 6 * 8 * BLOCK
    assert again.engine.load().kv_tiers["disk"].hits >= 5 + 6 * 3
    _assert_accounted(again)
    again.shutdown()

    # The same configuration with other weights: other KV, so none of those files is looked at.
    other = build_model("qwen3", tmp_path / "other-weights", seed=7)
    llm = _llm(other, kv_disk_path=str(tmp_path))
    assert llm.engine.runner.kv_offload.disk.directory != directory
    assert len(llm.engine.block_manager.lower_tiers.disk.index) == 0
    llm.shutdown()


def _fault_events(logs: list[dict]) -> list[str]:
    return [entry["kind"] for entry in logs if entry["event"] == "kv_tier_fault"]


def test_bad_files_are_logged_once_and_recomputed(qwen3_dir, reference, tmp_path):
    first = _llm(qwen3_dir, kv_disk_path=str(tmp_path))
    _turns(first, range(1))
    first.shutdown()
    files = sorted((p for p in tmp_path.rglob("*.kv")), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) >= 8
    for path in files[:3]:  # truncated
        path.write_bytes(path.read_bytes()[:100])
    for path in files[3:6]:  # garbage of the right size
        path.write_bytes(random.Random(0).randbytes(path.stat().st_size))

    with capture_logs() as logs:
        llm = _llm(qwen3_dir, kv_disk_path=str(tmp_path))
        outputs, _ = _turns(llm, range(1, 2))
    assert outputs == reference[6:12]
    faults = llm.engine.runner.kv_offload.stats["disk"].faults.counts
    assert faults["bad_size"] == 3
    assert 1 <= faults["corrupt"] <= 3  # those of the garbage files a prompt's chain reached
    assert sorted(_fault_events(logs)) == ["bad_size", "corrupt"]  # once per kind
    _assert_accounted(llm)
    llm.shutdown()


@pytest.mark.parametrize("offset", [0, 24, 40, -1], ids=["magic", "block-hash", "checksum", "payload"])
def test_a_disk_block_changed_in_any_byte_is_refused(tmp_path, offset):
    """A block file read back is exactly what was written for this model and hash, or refused (counted
    as corrupt and deleted): one byte changed in its header or its payload is enough."""
    block = torch.arange(64, dtype=torch.float32).reshape(2, 32)
    tier = DiskTier(str(tmp_path), 2**20, bytes(16), block.numel() * block.element_size())
    tier.write(7, block)
    assert tier.read(7) == block.numpy().tobytes()
    data = bytearray(tier.path(7).read_bytes())
    data[offset] ^= 0x01
    tier.path(7).write_bytes(bytes(data))
    assert tier.read(7) is None
    assert tier.faults.counts["corrupt"] == 1 and not tier.path(7).exists()


def test_a_full_disk_is_logged_once_and_nothing_is_lost(qwen3_dir, reference, tmp_path):
    """Each block's temporary file is a link to /dev/full, so its write fails with ENOSPC from the
    kernel: logged once, nothing half-written is kept, every turn has the reference's tokens."""
    llm = _llm(qwen3_dir, kv_disk_path=str(tmp_path))
    disk = llm.engine.runner.kv_offload.disk
    for block_hash in _every_block_hash(reference):
        os.symlink("/dev/full", disk.path(block_hash).with_suffix(".tmp"))
    with capture_logs() as logs:
        outputs, _ = _turns(llm)
    assert outputs == reference
    assert _fault_events(logs) == ["disk_full"]
    assert disk.faults.counts["disk_full"] > 1
    _assert_accounted(llm)
    llm.shutdown()


def _every_block_hash(reference: list[list[int]]) -> set[int]:
    """The hashes of every full block of every turn's prompt and output."""
    history, hashes = _conversations(), set()
    for turn in range(TURNS):
        for i, output in enumerate(reference[turn * 6 : (turn + 1) * 6]):
            hashes.update(prefix_hashes(history[i] + output, BLOCK))
            history[i] = history[i] + output + [7 + turn, 8, 9]
    return hashes


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_unwritable_directory_is_logged_once_and_the_engine_serves(qwen3_dir, reference, tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "kv"
    else:
        path = Path("/proc/nanovllm-kv")
    with capture_logs() as logs:
        llm = _llm(qwen3_dir, kv_disk_path=str(path))
        outputs, _ = _turns(llm)
    assert outputs == reference
    assert _fault_events(logs) == ["unwritable"]
    assert llm.engine.runner.kv_offload.disk is None
    llm.shutdown()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_host_memory": "lots"}, "kv_host_memory 'lots' is not a size"),
        ({"kv_disk_path": "/tmp/x", "kv_disk_bytes": -1}, "kv_disk_bytes must be positive"),
        ({"kv_disk_path": "/tmp/x", "kv_disk_bytes": 0.5}, "kv_disk_bytes takes a size like '16GiB'"),
        ({"kv_disk_path": "/tmp/x", "enable_prefix_caching": False}, "tiers of the prefix cache"),
    ],
)
def test_bad_tier_settings_fail_at_start_naming_them(qwen3_dir, settings, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(qwen3_dir), **settings)


def test_a_served_conversation_continues_from_the_disk_tier(qwen3_dir, reference, tmp_path):
    """Through a router and a worker process: the tokens are the offline reference's, the worker's load
    and metrics count the disk tier's blocks and hits, and the router learns which blocks it holds."""
    flags = (
        *("--kv-cache-memory", str(DEVICE_BLOCKS * _block_bytes(qwen3_dir))),
        *("--block-size", str(BLOCK), "--max-model-len", "128"),
        *("--kv-disk-path", str(tmp_path / "kv")),
    )
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens)
    with router_and_worker(qwen3_dir, tmp_path, worker_flags=flags) as (worker, router):
        stub = generate_pb2_grpc.GenerationStub(open_channel(router.address))
        history, outputs = _conversations(), []
        for turn in range(TURNS):
            for i in range(len(history)):
                request = generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=history[i]), sampling=sampling, return_token_ids=True
                )
                tokens = [t for r in stub.Generate(request, timeout=CALL_TIMEOUT_S) for t in r.token_ids]
                outputs.append(tokens)
                history[i] = history[i] + tokens + [7 + turn, 8, 9]
        assert outputs == reference
        load = wait_idle(worker.address)
        assert load.kv_disk_blocks > 0 and load.kv_host_blocks == 0
        worker_metrics = scrape(worker.metrics_address)
        assert value(worker_metrics, "nanovllm:kv_tier_hits_total", tier="disk") > 0
        assert value(worker_metrics, "nanovllm:kv_tier_blocks", tier="disk") == load.kv_disk_blocks
        assert value(worker_metrics, "nanovllm:kv_tier_bytes_total", tier="disk", direction="up") > 0

        def router_sees_them() -> bool:
            seen = value(
                scrape(router.metrics_address), "nanovllm:worker_offloaded_blocks", worker=worker.address
            )
            return seen == load.kv_disk_blocks

        deadline = time.monotonic() + CALL_TIMEOUT_S  # a bound on a hang, not a measure of speed
        while not router_sees_them():
            assert time.monotonic() < deadline, "the router never learnt the worker's disk tier"
            time.sleep(0.05)
