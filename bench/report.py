"""What the benchmarks print: the machine, the load, percentiles, per-step summaries and ratio tables."""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess

import torch

from bench.ceiling import bracket
from bench.engine_run import NanoResult
from nanovllm.worker.device import cpu_bf16_support, cpu_flags


def machine_description() -> str:
    model = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), model
        )
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "bf16") if f in flags]
    return (
        f"{model}, nproc {os.cpu_count()}, torch threads {torch.get_num_threads()}, "
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, flags: {' '.join(shown) or 'none'}"
        f" ({cpu_bf16_support()[1]})"
    )


def load_average() -> str:
    """1/5/15-minute load: on a shared machine, anything above 0 means the timings include other work."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (q in [0, 1])."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")


def report_steps(result: NanoResult) -> None:
    steps = result.steps
    overhead = [s.overhead_s for s in steps]
    total = sum(s.wall_s for s in steps)
    decode_only = [s.decode_tokens for s in steps if s.prefill_tokens == 0 and s.decode_tokens]
    mixed = sum(1 for s in steps if s.prefill_tokens and s.decode_tokens)
    print(f"  steps: {len(steps)} ({sum(1 for s in steps if s.prefill_tokens)} with prefill, {mixed} mixed)")
    print(
        f"  python overhead per step (schedule + inputs + sampling + update): "
        f"{1e3 * statistics.mean(overhead):.2f} ms = {sum(overhead) / total:.1%} of step time;"
        f" model forward + LM head: {sum(s.forward_s for s in steps) / total:.1%}"
    )
    if decode_only:
        print(
            f"  decode batch size (decode-only steps): mean {statistics.mean(decode_only):.1f},"
            f" min {min(decode_only)}, p50 {percentile(decode_only, 0.5):.0f},"
            f" p90 {percentile(decode_only, 0.9):.0f}, max {max(decode_only)}"
        )
        buckets: dict[int, int] = {}
        for size in decode_only:
            lo, _ = bracket(size)
            buckets[lo] = buckets.get(lo, 0) + 1
        hist = ", ".join(f"{lo}-{2 * lo - 1}: {n}" for lo, n in sorted(buckets.items()))
        print(f"  decode batch size histogram (steps per size range): {hist}")
    print(f"  preemptions: {result.num_preemptions}, prefix-cache hit tokens: {result.num_cached_tokens}")


def print_summary(rows: list[tuple[str, float | None, str]], reference: float, title: str) -> None:
    print(f"\n### {title}\n")
    print("| engine | output tok/s | nanovllm / this | note |")
    print("|---|---:|---:|---|")
    for label, tps, note in rows:
        if tps is None:
            print(f"| {label} | n/a | n/a | {note} |")
        else:
            print(f"| {label} | {tps:,.1f} | {reference / tps:.2f}x | {note} |")
