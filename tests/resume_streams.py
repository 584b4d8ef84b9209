"""The streams a resume test runs and cuts: eight requests at once (half greedy, half seeded sampling with
penalties and min_tokens, optionally under a regex) through a router, the worker running them killed once
every stream has some tokens (tests/test_resume.py, tests/test_qwen3_5.py)."""

from __future__ import annotations

import asyncio

import grpc

from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.services import CALL_TIMEOUT_S

MAX_TOKENS = 300
STREAMS = 8


def requests(regex: str | None = None) -> list[generate_pb2.GenerateRequest]:
    """Half greedy, half seeded sampling with penalties and min_tokens (state a resume must carry); with
    `regex`, every request under it (the matcher's state, which a resume rebuilds)."""
    requests = []
    for i in range(STREAMS):
        if i % 2 == 0:
            sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        else:
            sampling = generate_pb2.SamplingParams(
                temperature=0.9,
                top_p=0.95,
                seed=1000 + i,
                repetition_penalty=1.1,
                frequency_penalty=0.3,
                presence_penalty=0.2,
                min_tokens=MAX_TOKENS // 2,
                max_tokens=MAX_TOKENS,
            )
        if regex:
            sampling.regex = regex
        requests.append(
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[7 + i, 40 + 3 * i, 90, 11 + i]),
                sampling=sampling,
                return_token_ids=True,
            )
        )
    return requests


async def stream(
    stub: generate_pb2_grpc.GenerationStub, request: generate_pb2.GenerateRequest, seen: list[int]
) -> tuple[list[int], str, str, int]:
    """Token ids, text, reasoning and finish reason of one call; `seen` grows as its tokens arrive."""
    text, reasoning = [], []
    finish = 0
    async for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        seen.extend(response.token_ids)
        text.append(response.text)
        reasoning.append(response.reasoning_text)
        finish = response.finish_reason or finish
    return list(seen), "".join(text), "".join(reasoning), finish


async def run(
    address: str, kill_when: int | None = None, kill=None, regex: str | None = None
) -> tuple[list, list[int]]:
    """Every request at once; with `kill_when`, `kill()` runs once every stream has that many tokens. Returns
    the results and each stream's token count at the kill."""
    at_kill: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        seen: list[list[int]] = [[] for _ in range(STREAMS)]
        calls = [asyncio.ensure_future(stream(stub, r, s)) for r, s in zip(requests(regex), seen)]
        if kill_when is not None:
            while min(len(s) for s in seen) < kill_when:
                await asyncio.wait(calls, timeout=0.005, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.to_thread(kill)  # the streams go on meanwhile
            at_kill = [len(s) for s in seen]
        return await asyncio.gather(*calls), at_kill
