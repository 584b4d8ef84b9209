"""Tensor parallelism across processes.

Rank 0 is the engine's own process: it schedules, samples and serves. Ranks 1..N-1 are subprocesses that
hold their shard of every layer and of the KV cache and run the same forward passes. torch.distributed
connects them (gloo on CPU, NCCL on CUDA) through a TCPStore that rank 0 opens on a free port, so two
workers on one host never collide. Each step, rank 0 broadcasts the step's StepInputs as one int64 tensor
(a header first: its length and what it is for); the layers' own collectives (all-reduce after row-parallel
layers, all-gather of the vocabulary-parallel logits) do the rest. Tensors follow the packed integers as
bytes: a step's image embeddings (the vision tower runs on rank 0 alone, worker/runner/images.py says why),
and with MTP speculation each pass of the head (a HeadPass: its inputs, then its rows' hidden states),
sent after the step it follows or before the step it proposes for.

No rank outlives rank 0: ranks 1..N-1 ask the kernel to kill them when their parent dies
(PR_SET_PDEATHSIG), and rank 0 checks before every step that they are alive, so a dead rank becomes an
EngineDeadError naming it instead of a hang.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from nanovllm.common.errors import EngineDeadError
from nanovllm.common.logging import get_logger
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.step import HeadPass, StepInputs

log = get_logger(__name__)

HOST = "127.0.0.1"
# Ranks 1..N-1 wait for rank 0's next step for as long as the worker is idle, so collectives get no
# practical timeout; a rank that dies closes its sockets, which fails the others' collectives at once.
COLLECTIVE_TIMEOUT = timedelta(days=365)
STARTUP_TIMEOUT_S = 120.0  # for a rank to start and reach the rendezvous
JOIN_TIMEOUT_S = 30.0
_STOP = -1  # header length that tells ranks 1..N-1 to leave their loop
# What a header announces: a step of the model, or a pass of the multi-token-prediction head.
_STEP, _HEAD_PASS = 0, 1
_PR_SET_PDEATHSIG = 1


def _joined_key(rank: int) -> str:
    return f"nanovllm/joined/{rank}"


def _backend(config: EngineConfig) -> str:
    return (
        "nccl"
        if config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
        else "gloo"
    )


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ConfigError naming the numbers when the model cannot be split over `size` ranks."""
    tp = TPContext(0, size)
    tp.shard(cfg.num_attention_heads, "num_attention_heads")
    tp.kv_heads(cfg.num_key_value_heads)
    tp.shard(cfg.vocab_size, "vocab_size")
    tp.shard(cfg.intermediate_size, "intermediate_size")


def _cpu_group() -> dist.ProcessGroup | None:
    """The group that carries step inputs (CPU tensors): the default one under gloo, a gloo group beside
    NCCL (which only moves CUDA tensors). Every rank creates it right after joining, in the same order."""
    return dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None


class ShardRunner(Protocol):
    """What a rank 1..N-1 runs: the model runner, built for its TPContext (handed in by rank 0's runner,
    so this module never imports the runner that imports it)."""

    def __init__(self, config: EngineConfig, tp: TPContext) -> None: ...

    def forward(self, inputs: StepInputs) -> torch.Tensor | None: ...

    def head_pass(self, head_pass: HeadPass) -> None: ...

    def hidden_layout(self) -> tuple[int, torch.dtype, torch.device]:
        """Hidden size, dtype and device of the rows that follow a packed step (a HeadPass's hidden
        states, a step's image embeddings)."""
        ...


