"""What tracing costs: 64 concurrent gRPC streams through a router and worker with tracing off, and through
a second pair that traces every request (--trace-sample-ratio 1) to an OTLP collector in this process, in
alternating rounds; and p50 time to first token of sequential short calls on each.

Both pairs (the embedded SmolLM2 unless --model) are started here and share the machine, one idle while
the other runs. The workload is bench/http_api.py's: random token-id prompts of 32-128 tokens, greedy,
ignore_eos, --max-tokens new tokens. The collector's span count is printed as a check that the traced
pair did trace.

    .venv/bin/python -m bench.tracing [--rounds 3] [--streams 64] [--max-tokens 128] [--ttft-calls 50]
"""

from __future__ import annotations

import asyncio
import datetime
import statistics

from bench.http_api import parse_arguments, prompts, throughput, ttft_p50
from bench.report import machine_description
from nanovllm.server_process import ServerProcess, spawn, wait_until_serving
from nanovllm.worker.models.gguf.cache import embedded_model_path
from tests.otlp_collector import running_collector


def start_pair(model: str, tracing: list[str]) -> tuple[ServerProcess, ServerProcess]:
    local = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    worker = spawn(["worker", "--model", model, *local, *tracing])
    router = spawn(["router", "--worker", worker.address, *local, *tracing])
    if not wait_until_serving(router.address, alive=lambda: worker.proc.poll() is None):
        raise SystemExit("a worker exited before serving")
    return worker, router


def main() -> None:
    args = parse_arguments(__doc__)
    model = args.model or str(embedded_model_path())
    with running_collector() as (collector, endpoint):
        pairs = {
            "off": start_pair(model, []),
            "on": start_pair(model, ["--otlp-traces-endpoint", endpoint, "--trace-sample-ratio", "1"]),
        }
        try:
            workload = prompts(args.streams, 49152)
            short = prompts(args.ttft_calls, 49152, seed=1)
            for _, router in pairs.values():  # warm-up: caches, imports, the exporter's channel
                asyncio.run(throughput("grpc", router, workload[:8], 8))
            rates: dict[str, list[float]] = {"off": [], "on": []}
            firsts: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(args.rounds):
                for name, (_, router) in pairs.items():
                    rates[name].append(asyncio.run(throughput("grpc", router, workload, args.max_tokens)))
                    firsts[name].append(asyncio.run(ttft_p50("grpc", router, short)))
        finally:
            for worker, router in pairs.values():
                router.stop()
                worker.stop()
        spans = len(collector.spans)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine_description()}")
    print(
        f"{model}; {args.streams} concurrent gRPC streams of {args.max_tokens} tokens (random 32-128 token "
        f"prompts, greedy, ignore_eos), {args.rounds} alternating rounds; TTFT p50 of {args.ttft_calls} "
        f"sequential calls of 1 token; the collector received {spans} spans\n"
    )
    print("| tracing | tok/s (rounds) | median | vs off | TTFT p50 ms (median of rounds) |")
    print("|---|---|---:|---:|---:|")
    base = statistics.median(rates["off"])
    for name, label in (("off", "off"), ("on", "every request (ratio 1)")):
        median = statistics.median(rates[name])
        cells = ", ".join(f"{r:.0f}" for r in rates[name])
        print(
            f"| {label} | {cells} | {median:.0f} | {median / base:.2f}x | {statistics.median(firsts[name]) * 1e3:.2f} |"
        )
    delta = (statistics.median(firsts["on"]) - statistics.median(firsts["off"])) * 1e3
    ratio = statistics.median(rates["on"]) / base
    print(f"\non - off: TTFT p50 {delta:+.2f} ms (target <= 0.5 ms), throughput {ratio:.1%} (target >= 97%)")


if __name__ == "__main__":
    main()
