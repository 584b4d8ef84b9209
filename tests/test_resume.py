"""Exact mid-stream failover: when the worker running a stream dies, the router hands another worker the
prompt and the tokens generated so far, and the client's stream goes on token for token as if nothing had
happened: greedy and seeded sampling, penalties, min_tokens and stop strings included."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.metrics import scrape, total, value
from tests.services import (
    CALL_TIMEOUT_S,
    held_streams,
    wait_idle,
)

MAX_TOKENS = 300
STREAMS = 8


# Structured output: 200 characters, so no stream can end before the kill (a token is at most a few dozen).
REGEX = "[a-z ]{200}"
# The same length of reasoning then answer (Qwen3's markers): the kill falls inside the reasoning, and the
# router's split must go on where it was.
REASONING_REGEX = "<think>\n[a-z ]{150}\n</think>\n\n[a-z ]{50}"


def _requests(regex: str | None = None) -> list[generate_pb2.GenerateRequest]:
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


async def _stream(
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


async def _run(
    address: str, kill_when: int | None = None, kill=None, regex: str | None = None
) -> tuple[list, list[int]]:
    """Every request at once; with `kill_when`, `kill()` runs once every stream has that many tokens. Returns
    the results and each stream's token count at the kill."""
    at_kill: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        seen: list[list[int]] = [[] for _ in range(STREAMS)]
        calls = [asyncio.ensure_future(_stream(stub, r, s)) for r, s in zip(_requests(regex), seen)]
        if kill_when is not None:
            while min(len(s) for s in seen) < kill_when:
                await asyncio.wait(calls, timeout=0.005, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.to_thread(kill)  # the streams go on meanwhile
            at_kill = [len(s) for s in seen]
        return await asyncio.gather(*calls), at_kill


NGRAM = ("--speculative-method", "ngram", "--speculative-max-batch", str(STREAMS))
# bf16 resumes exactly only with batch-invariant kernels: the resumed streams run on B in other batches.
BF16 = ("--dtype", "bfloat16", "--deterministic")
# A CPU worker as it starts by default: its dtype (bf16 on a CPU with native bf16) and deterministic kernels.
CPU_DEFAULT = ("--dtype", "auto")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "regex"),
    [((), None), (NGRAM, None), ((), REGEX), ((), REASONING_REGEX), (BF16, None), (CPU_DEFAULT, None)],
    ids=["plain", "ngram", "regex", "reasoning", "bf16-deterministic", "cpu-default"],
)
def test_streams_resume_token_identical_when_their_worker_is_killed(
    qwen3_dir: Path, kernels, tmp_path: Path, flags: tuple[str, ...], regex: str | None
) -> None:
    """Eight streams run on worker A; A is SIGKILLed mid-stream. Every stream completes on B and equals,
    token for token and in text, the same request run unbroken on B. With speculation on both workers too
    (a resumed request's proposals and picks are those of the unbroken one), under a regex (B replays
    the tokens through a fresh matcher; the text still matches), cut inside a Qwen3 reasoning block
    (the router's reasoning split goes on where it was), in bfloat16 with --deterministic, and with the
    workers' defaults (their dtype; deterministic on a CPU)."""
    with held_streams(qwen3_dir, tmp_path, worker_flags=flags) as (_, b, router, kill_a):
        results, at_kill = asyncio.run(_run(router.address, kill_when=4, kill=kill_a, regex=regex))
        assert all(4 <= n < MAX_TOKENS for n in at_kill), at_kill  # every stream was cut mid-generation
        assert total(scrape(router.metrics_address), "nanovllm:request_resumes_total") == STREAMS
        unbroken, _ = asyncio.run(_run(router.address, regex=regex))
        for i, (got, want) in enumerate(zip(results, unbroken)):
            assert got == want, f"stream {i} differs from its unbroken run"  # ids, text, reasoning, finish
            ids, text, reasoning, finish = got
            assert len(ids) > at_kill[i] and finish != generate_pb2.FINISH_REASON_ERROR
            if regex == REGEX:
                assert (
                    re.fullmatch(REGEX, text) and not reasoning and finish == generate_pb2.FINISH_REASON_STOP
                )
            if regex == REASONING_REGEX:  # the markers and their newlines taken out, on both sides
                assert re.fullmatch("[a-z ]{150}", reasoning) and re.fullmatch("[a-z ]{50}", text), got[1:]
                assert finish == generate_pb2.FINISH_REASON_STOP
        wait_idle(b.address)
        if flags is NGRAM:
            accepted = value(scrape(b.metrics_address), "nanovllm:spec_decode_num_accepted_tokens_total")
            assert accepted > 0


def test_without_resume_a_stream_cut_mid_generation_fails(qwen3_dir: Path, kernels, tmp_path: Path) -> None:
    """--no-resume-streams: the streams of a killed worker end UNAVAILABLE, naming the worker."""
    with held_streams(qwen3_dir, tmp_path, "--no-resume-streams") as (a, b, router, kill_a):
        try:
            asyncio.run(_run(router.address, kill_when=4, kill=kill_a))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert a.address in exc.details()
        else:
            raise AssertionError("a stream cut mid-generation completed although resuming was off")
        wait_idle(b.address)
