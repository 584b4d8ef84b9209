"""Tensor parallelism: ranks 1..N-1 in subprocesses give the same tokens and logits as one process, fail
loudly and leave nothing behind when a rank dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from nanovllm import LLM
from nanovllm.common.errors import ConfigError, EngineDeadError
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.step import (
    ImageEmbeddings,
    ImageRows,
    KVLoad,
    KVStore,
    KVTransfers,
    PoolingRow,
    SeqChunk,
    StateStore,
    StepInputs,
)
from tests.helpers import TP_ENGINE, TP_PROMPTS, compare_tp, greedy, rank_processes
from tests.model_factory import ALL_LORA_TARGETS, build_model, make_adapter
from tests.services import start_router, start_worker, wait_serving

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu"]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tp2_equals_tp1(model_dirs: dict[str, Path], arch: str) -> None:
    """TP=2 greedy tokens equal TP=1 token for token over a batch; logits within 1e-4 (fp32)."""
    compare_tp(model_dirs[arch])


def test_step_inputs_reach_the_other_ranks_whole() -> None:
    """What rank 0 broadcasts each step: the chunks, the logits rows, each row's LoRA slot and the slots
    it filled (names and paths as UTF-8), back as they were."""
    inputs = StepInputs(
        [5, 6, 7], [9, 0, 1], [40, 41, 42], [SeqChunk(9, 1, [2])], [SeqChunk(0, 2, [3, 4])], [], [0, 2],
        lora_slots=[-1, 1, 1], lora_fills=[(1, "sql", "/adapters/sql-ü")],
    )  # fmt: skip
    assert StepInputs.unpack(inputs.pack()) == inputs


def test_kv_transfers_and_prompt_rows_reach_the_other_ranks_whole() -> None:
    """A step's copies to and from the lower tiers travel with its inputs, block hashes of all 64 bits
    included (packed as signed integers), a hybrid model's state rows with them, and so do the rows whose
    logits score prompt tokens, and the pooling requests' rows."""
    transfers = KVTransfers(
        stores=[KVStore(3, 2**64 - 1, 0, True), KVStore(4, 7, -1, True)], fences=[3, 9],
        loads=[KVLoad(2**63, 5, -1), KVLoad(2**63 - 1, 6, 2, 12, 1)], disk_drops=[2**63 + 5, 11],
        state_stores=[StateStore(10, 2**64 - 2, 0, True), StateStore(11, 8, -1, True)],
    )  # fmt: skip
    inputs = StepInputs(
        [5, 6], [0, 1], [40, 41], [], [SeqChunk(0, 2, [5])], [], [1], kv_transfers=transfers, prompt_rows=[0],
        pooling=[PoolingRow(7, 1, [3, 4]), PoolingRow(8, 0, [])],
    )  # fmt: skip
    assert StepInputs.unpack(inputs.pack()) == inputs
    empty = StepInputs([], [], [], [], [], [], [], kv_transfers=transfers)
    assert StepInputs.unpack(empty.pack()) == empty


def test_a_step_with_images_reaches_the_other_ranks_with_its_rows() -> None:
    """A vision model's step: its three rows of RoPE positions and its image tokens' rows travel packed
    (the embeddings' values follow as a tensor; the images stay rank 0's). A step whose images have no
    embeddings yet is refused: the other ranks have no tower to make them."""
    image_rows = [ImageRows(None, 1, 0, 2)]  # type: ignore[arg-type]  # the image itself is rank 0's
    mrope = [0, 1, 1, 2, 0, 1, 2, 2, 0, 1, 1, 3]
    inputs = StepInputs(
        [5, 9, 9, 6], [0, 1, 2, 3], [40, 41, 42, 43], [], [SeqChunk(0, 4, [5])], [], [3],
        mrope_positions=mrope, image_rows=image_rows,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="with their embeddings"):
        inputs.pack()
    inputs.image_embeddings = ImageEmbeddings([1, 2], torch.ones(2, 8))
    unpacked = StepInputs.unpack(inputs.pack())
    assert unpacked.mrope_positions == mrope and not unpacked.image_rows
    assert unpacked.image_embeddings is not None and unpacked.image_embeddings.rows == [1, 2]
    assert unpacked.input_ids == inputs.input_ids and unpacked.fresh == inputs.fresh


def test_tp2_runs_lora_adapters_as_tp1(qwen3_dir: Path, tmp_path: Path) -> None:
    """LoRA on every projection under tensor parallelism: column-parallel layers take their rows of B,
    row-parallel ones their columns of A. Adapters given at start and loaded later, three of them through
    two slots (so slots are refilled mid-run, on every rank), mixed with the base model in one batch: TP=2's
    greedy tokens equal TP=1's (fp32)."""
    adapters = {
        name: make_adapter(qwen3_dir, tmp_path / name, rank, ALL_LORA_TARGETS, seed=seed)
        for name, rank, seed in (("a", 8, 31), ("b", 4, 32), ("c", 8, 33))
    }
    names = [None, "a", "b", "c", "a"]
    runs = []
    for size in (1, 2):
        llm = LLM(
            str(qwen3_dir), tensor_parallel_size=size, lora_adapters=[f"a={adapters['a']}"], max_loras=2,
            max_lora_rank=8, **TP_ENGINE,
        )  # fmt: skip
        try:
            for name in ("b", "c"):
                llm.add_lora(name, str(adapters[name]))
            outputs = llm.generate(TP_PROMPTS, greedy(16), use_tqdm=False, lora_name=names)
            runs.append([o["token_ids"] for o in outputs])
            assert llm.engine.runner.adapter_slots.num_loads == 3  # three adapters, two slots: one refilled
        finally:
            llm.shutdown()
    single, sharded = runs
    assert sharded == single
    assert single[1] != single[4] or TP_PROMPTS[1] == TP_PROMPTS[4]  # (the adapters change what comes out)
    assert rank_processes(psutil.Process()) == []


