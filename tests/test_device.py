"""Device and dtype selection: read off the machine, explained, and refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from nanovllm import LLM
from nanovllm.common.errors import ConfigError
from nanovllm.worker.device import (
    cgroup_cpu_limit,
    cpu_bf16_support,
    cpu_flags,
    resolve_placement,
    usable_cpus,
)
from nanovllm.worker.runner.kv_cache import gpu_kv_cache_budget

EPYC_FLAGS = "fpu vme avx2 avx512f avx512bw avx512_bf16 avx512_vnni"
AVX2_FLAGS = "fpu vme sse4_2 avx avx2 fma"


def _cpuinfo(tmp_path: Path, key: str, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: test\n{key}\t\t: {flags}\n\nprocessor\t: 1\n")
    return path


def test_cpu_flags_read_x86_and_arm_formats(tmp_path: Path) -> None:
    assert "avx512_bf16" in cpu_flags(_cpuinfo(tmp_path, "flags", EPYC_FLAGS))
    assert "bf16" in cpu_flags(_cpuinfo(tmp_path, "Features", "fp asimd bf16 sve"))
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(
    "flags, native",
    [(EPYC_FLAGS, True), (AVX2_FLAGS, False), ("avx512f amx_tile amx_bf16", True), ("fp asimd bf16", True)],
)
def test_bf16_support_follows_the_flags(flags: str, native: bool) -> None:
    found, reason = cpu_bf16_support(frozenset(flags.split()))
    assert found is native
    assert ("native bf16" in reason) and (("no native" in reason) is not native)


def test_auto_dtype_matches_this_machine() -> None:
    """auto: bf16 on CUDA; on a CPU bf16 exactly when the CPU has native bf16, else float32."""
    placement = resolve_placement("auto", "auto")
    if placement.device.type == "cuda":
        assert placement.dtype in (torch.bfloat16, torch.float16)
    else:
        native, evidence = cpu_bf16_support()
        assert placement.dtype == (torch.bfloat16 if native else torch.float32)
        assert evidence in placement.reason
    assert placement.reason.startswith("auto:")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_explicit_dtypes_run_on_cpu(dtype: str) -> None:
    placement = resolve_placement("cpu", dtype)
    assert (placement.device.type, placement.dtype_name) == ("cpu", dtype)


@pytest.mark.parametrize(
    "device, dtype, message",
    [
        ("cpu", "float64", r"dtype 'float64' is not supported on device 'cpu'"),
        ("cpu", "int8", r"dtype 'int8' is not supported on device 'cpu'"),
        ("cuda:64", "bfloat16", r"device 'cuda:64'"),  # no machine has 65 GPUs
        ("tpu", "auto", r"device 'tpu'"),
        ("gpu", "auto", r"device 'gpu'"),
    ],
)
def test_bad_device_or_dtype_is_named(device: str, dtype: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_placement(device, dtype)


def test_bad_dtype_fails_before_any_rank_starts(qwen3_dir: Path) -> None:
    """Nothing starts half-way: neither an unknown dtype nor a missing device spawns a rank."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match=r"dtype 'float64' is not supported on device 'auto'"):
        LLM(str(qwen3_dir), dtype="float64", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"device 'cuda:64'"):
        LLM(str(qwen3_dir), device="cuda:64", dtype="bfloat16", tensor_parallel_size=2)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_gpu_budget_subtracts_only_this_engine() -> None:
    gib = 2**30
    assert gpu_kv_cache_budget(80 * gib, 0.9, 2 * gib, 3 * gib) == int(80 * gib * 0.9) - 5 * gib
    with pytest.raises(
        ConfigError, match=r"allows 7\.20 of 80\.00 GiB.*weights take 6\.00 GiB.*peak 1\.50 GiB"
    ):
        gpu_kv_cache_budget(80 * gib, 0.09, 6 * gib, int(1.5 * gib))


def test_largest_step_runs_without_a_kv_cache(qwen3_dir: Path) -> None:
    """The step CUDA sizing measures (max_num_batched_tokens of prompt in several max_model_len prompts,
    logits and the heaviest sampling for max_num_seqs rows) runs before any cache exists. Here on the CPU,
    on a throwaway engine whose caches are taken away, since no GPU is at hand; not deterministic, as on
    CUDA by default (on a CPU the batch-invariant prefill reads its keys from the paged cache)."""
    llm = LLM(
        str(qwen3_dir),
        device="cpu",
        deterministic=False,
        max_model_len=48,
        max_num_seqs=7,
        max_num_batched_tokens=100,
        kv_cache_memory="4MiB",
    )
    runner = llm.engine.runner
    for attn in runner.model.attention_layers():
        attn.k_cache = attn.v_cache = torch.empty(0)
    seen = {}

    def record(name: str, value: object) -> None:  # a hook that returns None leaves the output alone
        seen.setdefault(name, value)

    runner.model.register_forward_hook(lambda _m, args, _out: record("tokens", args[0].numel()))
    runner.model.lm_head.register_forward_hook(lambda _m, _args, out: record("logits", tuple(out.shape)))
    runner._run_largest_step()
    # 100 prompt tokens as prompts of 48, 48 and 4; logits for 7 rows over the whole vocabulary.
    assert seen == {"tokens": 100, "logits": (7, llm.engine.model_config.vocab_size)}
    assert all(attn.k_cache.numel() == 0 for attn in runner.model.attention_layers())  # nothing stored


@pytest.mark.parametrize(
    "files, limit",
    [
        ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no quota
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: two threads, rounded up
        ({"cpu.max": "100000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files at all
    ],
)
def test_cgroup_cpu_limit(tmp_path: Path, files: dict[str, str], limit: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == limit


def test_usable_cpus_is_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    import os

    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert usable_cpus(tmp_path) == 1


def test_engine_sets_its_thread_count(qwen3_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        LLM(str(qwen3_dir), kv_cache_memory="4MiB", device="cpu", num_threads=1)
        assert torch.get_num_threads() == 1
        llm = LLM(str(qwen3_dir), kv_cache_memory="4MiB", device="cpu")
        share = llm.engine.runner.cpu_share.current  # the usable CPUs, split with other engines' processes
        assert torch.get_num_threads() == share.threads
        assert share.threads == max(1, min(len(share.cpus), usable_cpus() // share.processes))
    finally:
        torch.set_num_threads(before)


def test_bad_thread_count_is_named(qwen3_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_threads must be >= 1 .*got 0"):
        LLM(str(qwen3_dir), kv_cache_memory="4MiB", device="cpu", num_threads=0)
