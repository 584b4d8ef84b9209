"""Robustness at full size: real router and worker processes on loopback, a tiny random Qwen3 (or --model).

Scenarios (all by default; --only picks some):
  soak      N calls (20,000) at concurrency 64: random sampling, 20% cancelled by the client after the
            first response, 10% with a deadline of 50-500 ms. Every call must end exactly once, with a
            finish reason or the status of its own cancel/deadline, and no KV block may be left.
  fuzz      5,000 hypothesis cases (tests/fuzz.py) beside bystander streams: counts by status; 0 INTERNAL,
            0 UNKNOWN, 0 bystander failures, 0 KV blocks left.
  drain     two workers, SIGTERM one while 100 calls run: failed calls per run (5 runs).
  kill      two workers, SIGKILL one while 100 calls run: failed calls sent after the kill (5 runs).
  prompt    8 greedy bystander streams of 1,000 tokens, p99 inter-token latency (per token) alone and while a 1 MB prompt arrives every
            250 ms (refused before tokenizing), and while prompts at the byte limit arrive (tokenized on the
            router's pool, then refused as too many tokens).
  threads   the same workload through one worker, then through two workers on this host: with the
            default thread setting (they split the CPUs: worker/runner/cpu_share.py), with every CPU each
            (--num-threads), and pinned to a CPU each. The pair's throughput as a share of the one
            worker's. A random model of SmolLM2-135M's shape in the worker's default dtype, so that the
            model's compute, not the router, sets the pace.

Usage: .venv/bin/python -m bench.robustness [--only soak,fuzz,...] [--quick]
Prints one markdown table per scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import itertools
import os
import random
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, settings

from bench.models import build_serving_model
from bench.report import cpu_model, percentile
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.fuzz import Bystanders, requests, run_request
from tests.model_factory import build_model
from tests.services import (
    ServerProcess,
    run_calls,
    start_router,
    start_worker,
    wait_idle,
    wait_serving,
)

SCENARIOS = ("soak", "fuzz", "drain", "kill", "prompt", "threads")
MAX_MODEL_LEN = 1024
DISTURB_INTERVAL_S = 0.25
BYSTANDER_TOKENS = 1000


@contextmanager
def servers(
    model: Path, num_workers: int, logs: Path, *worker_flags: str, pin: bool = False
) -> Iterator[tuple[list, ServerProcess]]:
    """Workers (float32: tokens comparable run to run) and a router in front of them, all SERVING. With
    `pin`, worker i may run on CPU i only (its affinity mask), as a host would split its cores."""
    workers: list[ServerProcess] = []
    router = None
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(num_workers):
            workers.append(
                start_worker(
                    model,
                    "--max-model-len",
                    str(MAX_MODEL_LEN),
                    "--kv-cache-memory",
                    "256MiB",
                    *worker_flags,
                    log_path=logs / f"worker{i}.log",
                    cpus={sorted(os.sched_getaffinity(0))[i]} if pin else None,
                )
            )
        router = start_router([w.address for w in workers], log_path=logs / "router.log")
        for server in (*workers, router):
            wait_serving(server.address)
        yield workers, router
    finally:
        for server in (router, *workers):
            if server is not None and server.proc.poll() is None:
                server.kill()


def table(title: str, header: list[str], rows: list[list[object]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")


# -------------------------------------------------------------------------------------------------- soak


async def _soak_call(stub, rng: random.Random, i: int, outcomes: Counter) -> None:
    sampling = generate_pb2.SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), max_tokens=rng.randint(1, 32)
    )
    if rng.random() < 0.5:
        sampling.seed = rng.randrange(2**31)
    request = generate_pb2.GenerateRequest(text=f"soak call {i} " * rng.randint(1, 20), sampling=sampling)
    cancel = rng.random() < 0.2
    timeout = rng.uniform(0.05, 0.5) if rng.random() < 0.1 else 120.0
    call = stub.Generate(request, timeout=timeout)
    finishes = 0
    try:
        async for response in call:
            finishes += response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
            if cancel:
                call.cancel()
        outcomes["ok" if finishes == 1 else f"ok with {finishes} finish reasons"] += 1
    except asyncio.CancelledError:
        outcomes["cancelled by the client" if cancel else "cancelled unasked"] += 1
    except grpc.aio.AioRpcError as exc:
        expected = (cancel and exc.code() == grpc.StatusCode.CANCELLED) or (
            timeout < 1 and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        )
        outcomes[exc.code().name.lower() + ("" if expected else " (unexpected)")] += 1


def soak(model: Path, logs: Path, calls: int, concurrency: int) -> None:
    with servers(model, 1, logs) as (workers, router):
        outcomes: Counter = Counter()
        rng = random.Random(0)

        async def run() -> None:
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                gate = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    async with gate:
                        await _soak_call(stub, rng, i, outcomes)

                await asyncio.gather(*(one(i) for i in range(calls)))

        t0 = time.perf_counter()
        asyncio.run(run())
        wall = time.perf_counter() - t0
        load = wait_idle(workers[0].address, timeout=60)
    rows = [[name, count] for name, count in sorted(outcomes.items())]
    rows += [
        ["calls ended", f"{sum(outcomes.values())} of {calls}"],
        ["KV blocks used after", load.kv_blocks_used],
    ]
    rows += [["wall time", f"{wall:.1f} s"]]
    table(f"soak: {calls} calls at concurrency {concurrency}", ["outcome", "calls"], rows)


# -------------------------------------------------------------------------------------------------- fuzz


def fuzz(model: Path, logs: Path, cases: int) -> None:
    codes: Counter = Counter()
    with servers(model, 1, logs) as (workers, router):
        with grpc.insecure_channel(router.address) as channel, Bystanders(router.address) as bystanders:

            @settings(
                max_examples=cases,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(request=requests())
            def case(request: generate_pb2.GenerateRequest) -> None:
                outcome = run_request(channel, request)
                error = generate_pb2.FINISH_REASON_ERROR in outcome.finish_reasons
                codes[outcome.code.name + (" with FINISH_REASON_ERROR" if error else "")] += 1

            t0 = time.perf_counter()
            case()
            wall = time.perf_counter() - t0
        load = wait_idle(workers[0].address, timeout=60)
    rows = [[name, count] for name, count in sorted(codes.items())]
    rows += [
        ["bystander calls completed / failed", f"{bystanders.completed} / {len(bystanders.failures)}"],
        ["KV blocks used after", load.kv_blocks_used],
        ["wall time", f"{wall:.1f} s"],
    ]
    table(f"fuzz: {sum(codes.values())} cases", ["status", "cases"], rows)
    for failure in bystanders.failures[:5]:
        print(f"bystander failure: {failure}")


# ------------------------------------------------------------------------------------------ drain, kill


def _hit(kind: str, worker: ServerProcess, at: list[float]) -> None:
    if kind == "drain":
        worker.proc.send_signal(signal.SIGTERM)
    else:
        worker.proc.kill()
    at.append(time.monotonic())


def failover(model: Path, logs: Path, kind: str, runs: int) -> None:
    rows = []
    for run in range(runs):
        with servers(model, 2, logs / f"{kind}{run}") as (workers, router):
            at: list[float] = []
            results = asyncio.run(
                run_calls(router.address, 100, 8, functools.partial(_hit, kind, workers[0], at))
            )
            counted = results if kind == "drain" else [(s, r) for s, r in results if s > at[0]]
            failed = [r for _, r in counted if r != generate_pb2.FINISH_REASON_LENGTH]
            rows.append([run + 1, len(counted), len(failed), "; ".join(sorted(set(map(str, failed))))[:120]])
    what = "SIGTERM (drain)" if kind == "drain" else "SIGKILL, counting calls sent after it"
    table(f"{kind}: two workers, {what}, 100 calls", ["run", "calls counted", "failed", "errors"], rows)


# -------------------------------------------------------------------------------------------------- prompt


async def _bystander_itl(address: str, disturb: str | None, limit_bytes: int) -> tuple[list[float], Counter]:
    """8 greedy streams of BYSTANDER_TOKENS tokens; meanwhile, with `disturb`, a big text prompt arrives every
    250 ms (a dozen or more of them while the streams run, so that p99 is not one hiccup's luck).
    Returns the bystanders' inter-token gaps and the big prompts' status codes."""
    big = {"1MB": "word " * 200_000, "limit": "w" * limit_bytes}.get(disturb or "", "")
    codes: Counter = Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        done = asyncio.Event()

        async def bystander(i: int) -> list[float]:
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[10 + i, 20, 30, 40]),
                sampling=generate_pb2.SamplingParams(
                    temperature=0, max_tokens=BYSTANDER_TOKENS, ignore_eos=True
                ),
                return_token_ids=True,
            )
            # Each token's arrival: the tokens of one response (the router merges updates that waited
            # behind a write) arrive together, so counting per response would drop their zero gaps.
            arrivals = []
            async for response in stub.Generate(request):
                arrivals += [time.perf_counter()] * len(response.token_ids)
            return [b - a for a, b in itertools.pairwise(arrivals[1:])]  # after the first token

        async def disturber() -> None:
            """One big prompt every 250 ms while the bystanders run."""
            while big and not done.is_set():
                request = generate_pb2.GenerateRequest(
                    text=big, sampling=generate_pb2.SamplingParams(max_tokens=1)
                )
                try:
                    async for _ in stub.Generate(request):
                        pass
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), DISTURB_INTERVAL_S)

        disturbing = asyncio.create_task(disturber())
        gaps = await asyncio.gather(*(bystander(i) for i in range(8)))
        done.set()
        await disturbing
    return [g for stream in gaps for g in stream], codes


def prompt(model: Path, logs: Path, runs: int) -> None:
    """Per run, and over all runs pooled: a p99 over every run's gaps moves less with one run's hiccups."""
    limit = 16 * MAX_MODEL_LEN
    rows = []
    pooled: dict[str, list[float]] = {"alone": [], "1MB": [], "limit": []}
    pooled_codes: dict[str, Counter] = {"1MB": Counter(), "limit": Counter()}

    def row(run: object, disturb: str, base: list[float], gaps: list[float], codes: Counter) -> list[object]:
        p99_base, p99 = percentile(base, 0.99), percentile(gaps, 0.99)
        return [
            run,
            disturb,
            f"{p99_base * 1e3:.2f}",
            f"{p99 * 1e3:.2f}",
            f"{p99 / p99_base:.2f}",
            dict(codes),
        ]

    with servers(model, 1, logs) as (_, router):
        for run in range(runs):
            base, _ = asyncio.run(_bystander_itl(router.address, None, limit))
            pooled["alone"] += base
            for disturb in ("1MB", "limit"):
                gaps, codes = asyncio.run(_bystander_itl(router.address, disturb, limit))
                pooled[disturb] += gaps
                pooled_codes[disturb] += codes
                rows.append(row(run + 1, disturb, base, gaps, codes))
    for disturb in ("1MB", "limit"):
        rows.append(row("all", disturb, pooled["alone"], pooled[disturb], pooled_codes[disturb]))
    table(
        f"big prompts beside 8 streams (byte limit {limit})",
        ["run", "big prompt", "p99 ITL alone, ms", "p99 ITL with it, ms", "ratio", "big prompts' status"],
        rows,
    )


# -------------------------------------------------------------------------------------------------- threads


async def _throughput(address: str, requests_: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        rng = random.Random(1)

        async def one(i: int) -> int:
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(
                    ids=[rng.randrange(3, 500) for _ in range(rng.randint(16, 128))]
                ),
                sampling=generate_pb2.SamplingParams(
                    temperature=0, max_tokens=rng.randint(32, 128), ignore_eos=True
                ),
                return_token_ids=True,
            )
            return sum([len(r.token_ids) async for r in stub.Generate(request)])

        await one(-1)  # warm-up
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(requests_))))
        return tokens / (time.perf_counter() - t0)


def threads(logs: Path, requests_: int, runs: int) -> None:
    model = build_serving_model("smollm2-135m")
    every_cpu = ["--num-threads", str(len(os.sched_getaffinity(0)))]
    pairs = {"two": ([], False), "two, every CPU": (every_cpu, False), "two pinned": ([], True)}
    rows = []
    for run in range(runs):
        results = {}
        for name, count, flags, pin in [("one", 1, [], False)] + [(k, 2, *v) for k, v in pairs.items()]:
            with servers(model, count, logs / f"threads{run}-{name}", "--dtype", "auto", *flags, pin=pin) as (
                workers,
                router,
            ):
                results[name] = asyncio.run(_throughput(router.address, requests_))
                for worker in workers:  # every block comes back (the last token can reach us first)
                    wait_idle(worker.address)
        one = results["one"]
        rows.append([run + 1, f"{one:.0f}"] + [f"{results[k]:.0f} ({results[k] / one:.2f})" for k in pairs])
    table(
        f"two workers on one host, default threads: {requests_} concurrent requests, tok/s (share of one)",
        ["run", "one worker", "two workers", "two, --num-threads <all CPUs>", "two, one CPU each (affinity)"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--model", type=Path, default=None, help="HF model dir with a tokenizer")
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    logs = Path(tempfile.mkdtemp(prefix="nanovllm-robustness-"))
    model = args.model or build_model("qwen3", logs / "model", seed=1, max_position=MAX_MODEL_LEN)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, logs in {logs}")
    quick = args.quick
    if "soak" in chosen:
        soak(model, logs / "soak", 500 if quick else 20_000, 64)
    if "fuzz" in chosen:
        fuzz(model, logs / "fuzz", 200 if quick else 5_000)
    for kind in ("drain", "kill"):
        if kind in chosen:
            failover(model, logs, kind, 1 if quick else 5)
    if "prompt" in chosen:
        prompt(model, logs / "prompt", 1 if quick else 6)
    if "threads" in chosen:
        threads(logs, 32 if quick else 64, 1 if quick else 3)


if __name__ == "__main__":
    main()
