"""Routing a fleet: several workers on loopback with small KV caches, so that the shared prefixes of the
workload exceed one worker's cache, behind routers with each policy (--routing round-robin, least-loaded,
and the default cost function). Scenarios (all by default; --only picks some):
  shared    8 groups of requests, each group sharing a 512-token prefix (a system prompt), 32 random
            tokens after it, 8 new tokens; 6 at a time in a shuffled order. Per policy: the prefix-cache
            hit ratio against an oracle's (every group's first request misses, every later one hits its
            whole prefix), TTFT p50/p90, requests/s.
  hot       after one request warmed it on one worker, a burst of 48 requests sharing one prefix: the
            busiest worker's share against the mean, the hit ratio.
  unshared  random prompts that share nothing: requests/s of each policy against least-loaded's.
  routers   the shared workload through two routers (calls alternate) against one: hit ratio and TTFT.
  kill      24 streams (half greedy, half seeded sampling with penalties), 200 tokens each, while a worker
            running some of them is SIGKILLed and restarted every 4 s: streams completed, and identical
            to an unbroken run.
Usage: .venv/bin/python -m bench.fleet [--only shared,hot,...] [--workers 3] [--quick]
Prints one markdown table per scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.report import cpu_model, load_average, percentile
from bench.robustness import table
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.model_factory import VOCAB, build_model
from tests.services import ServerProcess, start_router, start_worker, wait_idle, wait_serving, worker_load

SCENARIOS = ("shared", "hot", "unshared", "routers", "kill")
POLICIES = ("round-robin", "least-loaded", "cost")
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 32
BLOCK = 16
# float32, one thread each (they share this host's cores), and a KV cache of 3,072 tokens: about five of
# the 512-token prefixes with the requests running, fewer than the workload's eight.
KV_CACHE_TOKENS = 4608


def worker_flags(model: Path) -> tuple[str, ...]:
    config = json.loads((model / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    kv_bytes = KV_CACHE_TOKENS * per_token
    # Prefill chunks of 256 tokens: a request that hits the cache waits for one chunk of another's prefill,
    # not for all of it (the same for every policy).
    return (
        "--num-threads",
        "1",
        "--kv-cache-memory",
        str(kv_bytes),
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        "256",
    )


@dataclass
class Call:
    prompt: list[int]
    group: int  # requests of a group share their prefix; -1: shares nothing
    sampling: generate_pb2.SamplingParams


@dataclass
class Result:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]


# -------------------------------------------------------------------------------------------- workloads


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def shared_workload(groups: int, per_group: int, new_tokens: int, seed: int = 0) -> list[Call]:
    rng = random.Random(seed)
    prefixes = [_tokens(rng, PREFIX_TOKENS) for _ in range(groups)]
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    calls = [
        Call(prefixes[g] + _tokens(rng, SUFFIX_TOKENS), g, sampling)
        for g in range(groups)
        for _ in range(per_group)
    ]
    rng.shuffle(calls)
    return calls


def unshared_workload(count: int, new_tokens: int, seed: int = 1) -> list[Call]:
    rng = random.Random(seed)
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [Call(_tokens(rng, PREFIX_TOKENS + SUFFIX_TOKENS), -1, sampling) for _ in range(count)]


def split_warm_up(calls: list[Call]) -> tuple[list[Call], list[Call]]:
    """Each group's first request (sent first, one at a time, and not measured: the steady state is what
    routing decides) and the rest."""
    firsts: dict[int, Call] = {}
    for call in calls:
        firsts.setdefault(call.group, call)
    warm = list(firsts.values())
    return warm, [c for c in calls if all(c is not w for w in warm)]


def oracle_hit_ratio(calls: list[Call], warmed: frozenset[int] = frozenset()) -> float:
    """Every group's first request misses (unless its group is `warmed`); every later one finds its whole
    prefix cached."""
    seen: set[int] = set(warmed)
    hits = 0
    for call in calls:
        if call.group >= 0 and call.group in seen:
            hits += PREFIX_TOKENS // BLOCK * BLOCK
        seen.add(call.group)
    return hits / sum(len(c.prompt) for c in calls)


# ---------------------------------------------------------------------------------------------- running


@contextmanager
def fleet(model: Path, logs: Path, workers: int, policy: str, routers: int = 1) -> Iterator[tuple]:
    """(workers, routers), all SERVING; whatever the two lists hold at the end is killed (a worker restarted
    in place included)."""
    logs.mkdir(parents=True, exist_ok=True)
    backs: list[ServerProcess] = []
    fronts: list[ServerProcess] = []
    try:
        for i in range(workers):
            backs.append(start_worker(model, *worker_flags(model), log_path=logs / f"worker{i}.log"))
        for i in range(routers):
            flags = ("--routing", policy)
            fronts.append(start_router([w.address for w in backs], *flags, log_path=logs / f"router{i}.log"))
        for server in backs + fronts:
            wait_serving(server.address)
        yield backs, fronts
    finally:
        for server in backs + fronts:
            if server.proc.poll() is None:
                server.kill()


async def run(
    addresses: list[str], calls: list[Call], concurrency: int, keep_errors: bool = False
) -> tuple[list[Result | str], float]:
    """Every call, `concurrency` at a time, alternating between the routers; (results, seconds). With
    `keep_errors`, a failed call's result is its status ("CODE: details") instead of an exception."""
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [generate_pb2_grpc.GenerationStub(c) for c in channels]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, call: Call) -> Result | str:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=call.prompt), sampling=call.sampling, return_token_ids=True
        )
        async with gate:
            start = time.perf_counter()
            ttft, ids, last = None, [], None
            try:
                async for response in stubs[i % len(stubs)].Generate(request, timeout=600):
                    if ttft is None and response.token_ids:
                        ttft = time.perf_counter() - start
                    ids.extend(response.token_ids)
                    last = response
            except grpc.aio.AioRpcError as exc:
                if not keep_errors:
                    raise
                return f"{exc.code().name}: {exc.details()}"
        return Result(ttft, last.usage.prompt_tokens, last.usage.cached_prompt_tokens, ids)

    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
    finally:
        for channel in channels:
            await channel.close()
    return results, time.perf_counter() - start


