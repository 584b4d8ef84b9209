"""What TLS and auth cost: the same calls through a plaintext stack and a secured one, in one run.

Two stacks of one worker and one router each, on loopback, with the tiny random Qwen3 of the tests (so the
model's work is small and the per-call and per-message costs of TLS and auth weigh as much as they ever can),
or with `--shape smollm2-135m` a random model of that shape in the worker's default dtype (a model whose
compute sets the pace, as a served model's does):

  plaintext  router and worker without TLS, no auth;
  secured    mutual TLS between router and worker, TLS on the public port, bearer-token auth (a tokens file
             of 100 tokens, the client's the last one), certificates made for the run (tests/certs.py).

Rounds alternate between the stacks (ABBA order: plaintext, secured, secured, plaintext, ...) so that the
machine's other load falls on both; each round starts its stack afresh and runs it alone. Each round measures,
through one client channel (its TLS handshake made before timing):

  TTFT        one call at a time (a 32-token prompt, 8 tokens): first response carrying tokens - send;
  throughput  `--requests` calls of 16-128 prompt and 32-128 output tokens, `--concurrency` at a time:
              tokens / wall time (a few seconds per round: shorter rounds swung by 20% on this machine).

Prints p50 TTFT and throughput per stack (medians over rounds), their differences and ratio, and the medians of
the rounds' own differences and ratios (each round's two stacks ran back to back). The targets: TTFT +<= 1 ms at p50,
throughput >= 95% of plaintext.

Where the three processes run (`--placement`): on a machine with fewer cores than processes, this decides
whose CPU TLS takes from.

  client-alone  (default) this client on the last CPU, the worker and the router on the others: as a
                client on another machine, whose own TLS and parsing take nothing from the servers' CPUs
                (in router-alone and pin-worker they do: the secured client's decryption is then timed as
                the stack's cost);
  router-alone  the router on the last CPU, the worker and this client on the others: as a router pod
                with its own CPU;
  shared        all three on every CPU (with the tiny model, the worker's OpenMP threads busy-wait between
                ops on the cores the router and client need: add --worker-threads 1 to keep it to one core);
  pin-worker    the worker on the first CPU, the router and this client on the others.

Usage: .venv/bin/python -m bench.security [--rounds 9] [--ttft-calls 100] [--requests 512] [--concurrency 64]
                                          [--shape smollm2-135m] [--placement client-alone] [--worker-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil

from bench.models import SHAPES, build_serving_model
from bench.placement import PLACEMENTS, place
from bench.report import cpu_model, load_average, percentile
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.certs import CertificateAuthority
from tests.model_factory import build_model
from tests.services import ServerProcess, start_router, start_worker, wait_serving

TOKENS_IN_FILE = 100


@dataclass
class Stack:
    name: str
    secured: bool
    ttft_p50_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    tokens_per_response: list[float] = field(default_factory=list)
    router_us_per_token: list[float] = field(default_factory=list)  # the router's CPU time (user + system)
    client_us_per_token: list[float] = field(default_factory=list)  # this process's


@dataclass
class Endpoint:
    """A running stack's public address and what a client needs to call it."""

    address: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    router_pid: int = 0

    def channel(self) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.address)
        return grpc.aio.secure_channel(self.address, self.credentials)


@dataclass
class Setup:
    """What both stacks share: the model, and for the secured one its certificates and tokens file."""

    root: Path
    model: Path
    dtype: str
    ca: CertificateAuthority
    token: str
    worker_cpus: set[int] | None = None  # None: every CPU this process may use
    router_cpus: set[int] | None = None
    worker_threads: int | None = None  # None: the worker's own default

    @classmethod
    def make(cls, root: Path, shape: str | None) -> Setup:
        if shape is None:
            model, dtype = build_model("qwen3", root / "model", seed=1), "float32"
        else:
            model, dtype = build_serving_model(shape), "auto"
        tokens = [f"client{i}:{'k' * 8}{i:024d}" for i in range(TOKENS_IN_FILE)]
        (root / "tokens").write_text("\n".join(tokens) + "\n")
        return cls(root, model, dtype, CertificateAuthority(root / "ca"), tokens[-1].split(":", 1)[1])