class TensorParallelGroup:
    """Rank 0's handle on ranks 1..N-1, each running `runner` (pickled by reference, so a class)."""

    def __init__(self, config: EngineConfig, runner: type[ShardRunner]) -> None:
        size = config.tensor_parallel_size
        check_shardable(config.model_config, size)  # a clear error before any process starts
        self.size = size
        store = dist.TCPStore(
            HOST, 0, world_size=size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
        )
        context = multiprocessing.get_context("spawn")
        self.procs = [
            context.Process(
                target=run_shard,
                args=(config, runner, rank, store.port, os.getpid()),
                name=f"nanovllm-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for proc in self.procs:
            proc.start()
        self._wait_until_joined(store)
        dist.init_process_group(
            _backend(config), store=store, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT
        )
        self._store = store  # kept open for the group's lifetime
        self._cpu_group = _cpu_group()
        log.info("tensor_parallel_started", size=size, pids=[p.pid for p in self.procs], port=store.port)

    def _wait_until_joined(self, store: dist.TCPStore) -> None:
        """Wait for every rank to reach the store, failing at once (not after a timeout) if one exits."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank in range(1, self.size):
            while not store.check([_joined_key(rank)]):
                self.raise_if_dead()
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"tensor-parallel rank {rank} did not start within {STARTUP_TIMEOUT_S:.0f} s"
                    )
                time.sleep(0.05)  # a rank's start-up (importing torch) takes seconds

    def send(self, inputs: StepInputs) -> None:
        """Give ranks 1..N-1 this step's inputs (they run the forward pass alongside rank 0), and its image
        embeddings, if it has images."""
        self._send(inputs, _STEP)
        if inputs.image_embeddings is not None:
            _broadcast_rows(inputs.image_embeddings.embeddings)

    def send_head_pass(self, head_pass: HeadPass) -> None:
        """Give ranks 1..N-1 a pass of the multi-token-prediction head: its inputs, then the hidden state of
        each row as bytes (any dtype; on the default group, which moves device tensors)."""
        self._send(head_pass.inputs, _HEAD_PASS)
        _broadcast_rows(head_pass.hidden)

    def _send(self, inputs: StepInputs, kind: int) -> None:
        self.raise_if_dead()
        packed = inputs.pack()
        header = torch.tensor([packed.numel(), kind], dtype=torch.long)
        dist.broadcast(header, src=0, group=self._cpu_group)
        dist.broadcast(packed, src=0, group=self._cpu_group)

    def raise_if_dead(self, cause: BaseException | None = None) -> None:
        """Raise EngineDeadError if a rank has exited. After a failed collective (`cause`), give the
        kernel a moment to reap the rank whose socket closed."""
        for rank, proc in enumerate(self.procs, start=1):
            if cause is not None:
                proc.join(0.5)
            if proc.exitcode is not None:
                raise EngineDeadError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
                    f"the engine cannot continue"
                ) from cause

    def shutdown(self) -> None:
        """Tell ranks 1..N-1 to stop, join them, and kill any that do not exit in time."""
        if all(proc.exitcode is None for proc in self.procs):
            try:
                stop = torch.tensor([_STOP, _STEP], dtype=torch.long)
                dist.broadcast(stop, src=0, group=self._cpu_group)
            except RuntimeError:  # a rank is already gone; the kill below covers the rest
                pass
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        log.info("tensor_parallel_stopped", exit_codes=[p.exitcode for p in self.procs])


def _broadcast_rows(rows: torch.Tensor) -> None:
    """Rank 0's rows of hidden-state width, as bytes (any dtype), on the default group (NCCL's moves device
    tensors); the other ranks take them with `_receive_rows`."""
    dist.broadcast(rows.contiguous().view(torch.uint8), src=0)


def _receive_rows(count: int, runner: ShardRunner) -> torch.Tensor:
    size, dtype, device = runner.hidden_layout()
    row_bytes = size * torch.empty(0, dtype=dtype).element_size()
    rows = torch.empty(count, row_bytes, dtype=torch.uint8, device=device)
    dist.broadcast(rows, src=0)
    return rows.view(dtype)


def run_shard(
    config: EngineConfig, runner_type: type[ShardRunner], rank: int, port: int, parent_pid: int
) -> None:
    """Entry point of ranks 1..N-1: join the group, build this rank's shard, run every step rank 0 sends."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # rank 0 died before the line above took effect
        os._exit(1)
    size = config.tensor_parallel_size
    store = dist.TCPStore(HOST, port, world_size=size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(_joined_key(rank), "1")
    dist.init_process_group(
        _backend(config), store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    cpu_group = _cpu_group()
    runner = runner_type(config, TPContext(rank, size, bool(config.deterministic)))  # resolved by now
    header = torch.empty(2, dtype=torch.long)
    while True:
        dist.broadcast(header, src=0, group=cpu_group)
        length, kind = header.tolist()
        if length == _STOP:
            break
        packed = torch.empty(length, dtype=torch.long)
        dist.broadcast(packed, src=0, group=cpu_group)
        inputs = StepInputs.unpack(packed)
        if kind == _HEAD_PASS:
            runner.head_pass(HeadPass(inputs, _receive_rows(len(inputs.input_ids), runner)))
            continue
        if inputs.image_embeddings is not None:
            embeddings = inputs.image_embeddings
            embeddings.embeddings = _receive_rows(len(embeddings.rows), runner)
        runner.forward(inputs)
    dist.destroy_process_group()