def requests_per_worker(logs: Path, skip: int = 0) -> Counter:
    """Which worker finished each request, from the router's request_finished log lines, but for the
    first `skip` requests."""
    events = [json.loads(line) for line in (logs / "router0.log").read_text().splitlines()]
    finished = [e["worker"] for e in events if e.get("event") == "request_finished"]
    return Counter(finished[skip:])


def hit_ratio(results: list[Result]) -> float:
    return sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)


def ttft_ms(results: list[Result], q: float) -> float:
    return percentile([r.ttft_s * 1e3 for r in results], q / 100)


# -------------------------------------------------------------------------------------------- scenarios


def shared(model: Path, logs: Path, workers: int, calls: list[Call]) -> None:
    warm, calls = split_warm_up(calls)
    oracle = oracle_hit_ratio(calls, frozenset(c.group for c in warm))
    rows, p90 = [], {}
    for policy in POLICIES:
        with fleet(model, logs / f"shared-{policy}", workers, policy) as (_, routers):
            asyncio.run(run([routers[0].address], warm, 1))
            results, seconds = asyncio.run(run([routers[0].address], calls, 6))
        ratio = hit_ratio(results)
        p90[policy] = ttft_ms(results, 90)
        rows.append(
            [
                policy,
                f"{ratio:.3f} ({ratio / oracle:.2f})",
                f"{ttft_ms(results, 50):.0f}",
                f"{p90[policy]:.0f}",
                f"{len(calls) / seconds:.2f}",
            ]
        )
    for row in rows:
        row.append(f"{p90[row[0]] / p90['round-robin']:.2f}")
    table(
        f"shared prefixes: {len(calls)} requests in {len(warm)} groups (after one each to warm up), "
        f"{workers} workers (oracle hit ratio {oracle:.3f})",
        ["policy", "hit ratio (of oracle)", "TTFT p50 ms", "TTFT p90 ms", "requests/s", "p90 / round-robin"],
        rows,
    )


def hot(model: Path, logs: Path, workers: int, burst: int) -> None:
    calls = shared_workload(1, burst + 1, 16, seed=2)
    rows = []
    for policy in POLICIES:
        run_logs = logs / f"hot-{policy}"
        with fleet(model, run_logs, workers, policy) as (_, routers):
            asyncio.run(run([routers[0].address], calls[:1], 1))  # one worker caches the prefix
            results, _ = asyncio.run(run([routers[0].address], calls[1:], burst))
        served = requests_per_worker(run_logs, skip=1)  # not the warm-up request
        counts = [served.get(k, 0) for k in served] + [0] * (workers - len(served))
        mean = sum(counts) / workers
        rows.append(
            [
                policy,
                " / ".join(map(str, sorted(counts, reverse=True))),
                f"{max(counts) / mean:.2f}",
                f"{hit_ratio(results):.3f}",
                f"{ttft_ms(results, 90):.0f}",
            ]
        )
    table(
        f"hot prefix: a burst of {burst} requests sharing one prefix, {workers} workers",
        ["policy", "requests per worker", "busiest / mean", "hit ratio", "TTFT p90 ms"],
        rows,
    )


def unshared(model: Path, logs: Path, workers: int, count: int) -> None:
    calls = unshared_workload(count, 16)
    rates = {}
    for policy in POLICIES:
        with fleet(model, logs / f"unshared-{policy}", workers, policy) as (_, routers):
            _, seconds = asyncio.run(run([routers[0].address], calls, 6))
        rates[policy] = count / seconds
    table(
        f"nothing shared: {count} requests of {PREFIX_TOKENS + SUFFIX_TOKENS} random tokens, {workers} workers",
        ["policy", "requests/s", "against least-loaded"],
        [[p, f"{r:.2f}", f"{r / rates['least-loaded']:.2f}"] for p, r in rates.items()],
    )


