"""Prefix-cache hits of requests sharing a system prompt through a router's chat API, Qwen3.5 (hybrid:
hits resume from snapshots of its linear layers' state) against Qwen3 (no state) on the same workload,
issue 81's acceptance: `--requests` chats (32) sharing a `--system-tokens` (about 300) system prompt, each
with its own question, default worker flags but the memory (float32), random small models
(tests/model_factory.py) behind one router. Then the same prompts as raw token ids (`token_ids`, no
chat: the worker gets no hint and finds where they branch itself), on a system prompt of their own. Per
model and mode: the share of prompt tokens served from the prefix cache, the first requests' cached
tokens; Qwen3.5's tokens against a worker without a prefix cache; the snapshot memory the Qwen3.5
worker reports (nanovllm:state_snapshot_bytes).

Usage:  .venv/bin/python -m bench.shared_prefix [--requests 32] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.report import cpu_model, load_average
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.metrics import scrape, value
from tests.model_factory import build_model
from tests.services import ServerProcess, start_router, start_worker, wait_serving

# served name -> (architecture, worker flags beyond tests/services.py's float32 and 32 MiB)
WORKERS = {
    "qwen3.5": ("qwen3_5", ()),
    "qwen3": ("qwen3", ()),
    "qwen3.5-no-cache": ("qwen3_5", ("--no-prefix-caching",)),
}
WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "model",
    "cache",
    "block",
    "state",
    "prompt",
    "token",
    "request",
    "answer",
    "system",
    "user",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@dataclass
class Outcome:
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]


async def _system_prompt(stub: generate_pb2_grpc.GenerationStub, rng: random.Random, tokens: int) -> str:
    """Words until the text is about `tokens` tokens long, as the model's tokenizer counts."""
    text = "You are a helpful assistant."
    while True:
        counted = await stub.Tokenize(generate_pb2.TokenizeRequest(model="qwen3", text=text))
        if len(counted.token_ids) >= tokens:
            return text
        text += " " + " ".join(rng.choice(WORDS) for _ in range(8))


async def _run(
    stub: generate_pb2_grpc.GenerationStub, requests: list[generate_pb2.GenerateRequest], concurrency: int
) -> list[Outcome]:
    gate = asyncio.Semaphore(concurrency)

    async def one(request: generate_pb2.GenerateRequest) -> Outcome:
        async with gate:
            ids, last = [], None
            async for response in stub.Generate(request, timeout=600):
                ids.extend(response.token_ids)
                last = response
            assert last is not None
            return Outcome(last.usage.prompt_tokens, last.usage.cached_prompt_tokens, ids)

    return list(await asyncio.gather(*(one(r) for r in requests)))


async def measure(router: ServerProcess, qwen3_5: ServerProcess, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        rows = []
        for mode in ("chat", "token_ids"):
            system = await _system_prompt(stub, rng, args.system_tokens)
            questions = [
                f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 10))) + "?"
                for i in range(args.requests)
            ]
            outcomes: dict[str, list[Outcome]] = {}
            for name in WORKERS:
                requests = []
                for question in questions:
                    chat = generate_pb2.Chat(
                        messages=[
                            generate_pb2.ChatMessage(role="system", content=system),
                            generate_pb2.ChatMessage(role="user", content=question),
                        ]
                    )
                    if mode == "token_ids":  # the same prompt, tokenized here: no chat, no hint
                        ids = (
                            await stub.Tokenize(generate_pb2.TokenizeRequest(model=name, chat=chat))
                        ).token_ids
                        prompt = {"token_ids": generate_pb2.TokenIds(ids=ids)}
                    else:
                        prompt = {"chat": chat}
                    requests.append(
                        generate_pb2.GenerateRequest(
                            model=name, sampling=sampling, return_token_ids=True, **prompt
                        )
                    )
                outcomes[name] = await _run(stub, requests, args.concurrency)
            same = [o.token_ids for o in outcomes["qwen3.5"]] == [
                o.token_ids for o in outcomes["qwen3.5-no-cache"]
            ]
            for name in ("qwen3.5", "qwen3"):
                got = outcomes[name]
                rate = sum(o.cached_tokens for o in got) / sum(o.prompt_tokens for o in got)
                first = ", ".join(str(o.cached_tokens) for o in got[:4])
                prompt_tokens = f"{min(o.prompt_tokens for o in got)}-{max(o.prompt_tokens for o in got)}"
                equal = ("yes" if same else "**no**") if name == "qwen3.5" else ""
                rows.append(f"| {mode} | {name} | {prompt_tokens} | {rate:.1%} | {first} | {equal} |")
    samples = scrape(qwen3_5.metrics_address)
    print(
        f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, load "
        f"{load_average()}; {args.requests} requests sharing a {args.system_tokens}-token system prompt, "
        f"{args.concurrency} at a time, {args.new_tokens} new tokens\n"
    )
    print("| prompt | model | prompt tokens | hit rate | first 4 cached | tokens = no-cache worker's |")
    print("|---|---|---:|---:|---|---|")
    print("\n".join(rows))
    snapshot_bytes = value(samples, "nanovllm:state_snapshot_bytes")
    usage = value(samples, "nanovllm:state_snapshot_usage_perc")
    print(
        f"\nqwen3.5 worker at the end: {snapshot_bytes / 2**20:.2f} MiB of state snapshots, {usage:.1%} of its rows"
    )


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="nanovllm-shared-prefix-") as tmp:
        root = Path(tmp)
        servers: list[ServerProcess] = []
        try:
            models = {
                arch: build_model(arch, root / arch, num_layers=4, seed=3) for arch in ("qwen3_5", "qwen3")
            }
            for name, (arch, flags) in WORKERS.items():
                flags = (*flags, "--served-model-name", name, "--max-model-len", "1024")
                servers.append(start_worker(models[arch], *flags, log_path=root / f"{name}.log"))
            workers = list(servers)
            servers.append(start_router([w.address for w in workers], log_path=root / "router.log"))
            for server in servers:
                wait_serving(server.address)
            asyncio.run(measure(servers[-1], workers[0], args))
        finally:
            for server in servers:
                if server.proc.poll() is None:
                    server.kill()


if __name__ == "__main__":
    main()
