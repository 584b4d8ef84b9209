"""Decode steps replayed from static buffers (worker/runner/decode_graphs.py): which steps replay in which bucket,
and that padding a step to its bucket changes no token and no sequence's KV cache.

Here the replay is EagerReplay, the same buffers and padding without a graph, on the CPU whatever the
machine has: CUDA graphs themselves need a GPU, and tests/test_gpu.py checks them there."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.worker.runner.decode_graphs import EagerReplay, Forward, batch_buckets
from nanovllm.worker.step import SeqChunk, StepInputs

MAX_NUM_SEQS = 8
# Triton runs on CPU tensors only in its interpreter, which conftest turns on only where there is no GPU.
TRITON_ON_CPU = pytest.param(
    "triton",
    marks=[
        pytest.mark.skipif(
            torch.cuda.is_available(),
            reason="with a GPU Triton compiles for it and cannot run on CPU tensors",
        ),
        pytest.mark.slow,  # the interpreter runs each kernel in Python
    ],
)


class CountingReplay(EagerReplay):
    """EagerReplay that counts the steps each bucket replays."""

    def __init__(self) -> None:
        self.replayed: dict[int, int] = {}

    def capture(self, forward: Forward) -> Forward:
        forward()
        size = len(self.replayed)  # captured largest first, in batch_buckets' order reversed
        bucket = list(reversed(batch_buckets(MAX_NUM_SEQS)))[size]
        self.replayed[bucket] = 0

        def replay() -> torch.Tensor:
            self.replayed[bucket] += 1
            return forward()

        return replay


def _llm(model_dir, backend: str) -> LLM:
    return LLM(
        str(model_dir), device="cpu", dtype="float32", attention_backend=backend, max_num_seqs=MAX_NUM_SEQS,
        max_model_len=256, kv_cache_memory="4MiB", enable_prefix_caching=False,
    )  # fmt: skip


def _decode_step(block_ids: list[int], start: int, block_size: int) -> StepInputs:
    """A decode-only step: one token at position `start` for each sequence, each in its own block."""
    return StepInputs(
        input_ids=[3 + i for i in range(len(block_ids))],
        positions=[start] * len(block_ids),
        slot_mapping=[b * block_size + start for b in block_ids],
        decodes=[SeqChunk(start, 1, [b]) for b in block_ids],
        fresh=[],
        cached=[],
        logits_index=list(range(len(block_ids))),
    )


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    buckets = batch_buckets(256)
    assert buckets[:6] == [1, 2, 4, 8, 16, 32] and buckets[-2:] == [240, 256] and len(buckets) == 20
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1, got 0"):
        batch_buckets(0)


SHRINKING_PROMPTS = [[5, 6, 7], list(range(40, 75)), [9] * 17, list(range(100, 130)), [11, 12]]
SHRINKING_PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 7, 12)]


@pytest.fixture(scope="module")
def eager_tokens(qwen3_dir) -> list[list[int]]:
    """The eager engine's tokens on the PyTorch backend: every backend's replayed tokens are held to them
    (on this random model in float32 no backend's rounding turns a greedy pick), so the interpreted Triton
    case runs one engine, not two."""
    outs = _llm(qwen3_dir, "torch").generate(SHRINKING_PROMPTS, SHRINKING_PARAMS, use_tqdm=False)
    return [o["token_ids"] for o in outs]


@pytest.mark.parametrize("backend", ["torch", "cpu_kernel", TRITON_ON_CPU])
def test_greedy_tokens_equal_eager_as_the_batch_shrinks(qwen3_dir, kernels, eager_tokens, backend):
    """Five sequences that end one after another: the decode batch passes through buckets 8, 4, 2 and 1,
    each step padded, and every token equals the eager engine's."""
    llm = _llm(qwen3_dir, backend)
    replay = CountingReplay()
    llm.engine.runner.use_decode_graphs(replay)
    replayed = llm.generate(SHRINKING_PROMPTS, SHRINKING_PARAMS, use_tqdm=False)

    assert [o["token_ids"] for o in replayed] == eager_tokens
    assert replay.replayed == {8: 2, 4: 4, 2: 2, 1: 3}  # 5, 4, 3, 2 and 1 sequences left decoding
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_padding_rows_write_only_the_pad_block(qwen3_dir):
    """Three sequences in bucket 4: the cache changes at their three slots and in the pad block, nowhere
    else, and the logits equal the unpadded eager step's."""
    llm = _llm(qwen3_dir, "torch")
    runner = llm.engine.runner
    runner.use_decode_graphs(EagerReplay())
    step = _decode_step([0, 5, 2], start=4, block_size=runner.block_size)
    assert runner.decode_graphs is not None and runner.decode_graphs.bucket(step) == 4

    torch.manual_seed(0)
    runner.kv_cache.normal_()  # earlier tokens' K/V, so attention has something to read
    before = runner.kv_cache.clone()
    replayed = runner.forward(step)
    changed = (runner.kv_cache != before).flatten(start_dim=4).any(dim=-1)  # [2, layers, block, offset]
    changed_slots = {(b, o) for b, o in changed.any(dim=0).any(dim=0).nonzero().tolist()}
    assert {s for s in changed_slots if s[0] != runner.pad_block} == {(0, 4), (5, 4), (2, 4)}
    assert (runner.pad_block, 0) in changed_slots

    runner.kv_cache.copy_(before)
    runner.decode_graphs = None
    torch.testing.assert_close(replayed, runner.forward(step), rtol=1e-5, atol=1e-5)


def test_steps_that_run_eagerly(qwen3_dir):
    """Prefill and mixed steps, and a batch wider than the largest bucket, are not replayed."""
    llm = _llm(qwen3_dir, "torch")
    runner = llm.engine.runner
    runner.use_decode_graphs(EagerReplay())
    graphs = runner.decode_graphs
    assert graphs is not None
    bs = runner.block_size
    assert [graphs.bucket(_decode_step(list(range(n)), 2, bs)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.bucket(_decode_step(list(range(9)), 2, bs)) is None
    prefill = StepInputs([1, 2], [0, 1], [bs * 7, bs * 7 + 1], [], [SeqChunk(0, 2, [7])], [], [1])
    assert graphs.bucket(prefill) is None
    mixed = _decode_step([0], 2, bs)
    mixed.fresh = prefill.fresh
    assert graphs.bucket(mixed) is None