def routers_(model: Path, logs: Path, workers: int, calls: list[Call]) -> None:
    warm, calls = split_warm_up(calls)
    oracle = oracle_hit_ratio(calls, frozenset(c.group for c in warm))
    rows = []
    for count in (1, 2):
        with fleet(model, logs / f"routers{count}", workers, "cost", routers=count) as (_, fronts):
            asyncio.run(run([r.address for r in fronts], warm, 1))
            results, seconds = asyncio.run(run([r.address for r in fronts], calls, 6))
        ratio = hit_ratio(results)
        rows.append(
            [
                count,
                f"{ratio:.3f} ({ratio / oracle:.2f})",
                f"{ttft_ms(results, 90):.0f}",
                f"{len(calls) / seconds:.2f}",
            ]
        )
    table(
        "router replicas: the shared workload through one router and through two (calls alternate)",
        ["routers", "hit ratio (of oracle)", "TTFT p90 ms", "requests/s"],
        rows,
    )


def kill_workload(count: int, tokens: int) -> list[Call]:
    """Half greedy, half seeded sampling with penalties and min_tokens: the state a resume must carry."""
    rng = random.Random(3)
    calls = []
    for i in range(count):
        if i % 2 == 0:
            sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        else:
            sampling = generate_pb2.SamplingParams(
                temperature=0.9,
                top_p=0.95,
                seed=i,
                repetition_penalty=1.1,
                frequency_penalty=0.3,
                min_tokens=tokens // 2,
                max_tokens=tokens,
            )
        calls.append(Call(_tokens(rng, 16), -1, sampling))
    return calls


class Killer:
    """Every `interval` seconds, SIGKILLs the worker running the most streams and starts it again on its
    port (the router reconnects once it is SERVING)."""

    def __init__(self, model: Path, logs: Path, workers: list[ServerProcess], interval: float) -> None:
        self.model, self.logs, self.workers, self.interval = model, logs, workers, interval
        self.kills = 0

    async def run(self, done: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(done.wait(), self.interval)
                return
            except asyncio.TimeoutError:
                pass
            running = await asyncio.to_thread(lambda: [self._running(w.address) for w in self.workers])
            if max(running) == 0:
                continue
            i = running.index(max(running))
            self.workers[i].kill()
            self.kills += 1
            port = int(self.workers[i].address.rsplit(":", 1)[1])
            log_path = self.logs / f"worker{i}-restart{self.kills}.log"
            self.workers[i] = await asyncio.to_thread(
                start_worker, self.model, *worker_flags(self.model), port=port, log_path=log_path
            )

    @staticmethod
    def _running(address: str) -> int:
        try:
            return worker_load(address).num_running
        except grpc.RpcError:  # restarting
            return 0


async def _run_under_kills(address: str, calls: list[Call], killer: Killer) -> list[Result | str]:
    done = asyncio.Event()
    chaos = asyncio.create_task(killer.run(done))
    try:
        results, _ = await run([address], calls, len(calls), keep_errors=True)
        return results
    finally:
        done.set()
        await chaos


def kill(model: Path, logs: Path, workers: int, streams: int, tokens: int, interval: float) -> None:
    calls = kill_workload(streams, tokens)
    with fleet(model, logs / "kill", workers, "cost") as (processes, routers):
        reference, _ = asyncio.run(run([routers[0].address], calls, streams))
        killer = Killer(model, logs / "kill", processes, interval)
        results = asyncio.run(_run_under_kills(routers[0].address, calls, killer))
        resumes = metric(routers[0].metrics_address, "nanovllm:request_resumes_total")
        for worker in killer.workers:
            wait_serving(worker.address)
            wait_idle(worker.address)
    completed = [r for r in results if isinstance(r, Result)]
    identical = sum(
        r.token_ids == ref.token_ids for r, ref in zip(results, reference) if isinstance(r, Result)
    )
    failures = Counter(r for r in results if isinstance(r, str))
    table(
        f"kill -9 under load: {streams} streams of {tokens} tokens (half seeded sampling), {workers} workers, "
        f"the busiest killed and restarted every {interval:.0f} s",
        ["kills", "resumes", "completed", "identical to the unbroken run", "failures"],
        [
            [
                killer.kills,
                f"{resumes:.0f}",
                f"{len(completed)}/{streams}",
                f"{identical}/{streams}",
                dict(failures) or "none",
            ]
        ],
    )


def metric(metrics_address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    logs = Path(tempfile.mkdtemp(prefix="nanovllm-fleet-"))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}, {cpu_model()}, load {load_average()}, logs in {logs}")
    # Big enough that prefilling a 512-token prefix costs far more than a decode step.
    model = build_model(
        "qwen3", logs / "model", num_layers=4, hidden=1024, heads=16, kv_heads=8, max_position=2048
    )
    calls = shared_workload(8, 3 if args.quick else 30, 8)
    if "shared" in chosen:
        shared(model, logs, args.workers, calls)
    if "hot" in chosen:
        hot(model, logs, args.workers, 12 if args.quick else 48)
    if "unshared" in chosen:
        unshared(model, logs, args.workers, 18 if args.quick else 90)
    if "routers" in chosen:
        routers_(model, logs, args.workers, calls)
    if "kill" in chosen:
        kill(model, logs, args.workers, 8 if args.quick else 24, 60 if args.quick else 600, 3.0)


if __name__ == "__main__":
    main()
