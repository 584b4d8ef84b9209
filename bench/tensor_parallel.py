"""Per-step cost of tensor parallelism: decode steps with TP=1 and TP=2 on the same random checkpoint.

Each configuration adds `batch` requests, prefills them, then times `--steps` decode steps (the median).
TP=2 splits the cores between its two ranks (one torch thread each on this 2-core CPU), so the
comparison that shows the communication cost is TP=2 against TP=1 with the same total threads (2) and
against TP=1 with one thread (what each rank computes with). The broadcast of each step's inputs from
rank 0 is timed on its own.

Usage: .venv/bin/python -m bench.tensor_parallel [--shape qwen3-0.6b] [--batch 1 16] [--steps 20]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

from bench.models import SHAPES, build_random_model
from nanovllm import LLM, SamplingParams


def time_decode(llm: LLM, batch: int, steps: int) -> tuple[float, float]:
    """Median decode step time and median broadcast time per step (0 without TP), in seconds."""
    engine = llm.engine
    group = engine.runner.tp_group
    send_times: list[float] = []
    if group is not None:
        send = group.send

        def timed_send(inputs):
            t = time.perf_counter()
            send(inputs)
            send_times.append(time.perf_counter() - t)

        group.send = timed_send
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(32)]
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        )
    engine.step()  # prefill
    durations = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        durations.append(time.perf_counter() - t)
    for i in range(batch):
        engine.abort_request(f"r{i}")
    engine.step()
    if group is not None:
        group.send = send
    return statistics.median(durations), statistics.median(send_times[-steps:]) if send_times else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model_dir = build_random_model(args.shape)
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}, shape {args.shape}, fp32")
    rows = []
    for label, tp, threads in [
        ("TP=1, 2 threads", 1, 2),
        ("TP=1, 1 thread", 1, 1),
        ("TP=2, 1 thread/rank", 2, 1),
    ]:
        llm = LLM(  # num_threads is split between the ranks: 1 each at TP=2
            str(model_dir),
            max_model_len=256,
            kv_cache_memory="512MiB",
            tensor_parallel_size=tp,
            num_threads=threads if tp == 1 else 2,
        )
        for batch in args.batch:
            step, send = time_decode(llm, batch, args.steps)
            rows.append((label, batch, step, send))
        llm.shutdown()
        del llm
    base = {b: s for label, b, s, _ in rows if label == "TP=1, 2 threads"}
    print("\n| configuration | batch | decode step (ms) | vs TP=1, 2 threads | step-input broadcast (ms) |")
    print("|---|---:|---:|---:|---:|")
    for label, batch, step, send in rows:
        print(f"| {label} | {batch} | {step * 1e3:.1f} | {step / base[batch]:.2f}x | {send * 1e3:.3f} |")


if __name__ == "__main__":
    main()
