"""Serving benchmark: concurrent streaming clients against a router, next to offline LLM.generate.

Both measurements run in one invocation, on bench/throughput.py's workload (random token prompts,
random output lengths, greedy, ignore_eos; its W64 by default) and with the same engine settings:

  * offline   LLM.generate over the whole workload in this process: output tokens / wall time;
  * serving   the same requests through the public gRPC API, a real router process in front of a real
              worker process, one streaming client per request (grpc.aio, one event loop, one channel):
                output tok/s  all generated tokens / (last response - first send);
                TTFT          first response that carries tokens - send;
                ITL           one sample per later token-bearing response: the gap to the previous one
                              divided by the tokens it carries (the worker streams every engine step, so
                              a response almost always carries one token).

Serving adds the router hop, gRPC streaming and incremental detokenization to the engine's work, and
client, router and worker share this machine's cores. The target: serving throughput at high concurrency
(all requests at once) at least 90% of offline. The greedy token ids of every request must match offline.

`--placement router-alone` gives the router a CPU of its own (bench/placement.py): on a small machine the
router is then the bound, as on a GPU machine, and its CPU per token is printed.

Usage:  .venv/bin/python -m bench.serving [--num-requests 64] [--concurrency N] [--router HOST:PORT]
                                         [--placement shared|pin-worker|router-alone|client-alone]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch

from bench.engine_run import build_llm, warm_up_nanovllm
from bench.models import SHAPES, build_serving_model
from bench.placement import PLACEMENT_HELP, PLACEMENTS, CpuSets, place
from bench.report import cpu_model, load_average, percentile
from bench.workload import Workload, greedy, make_workload
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.model_config import ModelConfig
from tests.services import ServerProcess, start, wait_serving

ITL_NOTE = "ITL: one sample per token-bearing response after the first, gap / tokens in it"


@dataclass
class Stream:
    """One request as its client saw it; times are time.perf_counter() seconds."""

    send: float
    responses: list[float] = field(default_factory=list)  # arrival of each token-bearing response
    tokens_per_response: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish: float = 0.0

    @property
    def ttft(self) -> float:
        return self.responses[0] - self.send

    @property
    def itl(self) -> list[float]:
        gaps = zip(self.responses, self.responses[1:], self.tokens_per_response[1:])
        return [(b - a) / k for a, b, k in gaps]


@dataclass
class Result:
    label: str
    requests: int
    concurrency: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


# --------------------------------------------------------------------------------------------------
# Offline


def run_offline(
    model_dir: Path, workload: Workload, args: argparse.Namespace
) -> tuple[Result, list[list[int]], list[str]]:
    """Time LLM.generate; return the result, each request's token ids, and the engine's worker flags."""
    llm = build_llm(model_dir, workload, args)
    warm_up_nanovllm(llm, llm.config.model_config.vocab_size)
    params = [greedy(n) for n in workload.output_lens]
    t0 = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    c = llm.config
    engine_flags = [
        *("--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs)),
        *("--max-num-batched-tokens", str(c.max_num_batched_tokens)),
        *("--kv-cache-memory", str(c.kv_cache_memory), "--block-size", str(c.kvcache_block_size)),
        *("--dtype", llm.engine.runner.placement.dtype_name, "--num-threads", str(c.num_threads)),
    ]
    del llm
    gc.collect()
    if torch.cuda.is_available():  # the worker started next needs the GPU memory this engine held
        torch.cuda.empty_cache()
    token_ids = [o["token_ids"] for o in outputs]
    total = sum(len(t) for t in token_ids)
    return Result("offline", len(workload), len(workload), total, wall), token_ids, engine_flags


# --------------------------------------------------------------------------------------------------
# Serving


async def stream_one(stub: generate_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> Stream:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        return_token_ids=True,
    )
    record = Stream(send=time.perf_counter())
    last = generate_pb2.GenerateResponse()
    async for last in stub.Generate(request):
        record.finish = time.perf_counter()
        if last.token_ids:
            record.responses.append(record.finish)
            record.tokens_per_response.append(len(last.token_ids))
            record.token_ids.extend(last.token_ids)
    if last.finish_reason != generate_pb2.FINISH_REASON_LENGTH:
        reason = generate_pb2.FinishReason.Name(last.finish_reason)
        raise RuntimeError(
            f"a request ended with {reason} after {len(record.token_ids)} tokens ({last.error or 'no error'})"
        )
    return record


async def run_clients(
    address: str,
    workload: Workload,
    concurrency: int,
    vocab: int,
    connections: int = 1,
    ready: Callable[[], None] = lambda: None,
) -> list[Stream]:
    """A warm-up round, `ready()`, then every request of the workload with at most `concurrency` in
    flight, dealt round-robin over `connections` connections (channels that share no subchannel)."""
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(connections)
    ]
    stubs = [generate_pb2_grpc.GenerationStub(channel) for channel in channels]
    try:
        warm = make_workload(max(4, connections), vocab, (16, 64), (8, 8), seed=12345)  # as throughput.py
        await asyncio.gather(
            *(
                stream_one(stubs[i % connections], p, n)
                for i, (p, n) in enumerate(zip(warm.prompts, warm.output_lens))
            )
        )
        ready()
        slots = asyncio.Semaphore(concurrency)  # FIFO: requests start in workload order

        async def limited(i: int, prompt: list[int], max_tokens: int) -> Stream:
            async with slots:
                return await stream_one(stubs[i % connections], prompt, max_tokens)

        requests = enumerate(zip(workload.prompts, workload.output_lens))
        return await asyncio.gather(*(limited(i, p, n) for i, (p, n) in requests))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


def _client_process(
    address: str, workload: Workload, concurrency: int, vocab: int, connections: int, wait: Callable[[], None]
) -> tuple[list[Stream], float]:
    """One client process's share: its streams and the CPU seconds it spent after the warm-up and
    `wait()` (the other client processes' warm-ups)."""
    cpu = [0.0]

    def ready() -> None:
        wait()
        cpu[0] = time.process_time()

    streams = asyncio.run(run_clients(address, workload, concurrency, vocab, connections, ready))
    return streams, time.process_time() - cpu[0]


def run_client_processes(
    address: str, workload: Workload, concurrency: int, vocab: int, processes: int, connections: int
) -> tuple[list[Stream], float]:
    """The workload's requests dealt round-robin to `processes` client processes (one Python event loop
    receives only so many responses a second) of `connections` connections each, started together; every
    stream in workload order, and the clients' CPU seconds after their warm-up."""
    if processes == 1:
        return _client_process(address, workload, concurrency, vocab, connections, lambda: None)
    context = multiprocessing.get_context("spawn")
    shares = [
        Workload(workload.prompts[i::processes], workload.output_lens[i::processes]) for i in range(processes)
    ]
    with context.Manager() as manager, ProcessPoolExecutor(processes, mp_context=context) as pool:
        barrier = manager.Barrier(processes)
        futures = [
            pool.submit(
                _client_process,
                address,
                share,
                max(1, concurrency // processes),
                vocab,
                connections,
                barrier.wait,
            )
            for share in shares
        ]
        results = [future.result() for future in futures]
    streams: list[Stream] = [None] * len(workload)  # type: ignore[list-item]
    for i, (share_streams, _) in enumerate(results):
        streams[i::processes] = share_streams
    return streams, sum(cpu for _, cpu in results)


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of a process and its children ("process": a router's other
    processes count as its own) and of each of their threads (by thread id), from /proc: a Python process
    whose busiest thread, or whose threads together, near the wall time is bound by its one interpreter
    lock."""

    def read(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name: state is field 3
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    procs = [Path(f"/proc/{pid}")]
    for task in (procs[0] / "task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just exited
            procs += [Path(f"/proc/{child}") for child in (task / "children").read_text().split()]
    seconds = {"process": 0.0}
    for proc in procs:
        with contextlib.suppress(FileNotFoundError):  # a child or thread that just exited
            seconds["process"] += read(proc / "stat")
            for task in (proc / "task").iterdir():
                seconds[task.name] = read(task / "stat")
    return seconds


def cpu_used(before: dict[str, float], after: dict[str, float]) -> str:
    """The process's CPU seconds between two cpu_seconds readings, and its busiest thread's."""
    threads = [seconds - before.get(tid, 0.0) for tid, seconds in after.items() if tid != "process"]
    return f"{after['process'] - before['process']:.1f} s (busiest thread {max(threads, default=0.0):.1f})"


def serving_result(streams: list[Stream], concurrency: int) -> Result:
    return Result(
        "serving",
        len(streams),
        concurrency,
        sum(len(s.token_ids) for s in streams),
        max(s.finish for s in streams) - min(s.send for s in streams),
        [s.ttft for s in streams],
        [gap for s in streams for gap in s.itl],
    )


def start_servers(
    model_dir: Path,
    engine_flags: list[str],
    servers: dict[str, ServerProcess],
    log_level: str,
    placement: CpuSets = (None, None, set()),
    router_processes: int = 1,
) -> str:
    """Add a worker with the offline engine's settings and a router of `router_processes` processes in
    front of it to `servers` (the caller stops them, also when this fails), on the CPUs `placement` gives
    them; return the router's address once both are SERVING (the router: all its processes)."""
    worker_cpus, router_cpus, _ = placement
    log_dir = Path(tempfile.mkdtemp(prefix="nanovllm-bench-"))
    print(f"server logs: {log_dir}")
    args = ["worker", "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", *engine_flags]
    args += [
        "--log-level",
        log_level,
        "--metrics-port",
        "0",
    ]  # debug logs every engine step (batch composition, forward time)
    worker = servers["worker"] = start(args, log_dir / "worker.log", worker_cpus)
    wait_serving(worker.address)
    args = ["router", "--worker", worker.address, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    args += ["--processes", str(router_processes)]
    router = servers["router"] = start(args, log_dir / "router.log", router_cpus)
    wait_serving(router.address)
    return router.address


def stop_servers(servers: dict[str, ServerProcess]) -> None:
    """SIGTERM, router first so that no request reaches a stopping worker; kill what does not exit."""
    for name, server in reversed(servers.items()):
        try:
            code = server.stop()
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.proc.returncode
        if code != 0:
            print(f"warning: the {name} at {server.address} exited with {code}", file=sys.stderr)


def run_serving(
    args: argparse.Namespace,
    model_dir: Path,
    engine_flags: list[str],
    workload: Workload,
    vocab: int,
    placement: CpuSets,
    router_processes: int,
) -> tuple[Result, list[Stream]]:
    """One serving run (servers of their own unless --router names one): its result and its streams."""
    servers: dict[str, ServerProcess] = {}
    try:
        address = args.router or start_servers(
            model_dir, engine_flags, servers, args.worker_log_level, placement, router_processes
        )
        before = {name: cpu_seconds(server.proc.pid) for name, server in servers.items()}
        streams, client_cpu = run_client_processes(
            address, workload, args.concurrency, vocab, args.client_processes, args.client_connections
        )
        after = {name: cpu_seconds(server.proc.pid) for name, server in servers.items()}
    finally:
        stop_servers(servers)
    serving = serving_result(streams, args.concurrency)
    responses = sum(len(s.responses) for s in streams)
    print(
        f"[serving] {serving.output_tokens:,} tokens in {serving.wall_s:.2f} s via {address}, "
        f"{responses:,} responses ({serving.output_tokens / responses:.2f} tokens each)"
    )
    cpu = [f"{args.client_processes} client process(es) {client_cpu:.1f} s"]
    cpu += [f"{name} {cpu_used(before[name], after[name])}" for name in after]
    print(
        f"CPU while serving ({serving.wall_s:.1f} s wall, warm-up included for the servers): {', '.join(cpu)}"
    )
    if "router" in after:
        router_us = 1e6 * (after["router"]["process"] - before["router"]["process"])
        print(
            f"router CPU: {router_us / responses:.0f} µs a response, {router_us / serving.output_tokens:.1f} "
            f"µs a token (placement {args.placement}, {router_processes} router process(es), "
            f"{args.client_processes} x {args.client_connections} client connections)"
        )
    return serving, streams


# --------------------------------------------------------------------------------------------------
# Reporting


def ms(values: list[float], q: float) -> str:
    return f"{1e3 * percentile(values, q):,.1f}" if values else "n/a"


def print_table(results: list[Result], reference: float) -> None:
    print(
        "\n| run | requests | concurrency | output tok/s | ratio to offline | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.label} | {r.requests} | {r.concurrency} | {r.tokens_per_s:,.1f} "
            f"| {r.tokens_per_s / reference:.1%} | {ms(r.ttft_s, 0.5)} | {ms(r.ttft_s, 0.99)} "
            f"| {ms(r.itl_s, 0.5)} | {ms(r.itl_s, 0.99)} |"
        )
    print(f"\nlatencies in ms; {ITL_NOTE}")


def write_json(
    args: argparse.Namespace,
    started: str,
    engine_flags: list[str],
    mismatches: int,
    results: list[Result],
    streams: list[Stream],
) -> None:
    t0 = min(s.send for s in streams)
    raw = {
        "date": started,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "args": vars(args),
        "engine_flags": engine_flags,
        "mismatches": mismatches,
        "itl_definition": ITL_NOTE,
        "results": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results],
        # Per request, in seconds from the first send: send, token-bearing responses, finish.
        "streams": [
            {
                "send": s.send - t0,
                "responses": [t - t0 for t in s.responses],
                "tokens_per_response": s.tokens_per_response,
                "finish": s.finish - t0,
            }
            for s in streams
        ],
    }
    args.json.write_text(json.dumps(raw, indent=1, default=str))


# --------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="HF model dir with a tokenizer")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="random model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=None, help="default: all requests at once")
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=None, help="cap each request's output (smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, here and worker")
    parser.add_argument(
        "--router",
        default=None,
        help="HOST:PORT of a running router (its engine settings are yours to match)",
    )
    parser.add_argument(
        "--client-processes", type=int, default=1, help="split the streams over this many client processes"
    )
    parser.add_argument(
        "--client-connections", type=int, default=1, help="connections of each client process to the router"
    )
    parser.add_argument(
        "--router-processes",
        type=int,
        nargs="+",
        default=[1],
        help="the router's --processes; several counts: one serving run for each, against one offline run",
    )
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="shared", help=PLACEMENT_HELP)
    parser.add_argument("--worker-log-level", default="info", help="debug: one log line per engine step")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = parser.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = args.num_requests
    if not (1 <= args.min_input <= args.max_input and 1 <= args.min_output <= args.max_output):
        parser.error("need 1 <= --min-input <= --max-input and 1 <= --min-output <= --max-output")
    counts = (args.num_requests, args.concurrency, args.max_tokens or 1, args.client_processes)
    if min(*counts, args.client_connections, *args.router_processes) < 1:
        parser.error(
            "--num-requests, --concurrency, --max-tokens, --client-processes, --client-connections and "
            "--router-processes must be >= 1"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        placement = place(args.placement)  # before the offline run: it runs where the clients will
    except ValueError as exc:
        sys.exit(str(exc))
    torch.set_num_threads(args.threads)
    model_dir = args.model or build_serving_model(args.shape)
    if args.router is None and not any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")
    ):
        # A router without tokenizer files never becomes SERVING: fail here rather than time out later.
        sys.exit(f"{model_dir} has no tokenizer.json or tokenizer.model, which the router needs")
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    workload = make_workload(
        args.num_requests,
        cfg.vocab_size,
        (args.min_input, args.max_input),
        (args.min_output, args.max_output),
        args.seed,
    )
    if args.max_tokens is not None:
        workload = Workload(workload.prompts, [min(n, args.max_tokens) for n in workload.output_lens])

    started = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"date: {started}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    print(f"load average at start: {load_average()}")
    print(f"model: {model_dir} ({cfg.architecture}), dtype {args.dtype}")
    print(
        f"workload: {len(workload)} requests, {workload.num_prompt_tokens:,} prompt tokens, "
        f"{workload.num_output_tokens:,} output tokens (seed {args.seed}), greedy, ignore_eos"
    )

    offline, expected, engine_flags = run_offline(model_dir, workload, args)
    print(f"engine: {' '.join(engine_flags)}")
    print(f"[offline] {offline.output_tokens:,} tokens in {offline.wall_s:.2f} s")

    results, mismatches, streams = [offline], 0, []
    for processes in args.router_processes:
        serving, streams = run_serving(
            args, model_dir, engine_flags, workload, cfg.vocab_size, placement, processes
        )
        if len(args.router_processes) > 1:
            serving.label = f"serving, {processes} router process{'es' if processes > 1 else ''}"
        results.append(serving)
        run_mismatches = sum(s.token_ids != e for s, e in zip(streams, expected))
        print(f"token-id mismatches, serving vs offline: {run_mismatches} of {len(workload)} requests")
        mismatches += run_mismatches
    print(f"load average at end: {load_average()} (timings are only comparable on an idle machine)")
    print_table(results, offline.tokens_per_s)

    if args.json is not None:
        write_json(args, started, engine_flags, mismatches, results, streams)
    # In float32 the engine is batch-invariant, so serving must reproduce offline exactly. In 16-bit dtypes
    # how requests happen to be batched changes rounding, and a few sequences may diverge after a while.
    if mismatches and "float32" in engine_flags:
        sys.exit(1)


if __name__ == "__main__":
    main()