@contextmanager
def running(stack: Stack, setup: Setup) -> Iterator[Endpoint]:
    """Start `stack`'s worker and router (SERVING), alone on the machine; kill both on the way out. One
    stack at a time, so that neither holds CPUs (worker/runner/cpu_share.py) or memory while the other is timed."""
    root, ca = setup.root, setup.ca
    engine = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--dtype", setup.dtype]
    if setup.worker_threads is not None:
        engine += ["--num-threads", str(setup.worker_threads)]
    worker_flags: list[str] = []
    router_flags: list[str] = []
    endpoint = Endpoint("", None, ())
    if stack.secured:
        worker_cert, router_cert, public = ca.issue("worker"), ca.issue("router"), ca.issue("public")
        worker_flags = ["--worker-tls-cert", str(worker_cert.cert), "--worker-tls-key", str(worker_cert.key)]
        worker_flags += ["--worker-tls-ca", str(ca.ca_path)]
        router_flags = ["--worker-tls-cert", str(router_cert.cert), "--worker-tls-key", str(router_cert.key)]
        router_flags += ["--worker-tls-ca", str(ca.ca_path), "--tls-cert", str(public.cert)]
        router_flags += ["--tls-key", str(public.key), "--auth-tokens-file", str(root / "tokens")]
        credentials = grpc.ssl_channel_credentials(ca.ca_path.read_bytes())
        endpoint = Endpoint("", credentials, (("authorization", f"Bearer {setup.token}"),))
    processes: list[ServerProcess] = []
    try:
        logs = root / stack.name.replace(" ", "")
        worker = start_worker(
            setup.model,
            *engine,
            *worker_flags,
            log_path=logs.with_suffix(".worker.log"),
            cpus=setup.worker_cpus,
        )
        processes.append(worker)
        router = start_router(
            [worker.address], *router_flags, log_path=logs.with_suffix(".router.log"), cpus=setup.router_cpus
        )
        processes.append(router)
        wait_serving(router.address, credentials=endpoint.credentials)
        endpoint.address, endpoint.router_pid = router.address, router.proc.pid
        yield endpoint
    finally:
        for process in reversed(processes):
            process.kill()


async def _call(stub, request: generate_pb2.GenerateRequest, metadata) -> tuple[float, int, int]:
    """(TTFT in seconds, tokens, responses) of one call."""
    sent, first, tokens, responses = time.perf_counter(), None, 0, 0
    async for response in stub.Generate(request, metadata=metadata):
        if response.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(response.token_ids)
        responses += 1
    return first - sent, tokens, responses