def test_tp2_replicates_a_single_kv_head(tmp_path: Path) -> None:
    """With fewer KV heads than ranks, each rank keeps a replica of its KV head: outputs unchanged."""
    compare_tp(build_model("qwen3", tmp_path / "mqa", heads=4, kv_heads=1, seed=5))


def test_tp2_shards_int4_weights_along_whole_groups(qwen3_dir: Path) -> None:
    """Each rank holds whole groups of 32 (o_proj's 64 input features split 32 + 32), the same groups
    one process holds: the same tokens, and logits within 1e-4 (only the all-reduce's order differs)."""
    compare_tp(qwen3_dir, quantization="int4")


def test_tp2_group_that_would_split_is_a_clear_error(qwen3_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"layer model.layers.0.self_attn.o_proj has 32 input features"):
        LLM(
            str(qwen3_dir),
            tensor_parallel_size=2,
            quantization="int4",
            quantization_group_size=64,
            **TP_ENGINE,
        )
    assert rank_processes(psutil.Process()) == []


def test_unshardable_model_is_a_clear_error_before_any_process_starts(qwen3_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(str(qwen3_dir), tensor_parallel_size=3, **TP_ENGINE)
    assert rank_processes(psutil.Process()) == []


def test_killed_rank_fails_the_step_and_leaves_no_process(qwen3_dir: Path) -> None:
    """Rank 1 killed mid-generation: the next step raises EngineDeadError naming it, within seconds, and
    after shutdown no rank process is left."""
    llm = LLM(str(qwen3_dir), tensor_parallel_size=2, **TP_ENGINE)
    engine = llm.engine
    for i, prompt in enumerate(TP_PROMPTS):
        engine.add_request(str(i), prompt, greedy(200))
    for _ in range(3):
        engine.step()
    (rank1,) = rank_processes(psutil.Process())
    os.kill(rank1.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {rank1.pid}\) exited with code -9"):
        for _ in range(
            200
        ):  # far more steps than the requests' tokens: the dead rank is noticed, not waited out
            engine.step()
    llm.shutdown()
    assert rank_processes(psutil.Process()) == []


@pytest.mark.slow
def test_serving_with_tp2_and_a_rank_dying(qwen3_dir: Path, kernels, tmp_path: Path) -> None:
    """Through router and worker with --tensor-parallel-size 2: the stream equals offline TP=1 output.
    When rank 1 dies mid-stream the stream ends with FINISH_REASON_ERROR naming it, the worker exits
    non-zero, and none of its processes survive."""
    worker = start_worker(
        qwen3_dir, "--tensor-parallel-size", "2", *ENGINE_FLAGS, log_path=tmp_path / "worker.log"
    )
    router = start_router([worker.address], log_path=tmp_path / "router.log")
    try:
        wait_serving(worker.address)
        wait_serving(router.address)
        reference = LLM(str(qwen3_dir), **TP_ENGINE).generate(
            ["The quick brown fox"], greedy(20), use_tqdm=False
        )[0]
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            request = generate_pb2.GenerateRequest(
                text="The quick brown fox",
                sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=20),
                return_token_ids=True,
            )
            responses = list(stub.Generate(request, timeout=120))
            assert [t for r in responses for t in r.token_ids] == reference["token_ids"]

            ranks = rank_processes(psutil.Process(worker.proc.pid))
            assert len(ranks) == 1
            long = generate_pb2.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            call = stub.Generate(generate_pb2.GenerateRequest(text="doomed", sampling=long), timeout=120)
            next(call)
            os.kill(ranks[0].pid, signal.SIGKILL)
            rest = list(call)  # tokens were already streamed, so the failure is the last response
            assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_ERROR
            assert f"tensor-parallel rank 1 (pid {ranks[0].pid}) exited" in rest[-1].error
            assert worker.proc.wait(timeout=60) == 1
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    finally:
        router.stop()
        if worker.proc.poll() is None:
            worker.kill()


def test_tp2_worker_stops_cleanly_on_sigterm(qwen3_dir: Path, kernels, tmp_path: Path) -> None:
    """A TP=2 worker asked to stop joins its rank and exits 0, leaving no process."""
    worker = start_worker(
        qwen3_dir, "--tensor-parallel-size", "2", *ENGINE_FLAGS, log_path=tmp_path / "worker.log"
    )
    try:
        wait_serving(worker.address)
        ranks = rank_processes(psutil.Process(worker.proc.pid))
        assert len(ranks) == 1
        assert worker.stop() == 0
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    finally:
        if worker.proc.poll() is None:
            worker.kill()
