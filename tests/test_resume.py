"""Exact mid-stream failover: when the worker running a stream dies, the router hands another worker the
prompt and the tokens generated so far, and the client's stream goes on token for token as if nothing had
happened: greedy and seeded sampling, penalties, min_tokens and stop strings included."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from nanovllm.v1 import generate_pb2
from tests.metrics import scrape, total, value
from tests.resume_streams import MAX_TOKENS, STREAMS, run
from tests.services import held_streams, wait_idle

# Structured output: 200 characters, so no stream can end before the kill (a token is at most a few dozen).
REGEX = "[a-z ]{200}"
# The same length of reasoning then answer (Qwen3's markers): the kill falls inside the reasoning, and the
# router's split must go on where it was.
REASONING_REGEX = "<think>\n[a-z ]{150}\n</think>\n\n[a-z ]{50}"


NGRAM = ("--speculative-method", "ngram", "--speculative-max-batch", str(STREAMS))
# bf16 resumes exactly only with batch-invariant kernels: the resumed streams run on B in other batches.
BF16 = ("--dtype", "bfloat16", "--deterministic")
BF16_FP8 = (
    *BF16,
    "--kv-cache-dtype",
    "fp8",
)  # an FP8 KV cache: the resumed prompt is stored in the same bytes
# A CPU worker as it starts by default: its dtype (bf16 on a CPU with native bf16) and deterministic kernels.
CPU_DEFAULT = ("--dtype", "auto")
# 4-bit weights in the CPU's default dtype on the batch-invariant quantized kernel (with bf16, the default on
# a CPU with native bf16: the integer dots at every row count; with float32: the registers and the panels).
INT4 = ("--dtype", "auto", "--quantization", "int4", "--deterministic")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "regex"),
    [
        ((), None),
        (NGRAM, None),
        ((), REGEX),
        ((), REASONING_REGEX),
        (BF16, None),
        (BF16_FP8, None),
        (CPU_DEFAULT, None),
        (INT4, None),
    ],
    ids=[
        "plain",
        "ngram",
        "regex",
        "reasoning",
        "bf16-deterministic",
        "bf16-deterministic-fp8",
        "cpu-default",
        "int4-deterministic",
    ],
)
def test_streams_resume_token_identical_when_their_worker_is_killed(
    qwen3_dir: Path, kernels, tmp_path: Path, flags: tuple[str, ...], regex: str | None
) -> None:
    """Eight streams run on worker A; A is SIGKILLed mid-stream. Every stream completes on B and equals,
    token for token and in text, the same request run unbroken on B. With speculation on both workers too
    (a resumed request's proposals and picks are those of the unbroken one), under a regex (B replays
    the tokens through a fresh matcher; the text still matches), cut inside a Qwen3 reasoning block
    (the router's reasoning split goes on where it was), in bfloat16 with --deterministic, with the
    workers' defaults (their dtype; deterministic on a CPU), and with int4 weights under --deterministic."""
    with held_streams(qwen3_dir, tmp_path, worker_flags=flags) as (_, b, router, kill_a):
        results, at_kill = asyncio.run(run(router.address, kill_when=4, kill=kill_a, regex=regex))
        assert all(4 <= n < MAX_TOKENS for n in at_kill), at_kill  # every stream was cut mid-generation
        assert total(scrape(router.metrics_address), "nanovllm:request_resumes_total") == STREAMS
        unbroken, _ = asyncio.run(run(router.address, regex=regex))
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
            asyncio.run(run(router.address, kill_when=4, kill=kill_a))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert a.address in exc.details()
        else:
            raise AssertionError("a stream cut mid-generation completed although resuming was off")
        wait_idle(b.address)
