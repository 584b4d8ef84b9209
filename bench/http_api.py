"""The router's faces against each other: 64 concurrent streams through gRPC, through the OpenAI-compatible
HTTP API's completions, and through its chat completions and Responses API on the same text, in
alternating rounds, and p50 time to first token of sequential short calls on each.

One worker (the embedded SmolLM2 unless --model) and one router with --http-port, started here. Each
stream is a completion of a random token-id prompt (32-128 tokens), greedy, ignore_eos, --max-tokens new
tokens: gRPC's Generate with token_ids through grpc.aio, HTTP's /v1/completions with the same ids through
the official `openai` AsyncOpenAI client, `stream=True` (a chunk per response, as clients parse them);
chat completions and /v1/responses (stored, as by default) with the same user message of random words,
greedy (the two faces' prompts and so their tokens are the same; no ignore_eos in the Responses API).
Throughput: all tokens / (last chunk - first send). TTFT: --ttft-calls sequential calls of max_tokens 1
each, send to the first token-bearing response.

    .venv/bin/python -m bench.http_api [--rounds 3] [--streams 64] [--max-tokens 128] [--ttft-calls 50]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import time

import grpc
import openai

from bench.report import machine_description
from nanovllm.server_process import spawn, wait_until_serving
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.models.gguf.cache import embedded_model_path


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 128))] for _ in range(count)]


async def grpc_stream(stub, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one Generate stream."""
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling, return_token_ids=True
    )
    start, first, tokens = time.perf_counter(), 0.0, 0
    async for response in stub.Generate(request):
        if response.token_ids and not first:
            first = time.perf_counter() - start
        tokens += len(response.token_ids)
    return first, tokens


async def http_stream(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first text, tokens) of one /v1/completions stream."""
    start, first, usage = time.perf_counter(), 0.0, 0
    stream = await client.completions.create(
        model="",  # the one served
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and not first:
            first = time.perf_counter() - start
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return first, usage


def texts(workload: list[list[int]]) -> list[str]:
    """A user message of as many random words as each prompt has tokens, for the chat-based faces."""
    rng = random.Random(2)
    words = ["river", "stone", "quiet", "market", "seven", "lantern", "north", "copper", "garden", "slow"]
    return [" ".join(rng.choice(words) for _ in prompt) for prompt in workload]


async def chat_stream(client: openai.AsyncOpenAI, text: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first text, tokens) of one /v1/chat/completions stream."""
    start, first, usage = time.perf_counter(), 0.0, 0
    stream = await client.chat.completions.create(
        model="", messages=[{"role": "user", "content": text}], max_completion_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and not first:
            first = time.perf_counter() - start
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return first, usage


async def responses_stream(client: openai.AsyncOpenAI, text: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first text, tokens) of one /v1/responses stream."""
    start, first, usage = time.perf_counter(), 0.0, 0
    stream = await client.responses.create(
        model="", input=text, max_output_tokens=max_tokens, temperature=0, stream=True
    )
    async for event in stream:
        if event.type == "response.output_text.delta" and not first:
            first = time.perf_counter() - start
        if event.type in ("response.completed", "response.incomplete"):
            usage = event.response.usage.output_tokens
    return first, usage


_HTTP_STREAMS = {"http": http_stream, "chat": chat_stream, "responses": responses_stream}


def _inputs(face: str, workload: list[list[int]]) -> list:
    return texts(workload) if face in ("chat", "responses") else workload


async def throughput(face: str, router, workload: list[list[int]], max_tokens: int) -> float:
    if face == "grpc":
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            start = time.perf_counter()
            results = await asyncio.gather(*(grpc_stream(stub, p, max_tokens) for p in workload))
    else:
        client = openai.AsyncOpenAI(
            base_url=f"http://{router.http_address}/v1", api_key="none", max_retries=0
        )
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_HTTP_STREAMS[face](client, p, max_tokens) for p in _inputs(face, workload))
        )
        await client.close()
    return sum(tokens for _, tokens in results) / (time.perf_counter() - start)


async def ttft_p50(face: str, router, workload: list[list[int]]) -> float:
    if face == "grpc":
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            firsts = [(await grpc_stream(stub, p, 1))[0] for p in workload]
    else:
        client = openai.AsyncOpenAI(
            base_url=f"http://{router.http_address}/v1", api_key="none", max_retries=0
        )
        firsts = [(await _HTTP_STREAMS[face](client, p, 1))[0] for p in _inputs(face, workload)]
        await client.close()
    return statistics.median(firsts)


FACES = {
    "grpc": "gRPC",
    "http": "HTTP completions (openai client, SSE)",
    "chat": "HTTP chat completions (text)",
    "responses": "HTTP Responses API (text, stored)",
}


def parse_arguments(doc: str) -> argparse.Namespace:
    """The workload's flags, shared with bench/tracing.py."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-calls", type=int, default=50)
    return parser.parse_args()


def main() -> None:
    args = parse_arguments(__doc__)
    model = args.model or str(embedded_model_path())
    worker = spawn(["worker", "--model", model, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"])
    router = spawn(
        ["router", "--worker", worker.address, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
        + ["--http-port", "0"]
    )
    try:
        if not wait_until_serving(router.address, alive=lambda: worker.proc.poll() is None):
            raise SystemExit("the worker exited before serving")
        workload = prompts(args.streams, 49152)
        short = prompts(args.ttft_calls, 49152, seed=1)
        for face in FACES:  # warm-up: every face, caches, imports
            asyncio.run(throughput(face, router, workload[:8], 8))
        rates: dict[str, list[float]] = {face: [] for face in FACES}
        firsts: dict[str, list[float]] = {face: [] for face in FACES}
        for _ in range(args.rounds):
            for face in FACES:
                rates[face].append(asyncio.run(throughput(face, router, workload, args.max_tokens)))
                firsts[face].append(asyncio.run(ttft_p50(face, router, short)))
    finally:
        router.stop()
        worker.stop()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine_description()}")
    print(
        f"{model}; {args.streams} concurrent streams of {args.max_tokens} tokens (random 32-128 token "
        f"prompts, greedy, ignore_eos), {args.rounds} alternating rounds; TTFT p50 of {args.ttft_calls} "
        f"sequential calls of 1 token\n"
    )
    print("| face | tok/s (rounds) | median | vs gRPC | TTFT p50 ms (median of rounds) |")
    print("|---|---|---:|---:|---:|")
    base = statistics.median(rates["grpc"])
    for face, name in FACES.items():
        median = statistics.median(rates[face])
        cells = ", ".join(f"{r:.0f}" for r in rates[face])
        ttft = statistics.median(firsts[face]) * 1e3
        print(f"| {name} | {cells} | {median:.0f} | {median / base:.2f}x | {ttft:.2f} |")
    delta = (statistics.median(firsts["http"]) - statistics.median(firsts["grpc"])) * 1e3
    print(
        f"\nHTTP - gRPC: TTFT p50 {delta:+.2f} ms (target within 2 ms), throughput {statistics.median(rates['http']) / base:.1%} (target >= 90%)"
    )
    chat, responses = statistics.median(rates["chat"]), statistics.median(rates["responses"])
    delta = (statistics.median(firsts["responses"]) - statistics.median(firsts["chat"])) * 1e3
    print(
        f"Responses / chat completions: throughput {responses / chat:.1%} (target >= 95%), TTFT p50 {delta:+.2f} ms"
    )


if __name__ == "__main__":
    main()
