"""A chat with images whose worker is SIGKILLed mid-stream: the router resends the request with its
resized images and the tokens so far to the other worker, and the stream completes with the tokens of the
same request run unbroken there, in float32 (tests/services.py held_streams: the streams start on worker
A, which is killed once each has some tokens; B was frozen until then). Two streams, one image each,
different images of the same size, so neither worker can serve one from the other's cached blocks."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.model_factory import build_vision_model
from tests.services import CALL_TIMEOUT_S, held_streams

MAX_TOKENS = 48
KILL_AT = 4


def _request(seed: int) -> generate_pb2.GenerateRequest:
    rng = np.random.default_rng(seed)
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (70, 100, 3), dtype=np.uint8)).save(png, "PNG")
    parts = [
        generate_pb2.ContentPart(text="Describe "),
        generate_pb2.ContentPart(image=generate_pb2.ImagePart(data=png.getvalue())),
        generate_pb2.ContentPart(text=" in detail."),
    ]
    chat = generate_pb2.Chat(
        messages=[generate_pb2.ChatMessage(role="user", parts=parts)], enable_thinking=False
    )
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return generate_pb2.GenerateRequest(chat=chat, sampling=sampling, return_token_ids=True)


async def _stream(stub: generate_pb2_grpc.GenerationStub, request, seen: list[int]) -> list[int]:
    async for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        seen.extend(response.token_ids)
    return seen


async def _run(address: str, kill=None) -> tuple[list[list[int]], list[int]]:
    """Both streams at once; with `kill`, it runs once each has KILL_AT tokens. The tokens, and each
    stream's count at the kill."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        seen: list[list[int]] = [[], []]
        calls = [asyncio.ensure_future(_stream(stub, _request(k), seen[k])) for k in range(2)]
        at_kill: list[int] = []
        if kill is not None:
            while min(len(s) for s in seen) < KILL_AT:
                await asyncio.wait(calls, timeout=0.005, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.to_thread(kill)
            at_kill = [len(s) for s in seen]
        return list(await asyncio.gather(*calls)), at_kill


def test_image_streams_resume_token_identical_when_their_worker_is_killed(kernels, tmp_path: Path) -> None:
    model = build_vision_model(tmp_path / "vl")
    with held_streams(model, tmp_path) as (_, _b, router, kill_a):
        results, at_kill = asyncio.run(_run(router.address, kill_a))
        assert all(KILL_AT <= n < MAX_TOKENS for n in at_kill), at_kill  # both cut mid-generation
        unbroken, _ = asyncio.run(_run(router.address))
    assert [len(r) for r in results] == [MAX_TOKENS, MAX_TOKENS]
    assert results == unbroken
