"""What TLS and auth cost: the same calls through a plaintext stack and a secured one, in one run.

Two stacks of one worker and one router each, on loopback, with the tiny random Qwen3 of the tests (so the
model's work is small and the per-call and per-message costs of TLS and auth weigh as much as they ever can):

  plaintext  router and worker without TLS, no auth;
  secured    mutual TLS between router and worker, TLS on the public port, bearer-token auth (a tokens file
             of 100 tokens, the client's the last one), certificates made for the run (tests/certs.py).

Rounds alternate between the stacks (ABBA order: plaintext, secured, secured, plaintext, ...) so that the machine's other load
falls on both. Each round measures, through one client channel (its TLS handshake made before timing):

  TTFT        one call at a time (a 32-token prompt, 8 tokens): first response carrying tokens - send;
  throughput  `--requests` calls of 16-128 prompt and 32-128 output tokens, all at once: tokens / wall time.

Prints p50 TTFT and throughput per stack (medians over rounds), their differences and ratio. The targets:
TTFT +<= 1 ms at p50, throughput >= 95% of plaintext.

Usage: .venv/bin/python -m bench.security [--rounds 3] [--ttft-calls 100] [--requests 64]
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

from bench.report import cpu_model, load_average, percentile
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.certs import CertificateAuthority
from tests.model_factory import build_model
from tests.services import ServerProcess, start_router, start_worker, wait_serving

TOKENS_IN_FILE = 100


@dataclass
class Stack:
    name: str
    address: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    ttft_p50_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)

    def channel(self) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.address)
        return grpc.aio.secure_channel(self.address, self.credentials)


@contextmanager
def stacks(root: Path) -> Iterator[list[Stack]]:
    """Start both stacks (all SERVING); kill every process on the way out."""
    model = build_model("qwen3", root / "model", seed=1)
    ca = CertificateAuthority(root / "ca")
    worker_cert, router_cert, public = ca.issue("worker"), ca.issue("router"), ca.issue("public")
    tokens = [f"client{i}:{'k' * 8}{i:024d}" for i in range(TOKENS_IN_FILE)]
    (root / "tokens").write_text("\n".join(tokens) + "\n")
    token = tokens[-1].split(":", 1)[1]
    engine = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB"]
    processes: list[ServerProcess] = []
    try:
        plain_worker = start_worker(model, *engine, log_path=root / "plain-worker.log")
        processes.append(plain_worker)
        plain = start_router([plain_worker.address], log_path=root / "plain-router.log")
        processes.append(plain)
        mtls = ["--worker-tls-cert", str(worker_cert.cert), "--worker-tls-key", str(worker_cert.key)]
        secure_worker = start_worker(
            model, *engine, *mtls, "--worker-tls-ca", str(ca.ca_path), log_path=root / "tls-worker.log"
        )
        processes.append(secure_worker)
        secure = start_router(
            [secure_worker.address],
            *("--worker-tls-cert", str(router_cert.cert), "--worker-tls-key", str(router_cert.key)),
            *(
                "--worker-tls-ca",
                str(ca.ca_path),
                "--tls-cert",
                str(public.cert),
                "--tls-key",
                str(public.key),
            ),
            *("--auth-tokens-file", str(root / "tokens")),
            log_path=root / "tls-router.log",
        )
        processes.append(secure)
        client_credentials = grpc.ssl_channel_credentials(ca.ca_path.read_bytes())
        wait_serving(plain.address)
        wait_serving(secure.address, credentials=client_credentials)
        yield [
            Stack("plaintext", plain.address, None, ()),
            Stack(
                "TLS + mTLS + auth",
                secure.address,
                client_credentials,
                (("authorization", f"Bearer {token}"),),
            ),
        ]
    finally:
        for process in reversed(processes):
            process.kill()


async def _call(stub, request: generate_pb2.GenerateRequest, metadata) -> tuple[float, int]:
    """(TTFT in seconds, tokens) of one call."""
    sent, first, tokens = time.perf_counter(), None, 0
    async for response in stub.Generate(request, metadata=metadata):
        if response.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(response.token_ids)
    return first - sent, tokens


async def measure(stack: Stack, ttft_calls: int, requests: int) -> None:
    """One round on one stack: sequential calls for TTFT, then every request at once for throughput."""
    rng = random.Random(7)
    async with stack.channel() as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        short = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=list(range(3, 35))),
            sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            return_token_ids=True,
        )
        for _ in range(5):  # warm-up: the connection (and its handshake), the engine's first steps
            await _call(stub, short, stack.metadata)
        ttfts = [(await _call(stub, short, stack.metadata))[0] for _ in range(ttft_calls)]
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
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_call(stub, r, stack.metadata) for r in batch))
        stack.tokens_per_s.append(sum(tokens for _, tokens in results) / (time.perf_counter() - t0))


def report(plain: Stack, secure: Stack, args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n### TLS and auth overhead ({now}, {cpu_model()}, load {load_average()})\n")
    print(
        f"{args.rounds} alternating rounds; p50 TTFT over {args.ttft_calls} sequential calls, throughput of"
    )
    print(f"{args.requests} concurrent calls; medians over rounds (each round's value in brackets).\n")
    print("| stack | p50 TTFT | throughput |")
    print("|---|---:|---:|")
    for stack in (plain, secure):
        ttft = ", ".join(f"{x:.2f}" for x in stack.ttft_p50_ms)
        tput = ", ".join(f"{x:.0f}" for x in stack.tokens_per_s)
        print(
            f"| {stack.name} | {statistics.median(stack.ttft_p50_ms):.2f} ms ({ttft}) | "
            f"{statistics.median(stack.tokens_per_s):.0f} tok/s ({tput}) |"
        )
    ttft_delta = statistics.median(secure.ttft_p50_ms) - statistics.median(plain.ttft_p50_ms)
    ratio = statistics.median(secure.tokens_per_s) / statistics.median(plain.tokens_per_s)
    print(
        f"| secured - plaintext | {ttft_delta:+.2f} ms (target <= +1 ms) | "
        f"{ratio:.1%} of plaintext (target >= 95%) |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-calls", type=int, default=100)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="nanovllm-bench-security-") as tmp,
        stacks(Path(tmp)) as (plain, secure),
    ):
        for round_ in range(args.rounds):
            for stack in (plain, secure) if round_ % 2 == 0 else (secure, plain):
                asyncio.run(measure(stack, args.ttft_calls, args.requests))
        report(plain, secure, args)


if __name__ == "__main__":
    main()
