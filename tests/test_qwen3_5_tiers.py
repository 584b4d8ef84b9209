"""The prefix cache's lower tiers with Qwen3.5's hybrid state (worker/core/kv_tiers.py,
worker/runner/kv_offload.py, kv_disk.py): a state snapshot evicted from the device goes down beside the
block it ends, and a repeated 300-token prompt whose blocks and snapshot left the device hits from host
memory and from disk, resuming its linear layers from the snapshot that came back up with its last block;
the tokens are a cache-less engine's, with one rank and with two. A garbage file is refused and the prompt
computed again; every block, state slot, host slot and state row is accounted for afterwards."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from nanovllm import LLM
from nanovllm.common.block_hash import prefix_hashes
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.core.recurrent_states import RecurrentStates
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from nanovllm.worker.runner.kv_cache import kv_bytes_per_block
from nanovllm.worker.runner.kv_disk import DiskTier
from nanovllm.worker.sequence import Sequence
from nanovllm.worker.step import KVTransfers
from tests.helpers import greedy
from tests.model_factory import build_model
from tests.test_kv_tiers import _assert_accounted

BLOCK = 16
MAX_NEW = 4
SLOTS, SNAPSHOTS, DEVICE_BLOCKS = 2, 3, 32  # the device: two requests at a time, 3 snapshots, 512 tokens


def _prompts() -> tuple[list[int], list[list[int]]]:
    """The 300-token prompt that comes back, and three others of 300 tokens that push it off the device."""
    rng = random.Random(17)
    return [rng.randrange(2, 512) for _ in range(300)], [
        [rng.randrange(2, 512) for _ in range(300)] for _ in range(3)
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5_tiers") / "m", num_layers=4, seed=3)


def _sizes(model_dir: Path) -> tuple[int, int]:
    """One state snapshot's and one block's bytes on one rank (float32)."""
    cfg = ModelConfig.from_pretrained_dir(str(model_dir))
    state = Qwen3_5ForCausalLM.state_layout(cfg, 1).bytes_per_slot(4)
    return state, kv_bytes_per_block(cfg, BLOCK, cfg.num_key_value_heads, 4)


def _llm(model_dir: Path, **options) -> LLM:
    """A device cache of SLOTS state slots (and the pad row), SNAPSHOTS snapshot rows and DEVICE_BLOCKS
    blocks: the prompt's 19 blocks and its snapshot are gone after the three others. The host tier, when
    asked for, holds 118 blocks and 10 snapshots (state_cache_fraction of it, as of the device's)."""
    state, block = _sizes(model_dir)
    left = SNAPSHOTS * state + DEVICE_BLOCKS * block  # past the slots and the pad row
    settings = {
        "max_model_len": 384, "kvcache_block_size": BLOCK, "dtype": "float32", "max_num_seqs": SLOTS,
        "kv_cache_memory": (SLOTS + 1) * state + left, "state_cache_fraction": (SNAPSHOTS * state + 1) / left,
    }  # fmt: skip
    host = options.pop("host", False)
    if host:
        settings["kv_host_memory"] = 160 * block
    llm = LLM(str(model_dir), **settings, **options)
    runner = llm.engine.runner
    allocated = (runner.num_state_slots, runner.num_state_snapshots, runner.num_blocks)
    assert allocated == (SLOTS, SNAPSHOTS, DEVICE_BLOCKS)
    if host:  # 160 blocks' bytes: state_cache_fraction of them in 10 snapshot rows, the rest in blocks
        tiers = llm.engine.block_manager.lower_tiers
        assert (tiers.host.capacity, tiers.host.state_capacity) == (118, 10)
    return llm


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    """A cache-less engine's tokens for the prompt and the three others."""
    prompt, others = _prompts()
    plain = LLM(
        str(model), max_model_len=384, dtype="float32", kv_cache_memory="16MiB", enable_prefix_caching=False
    )
    return [o["token_ids"] for o in plain.generate([prompt, *others], greedy(MAX_NEW), use_tqdm=False)]


def _counting_transfers(llm: LLM) -> list[KVTransfers]:
    """Every step's copies to and from the lower tiers, as the scheduler hands them to the runner."""
    tiers = llm.engine.block_manager.lower_tiers
    taken: list[KVTransfers] = []
    take = tiers.take_transfers
    tiers.take_transfers = lambda: taken.append(take()) or taken[-1]
    return taken


def _workload(llm: LLM, before_last=lambda: None) -> list[dict]:
    """The prompt (which leaves a snapshot at its last block boundary computed, 288: 18 full blocks of 16),
    the three others one after another (the third's snapshot takes the prompt's row), the prompt again:
    each one's output."""
    prompt, others = _prompts()
    outputs = [llm.generate([p], greedy(MAX_NEW), use_tqdm=False)[0] for p in [prompt, *others]]
    before_last()
    return [*outputs, llm.generate([prompt], greedy(MAX_NEW), use_tqdm=False)[0]]


def _assert_all_back(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert len(bm.states.free_slots) == llm.engine.runner.num_state_slots
    _assert_accounted(llm)


def _check(outputs: list[dict], reference: list[list[int]], cached: int) -> None:
    tokens = [o["token_ids"] for o in outputs]
    assert tokens == [*reference, reference[0]]
    assert [o["num_cached_tokens"] for o in outputs] == [0, 0, 0, 0, cached]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prompt_evicted_from_the_device_resumes_from_a_lower_tier(model, reference, tier, tmp_path):
    """The prompt's blocks and snapshot left the device: its 18 blocks come back from the tier, the last
    with the snapshot, which its linear layers resume from (288 tokens cached). The tier's bytes up are
    those 18 blocks and one snapshot; its bytes down every block and snapshot the scheduler sent down. The
    disk tier's file of the 18th block holds the snapshot after the block, and a restarted engine resumes
    from it."""
    options = {"host": True} if tier == "host" else {"kv_disk_path": str(tmp_path)}
    llm = _llm(model, **options)
    transfers = _counting_transfers(llm)
    outputs = _workload(llm)
    _check(outputs, reference, cached=288)
    state, block = _sizes(model)
    stats = llm.engine.load().kv_tiers[tier]
    assert (stats.hits, stats.bytes_up) == (18, 18 * block + state)
    stores = sum(len(t.stores) for t in transfers)
    state_stores = sum(len(t.state_stores) for t in transfers)
    assert state_stores >= 1 and stats.bytes_down == stores * block + state_stores * state
    if tier == "disk":
        llm.engine.drain_kv_tiers()
        disk, last = llm.engine.runner.kv_offload.disk, prefix_hashes(_prompts()[0], BLOCK)[17]
        assert disk.path(last).stat().st_size == disk.file_bytes + state
    _assert_all_back(llm)
    llm.shutdown()
    if tier == "disk":
        again = _llm(model, kv_disk_path=str(tmp_path))
        out = again.generate([_prompts()[0]], greedy(MAX_NEW), use_tqdm=False)[0]
        assert (out["token_ids"], out["num_cached_tokens"]) == (reference[0], 288)
        _assert_all_back(again)
        again.shutdown()


def test_a_garbage_disk_file_is_refused_and_the_prompt_computed_again(model, reference, tmp_path):
    """The file of the prompt's 18th block, which holds its snapshot, is garbage of the right size when the
    prompt comes back: that load fails (counted as corrupt, the file deleted), the 17 blocks before it have
    no snapshot to resume from, so none is kept and the prompt is computed whole, with the same tokens.
    Its blocks go down again when it ends: the file is then the block's, without a snapshot (the prompt's
    is on the device)."""
    llm = _llm(model, kv_disk_path=str(tmp_path))
    disk = llm.engine.runner.kv_offload.disk
    path = disk.path(prefix_hashes(_prompts()[0], BLOCK)[17])

    def spoil() -> None:
        llm.engine.drain_kv_tiers()
        path.write_bytes(random.Random(0).randbytes(path.stat().st_size))

    _check(_workload(llm, before_last=spoil), reference, cached=0)
    assert disk.faults.counts == {"corrupt": 1}
    llm.engine.drain_kv_tiers()
    assert path.stat().st_size == disk.file_bytes and disk.read(int(path.stem, 16)) is not None
    _assert_all_back(llm)
    llm.shutdown()


def test_with_two_ranks_each_copies_its_share_of_the_state(model, reference):
    """Tensor parallelism, host tier: each rank copies its share of every block and snapshot (its heads
    of the linear layers' state) to and from its host rows; the tokens are one rank's cache-less ones."""
    llm = _llm(model, host=True, tensor_parallel_size=2, device="cpu")
    _check(_workload(llm), reference, cached=288)
    assert llm.engine.load().kv_tiers["host"].hits == 18
    _assert_all_back(llm)
    llm.shutdown()


def test_a_snapshot_joins_its_blocks_file_under_the_checksum(tmp_path):
    """A file's snapshot after its block (add_state) is read back whole, found with it after a restart, and
    one byte changed in it is enough for the file to be refused."""
    block, state = torch.arange(64, dtype=torch.float32), [torch.ones(3, 2), torch.full((5,), 2.0)]
    nbytes = sum(t.numel() * 4 for t in state)
    tier = DiskTier(str(tmp_path), 2**20, bytes(16), 256, nbytes)
    tier.write(7, block)
    tier.write(8, block)
    tier.add_state(7, state)
    assert tier.read(7) == block.numpy().tobytes() + b"".join(t.numpy().tobytes() for t in state)
    assert sorted(DiskTier(str(tmp_path), 2**20, bytes(16), 256, nbytes).found) == [(7, True), (8, False)]
    data = bytearray(tier.path(7).read_bytes())
    data[-1] ^= 0x01
    tier.path(7).write_bytes(bytes(data))
    assert tier.read(7) is None
    assert tier.faults.counts["corrupt"] == 1 and not tier.path(7).exists()


def test_rows_a_step_reads_are_not_recycled_under_it():
    """The snapshot rows' bookkeeping (worker/core/recurrent_states.py) with two rows cached at blocks 0 and
    1: a row pinned for a sequence loading from disk (it may resume there a step later) is never recycled
    until its loads arrive, a row restored in the step being scheduled is never taken for a load into it,
    and each recycled row's snapshot is first handed to `spill` (the lower tiers), least recently used first."""
    states = RecurrentStates(num_slots=3, num_snapshots=2, snapshot_interval=4, block_size=4, caching=True)
    spilled: list[int] = []
    states.spill = lambda block_hash, row: spilled.append(block_hash)
    first = Sequence(0, "first", list(range(1, 10)), SamplingParams())
    states.take_slot(first)
    assert [boundary for boundary, _ in states.plan_saves(first, 0, 9)] == [4, 8]  # every 4 tokens
    first.block_hashes = prefix_hashes(first.token_ids[:8], 4)
    first.num_computed_tokens = 9  # its step ran: publish keeps the copies at boundaries it computed
    states.publish(first)
    states.release(first)
    h0, h1 = first.block_hashes
    loading, other = (Sequence(i, f"s{i}", list(range(1, 20)), SamplingParams()) for i in (1, 2))
    rows = dict(states.cache)
    states.pin(loading, [h0])
    assert states.take_load_row(other, 12345) == rows[h1]  # h0 pinned: h1's row, though h0 is older
    assert spilled == [h1] and states.resumes_at(h0)
    assert not states.load_row_available() and states.take_load_row(other, 6789) == -1
    states.arrived(other, ok=True)  # its row joins the cache under 12345
    states.arrived(loading, ok=True)  # unpinned
    states.begin_step()
    resumed = Sequence(3, "resumed", [], SamplingParams())
    resumed.block_hashes = [h0]
    states.restore(resumed)  # h0's row is read by this step
    states.pin(other, [12345])  # the only other row
    assert not states.load_row_available() and states.take_load_row(loading, 4242) == -1
    states.arrived(other, ok=True)
    assert states.take_load_row(loading, 4242) == rows[h1]  # 12345's
    assert spilled == [h1, 12345] and states.resumes_at(h0)