async def measure(stack: Stack, endpoint: Endpoint, ttft_calls: int, requests: int, concurrency: int) -> None:
    """One round on one stack: sequential calls for TTFT, then `requests` calls for throughput."""
    rng = random.Random(7)
    async with endpoint.channel() as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        short = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=list(range(3, 35))),
            sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            return_token_ids=True,
        )
        for _ in range(5):  # warm-up: the connection (and its handshake), the engine's first steps
            await _call(stub, short, endpoint.metadata)
        ttfts = [(await _call(stub, short, endpoint.metadata))[0] for _ in range(ttft_calls)]
        stack.ttft_p50_ms.append(percentile(ttfts, 0.5) * 1e3)
        batch = [
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(
                    ids=[rng.randrange(3, 500) for _ in range(rng.randint(16, 128))]
                ),
                sampling=generate_pb2.SamplingParams(
                    temperature=0, max_tokens=rng.randint(32, 128), ignore_eos=True
                ),
                return_token_ids=True,
            )
            for _ in range(requests)
        ]
        slots = asyncio.Semaphore(concurrency)

        async def call(request: generate_pb2.GenerateRequest) -> tuple[float, int, int]:
            async with slots:
                return await _call(stub, request, endpoint.metadata)

        router = psutil.Process(endpoint.router_pid)
        router_cpu, client_cpu, t0 = _cpu_s(router), time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(call(r) for r in batch))
        elapsed = time.perf_counter() - t0
        tokens = sum(tokens for _, tokens, _ in results)
        stack.tokens_per_s.append(tokens / elapsed)
        stack.router_us_per_token.append((_cpu_s(router) - router_cpu) / tokens * 1e6)
        stack.client_us_per_token.append((time.process_time() - client_cpu) / tokens * 1e6)
        stack.tokens_per_response.append(tokens / sum(responses for _, _, responses in results))


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def report(plain: Stack, secure: Stack, args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    model = args.shape or "the tiny test Qwen3"
    threads = args.worker_threads or "its default"
    print(f"\n### TLS and auth overhead ({now}, {cpu_model()}, load {load_average()}, {model})\n")
    print(f"placement {args.placement}, worker threads {threads}; ", end="")
    print(
        f"{args.rounds} alternating rounds; p50 TTFT over {args.ttft_calls} sequential calls, throughput of"
    )
    print(
        f"{args.requests} calls, {args.concurrency} at a time; medians over rounds (each round's value in "
        "brackets).\n"
    )
    print(
        "| stack | p50 TTFT | throughput | tokens per response | router CPU per token | client CPU per token |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for stack in (plain, secure):
        print(
            f"| {stack.name} | {_median(stack.ttft_p50_ms, '.2f')} ms | {_median(stack.tokens_per_s, '.0f')} tok/s | "
            f"{_median(stack.tokens_per_response, '.2f')} | {_median(stack.router_us_per_token, '.1f')} µs | "
            f"{_median(stack.client_us_per_token, '.1f')} µs |"
        )
    ttft_delta = statistics.median(secure.ttft_p50_ms) - statistics.median(plain.ttft_p50_ms)
    ttft_paired = statistics.median(s - p for s, p in zip(secure.ttft_p50_ms, plain.ttft_p50_ms, strict=True))
    ratio = statistics.median(secure.tokens_per_s) / statistics.median(plain.tokens_per_s)
    paired = statistics.median(s / p for s, p in zip(secure.tokens_per_s, plain.tokens_per_s, strict=True))
    capacity = statistics.median(plain.router_us_per_token) / statistics.median(secure.router_us_per_token)
    print(
        f"\nsecured - plaintext: p50 TTFT {ttft_delta:+.2f} ms (target <= +1 ms), median of the rounds' "
        f"differences {ttft_paired:+.2f} ms; throughput {ratio:.1%} of "
        f"plaintext (target >= 95%), median of the rounds' ratios {paired:.1%}; tokens one router can serve "
        f"per CPU second {capacity:.1%} of plaintext"
    )


def _median(values: list[float], spec: str) -> str:
    """The median, then each round's value in brackets."""
    rounds = ", ".join(format(x, spec) for x in values)
    return f"{format(statistics.median(values), spec)} ({rounds})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--ttft-calls", type=int, default=100)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: the tests' tiny Qwen3")
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="client-alone")
    parser.add_argument("--worker-threads", type=int, help="the worker's --num-threads (default: its own)")
    args = parser.parse_args(argv)
    try:
        worker_cpus, router_cpus, _ = place(args.placement)
    except ValueError as exc:
        parser.error(str(exc))
    plain, secure = Stack("plaintext", secured=False), Stack("TLS + mTLS + auth", secured=True)
    with tempfile.TemporaryDirectory(prefix="nanovllm-bench-security-") as tmp:
        setup = Setup.make(Path(tmp), args.shape)
        setup.worker_threads = args.worker_threads
        setup.worker_cpus, setup.router_cpus = worker_cpus, router_cpus
        for round_ in range(args.rounds):
            for stack in (plain, secure) if round_ % 2 == 0 else (secure, plain):
                with running(stack, setup) as endpoint:
                    asyncio.run(measure(stack, endpoint, args.ttft_calls, args.requests, args.concurrency))
    report(plain, secure, args)


if __name__ == "__main__":
    main()
