"""End to end through real router and worker processes on loopback, with a random Qwen3 model.

The reference for every generated token is the offline engine (`LLM.generate`) on the same weights, which
tests/test_fidelity.py holds equal to transformers.
"""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from nanovllm import LLM, SamplingParams
from nanovllm.common.v1 import worker_pb2
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.model_factory import build_model, build_tokenizer
from tests.services import (
    CALL_TIMEOUT_S,
    START_TIMEOUT_S,
    collect,
    start,
    start_router,
    start_worker,
    wait_for_workers,
    wait_idle,
    wait_serving,
    worker_load,
)

LONG = generate_pb2.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(qwen3_dir: Path) -> LLM:
    return LLM(str(qwen3_dir), kv_cache_memory="32MiB", max_model_len=512, dtype="float32")  # as start_worker


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def text_of(responses) -> str:
    return "".join(r.text for r in responses)


def ids_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def greedy_request(text: str, max_tokens: int, **sampling) -> generate_pb2.GenerateRequest:
    params = generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, **sampling)
    return generate_pb2.GenerateRequest(text=text, sampling=params, return_token_ids=True)


def test_stream_equals_offline_greedy(service, offline) -> None:
    """Text streams in several deltas that concatenate to the offline engine's text, token for token."""
    # 128 tokens: the router merges updates that wait behind a write, so one response would take a
    # router stalled for the whole generation.
    responses, error = collect(service.router.address, greedy_request("The quick brown fox", 128))
    assert error is None
    expected = offline.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=128))[0]
    assert len(responses) > 1
    assert ids_of(responses) == expected["token_ids"]
    assert text_of(responses) == expected["text"]
    last = responses[-1]
    assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert all(r.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert last.usage.completion_tokens == 128
    assert last.usage.prompt_tokens == len(offline.tokenizer.encode("The quick brown fox"))


def _mixed_requests() -> list[tuple[generate_pb2.GenerateRequest, SamplingParams]]:
    """64 requests: greedy, seeded sampling, penalties, logprobs, stop token ids, min_tokens, priorities."""
    words = [
        "paged",
        "attention",
        "stores",
        "keys",
        "and",
        "values",
        "in",
        "fixed",
        "size",
        "blocks",
        "while",
        "others",
        "decode",
    ]
    requests = []
    for i in range(64):
        prompt = " ".join(words[(i * 3) % len(words) :] + words[: i % 5]) or "hello"
        kind = i % 4
        kwargs: dict = {"temperature": 0.0, "max_tokens": 8 + (i * 7) % 40}
        if kind == 1:
            kwargs.update(temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i)
        elif kind == 2:
            kwargs.update(repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3)
        elif kind == 3:
            kwargs.update(stop_token_ids=[7, 9], min_tokens=4)
        proto_kwargs = dict(kwargs)
        request = generate_pb2.GenerateRequest(
            request_id=f"req-{i}",
            text=prompt,
            sampling=generate_pb2.SamplingParams(**proto_kwargs),
            priority=i % 3,
            return_token_ids=True,
        )
        requests.append((request, SamplingParams(**kwargs)))
    return requests


def test_64_concurrent_streams_each_get_their_own_tokens(service, offline) -> None:
    """64 concurrent streams with mixed parameters: each equals the offline engine's output for its own
    prompt (seeded sampling is batch-invariant, so it compares too), and carries its own request id."""
    requests = _mixed_requests()

    async def run_all():
        async with grpc.aio.insecure_channel(service.router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)

            async def one(request):
                return [r async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)]

            return await asyncio.gather(*(one(request) for request, _ in requests))

    results = asyncio.run(run_all())
    expected = offline.generate([r.text for r, _ in requests], [p for _, p in requests], use_tqdm=False)
    for (request, params), responses, reference in zip(requests, results, expected):
        assert {r.request_id for r in responses} == {request.request_id}
        assert ids_of(responses) == reference["token_ids"], request.request_id
        assert text_of(responses) == reference["text"], request.request_id
        assert responses[-1].usage.completion_tokens == len(reference["token_ids"])
        if params.logprobs is not None:
            logprobs = [lp for r in responses for lp in r.logprobs]
            assert [lp.token_id for lp in logprobs] == reference["token_ids"]
            for got, want in zip(logprobs, reference["logprobs"]):
                assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
                assert [t.token_id for t in got.top] == [t for t, _ in want.top]
    wait_idle(service.worker.address)


def test_stop_string_ends_request_and_never_leaks(service, offline) -> None:
    """A stop string cuts the text before it, finishes with STOP, aborts the request on the worker, and
    no delta ever holds the stop string or a prefix of it that later completed."""
    reference = offline.generate(["Prefix caching"], SamplingParams(temperature=0, max_tokens=60))[0]["text"]
    stop = reference[20:24]
    expected = reference[: reference.find(stop)]
    request = greedy_request("Prefix caching", 300, stop=[stop, "never-appears"], ignore_eos=True)
    responses, error = collect(service.router.address, request)
    assert error is None
    assert text_of(responses) == expected
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    streamed = ""
    for response in responses:
        streamed += response.text
        assert stop not in streamed
    assert len(ids_of(responses)) < 300
    wait_idle(service.worker.address)


def test_a_client_that_falls_behind_gets_the_same_stream_in_fewer_responses(service, offline) -> None:
    """A client that stops reading while the worker generates (its small receive window holds the router's
    writes back) gets, once it reads again, the tokens that waited merged into few responses: the same
    token ids, text and logprobs as the offline engine, one logprobs entry per token."""
    prompt, max_tokens = "Continuous batching", 400
    expected = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    request = greedy_request(prompt, max_tokens, ignore_eos=True, logprobs=5)
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(service.router.address, options=small_window) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT_S)
        responses = [next(call)]
        wait_idle(service.worker.address)  # every token generated; most wait on the router
        responses += list(call)
    assert ids_of(responses) == expected[0]["token_ids"]
    assert text_of(responses) == expected[0]["text"]
    assert [entry.token_id for r in responses for entry in r.logprobs] == expected[0]["token_ids"]
    assert all(len(entry.top) == 5 for r in responses for entry in r.logprobs)
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == max_tokens
    assert len(responses) < max_tokens // 4


def test_utf8_prompt_and_chat(service, offline, tokenizer) -> None:
    """Multi-byte prompts tokenize as the model's tokenizer does; chats render with its template; text
    deltas never carry U+FFFD for a character split across tokens (they equal the full decode)."""
    text = "Ünïcödé: 東京 🙂🚀 Ελληνικά"
    with grpc.insecure_channel(service.router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        assert list(stub.Tokenize(generate_pb2.TokenizeRequest(text=text)).token_ids) == tokenizer.encode(
            text
        )
        chat = generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content=text)])
        chat_ids = list(stub.Tokenize(generate_pb2.TokenizeRequest(chat=chat)).token_ids)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    assert chat_ids == tokenizer.encode(rendered, add_special_tokens=False)
    request = generate_pb2.GenerateRequest(
        chat=chat, sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=40), return_token_ids=True
    )
    responses, error = collect(service.router.address, request)
    assert error is None
    reference = offline.generate([chat_ids], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert ids_of(responses) == reference["token_ids"]
    # The stream equals the full decode: had a delta carried U+FFFD for part of a character that the next
    # token completes, the concatenation would differ. The output does hold such partial-byte tokens (the
    # random model also strings some into invalid UTF-8, which both render as U+FFFD; tests/
    # test_text_stream.py checks valid split characters one by one).
    assert text_of(responses) == tokenizer.decode(reference["token_ids"], skip_special_tokens=True)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids_of(responses))


@pytest.mark.parametrize(
    ("request_kwargs", "code", "fragments"),
    [
        ({"text": "hi", "sampling": {"top_p": 1.5}}, "INVALID_ARGUMENT", ["top_p", "1.5"]),
        ({"text": "hi", "sampling": {"temperature": -1}}, "INVALID_ARGUMENT", ["temperature", "-1"]),
        ({"text": "hi", "sampling": {"max_tokens": 0}}, "INVALID_ARGUMENT", ["max_tokens", "0"]),
        ({"text": "hi", "sampling": {"logprobs": 21}}, "INVALID_ARGUMENT", ["logprobs", "21"]),
        ({"text": "hi", "sampling": {"stop": ["ok", ""]}}, "INVALID_ARGUMENT", ["stop[1]"]),
        ({"token_ids": {"ids": [5] * 600}}, "INVALID_ARGUMENT", ["600", "512"]),
        ({"token_ids": {"ids": [3, 70000]}}, "INVALID_ARGUMENT", ["70000", "512"]),
        ({"token_ids": {"ids": []}}, "INVALID_ARGUMENT", ["no tokens"]),
        (
            {"text": "hi", "sampling": {"stop_token_ids": [2, 70000]}},
            "INVALID_ARGUMENT",
            ["stop_token_ids", "70000"],
        ),
        ({}, "INVALID_ARGUMENT", ["prompt"]),
        ({"text": "hi", "request_id": "r" * 257}, "INVALID_ARGUMENT", ["request_id", "257", "256"]),
        ({"text": "x" * 8193}, "INVALID_ARGUMENT", ["8193 bytes", "8192", "max_model_len 512"]),
        ({"text": "hi", "sampling": {"stop": ["s" * 1025]}}, "INVALID_ARGUMENT", ["stop[0]", "1025", "1024"]),
        ({"text": "hi", "sampling": {"stop": ["s"] * 17}}, "INVALID_ARGUMENT", ["stop", "17", "16"]),
        (
            {"text": "hi", "sampling": {"stop_token_ids": [2] * 257}},
            "INVALID_ARGUMENT",
            ["stop_token_ids", "257", "256"],
        ),
    ],
)
def test_invalid_requests_name_the_field(service, request_kwargs, code, fragments) -> None:
    """Bad input gets INVALID_ARGUMENT with a message naming the field and the numbers."""
    request = generate_pb2.GenerateRequest(**{k: v for k, v in request_kwargs.items() if k != "sampling"})
    if "sampling" in request_kwargs:
        request.sampling.CopyFrom(generate_pb2.SamplingParams(**request_kwargs["sampling"]))
    responses, error = collect(service.router.address, request)
    assert responses == []
    assert error is not None and error.code().name == code
    for fragment in fragments:
        assert fragment in error.details(), error.details()


INVALID_UTF8 = b"\x0a\x03\xff\xfe\xfd"  # field 1 (a string, or a message), 3 bytes that are not UTF-8
TRUNCATED = generate_pb2.GenerateRequest(text="The quick brown fox").SerializeToString()[:-3]


@pytest.mark.parametrize("payload", [INVALID_UTF8, TRUNCATED], ids=["invalid-utf8", "truncated"])
def test_unparsable_request_is_invalid_argument(service, payload: bytes) -> None:
    """Bytes that do not parse as a GenerateRequest get INVALID_ARGUMENT saying so (grpc's own answer
    would be UNKNOWN)."""
    with grpc.insecure_channel(service.router.address) as channel:
        generate = channel.unary_stream(
            "/nanovllm.v1.Generation/Generate", response_deserializer=generate_pb2.GenerateResponse.FromString
        )
        with pytest.raises(grpc.RpcError) as error:
            list(generate(payload, timeout=CALL_TIMEOUT_S))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request could not be parsed" in error.value.details()


def test_unparsable_router_message_ends_only_its_connection(service) -> None:
    """A router's Connect stream carrying bytes that do not parse as a RouterMessage ends with
    INVALID_ARGUMENT, and the worker goes on serving its other routers."""
    with grpc.insecure_channel(service.worker.address) as channel:
        connect = channel.stream_stream(
            "/nanovllm.worker.v1.Worker/Connect", response_deserializer=worker_pb2.StepOutputs.FromString
        )
        with pytest.raises(grpc.RpcError) as error:
            list(connect(iter([INVALID_UTF8]), timeout=CALL_TIMEOUT_S))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request could not be parsed" in error.value.details()
    responses, error = collect(service.router.address, greedy_request("still serving", 4))
    assert error is None and responses[-1].usage.completion_tokens == 4
    assert service.worker.proc.poll() is None


def test_cancel_and_deadline_free_blocks(service) -> None:
    """A client that cancels, or whose deadline passes, gets its request aborted on the worker: nothing
    keeps running and every KV block comes back."""
    with grpc.insecure_channel(service.router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(
            generate_pb2.GenerateRequest(text="cancel me", sampling=LONG), timeout=CALL_TIMEOUT_S
        )
        assert next(call).text is not None  # generation started
        assert worker_load(service.worker.address).kv_blocks_used > 0
        call.cancel()
        with pytest.raises(grpc.RpcError) as cancelled:
            list(call)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(service.worker.address)

    # The deadline passes while the worker is frozen (SIGSTOP) mid-generation, so it passes first on any
    # machine; the call's end is the event waited on.
    with grpc.insecure_channel(service.router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(generate_pb2.GenerateRequest(text="too slow", sampling=LONG), timeout=5.0)
        first = next(call)  # generation started
        service.worker.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as expired:
                list(call)
        finally:
            service.worker.proc.send_signal(signal.SIGCONT)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert first.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    wait_idle(service.worker.address)


def test_model_info_health_and_reflection(service) -> None:
    with grpc.insecure_channel(service.router.address) as channel:
        info = generate_pb2_grpc.GenerationStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert (info.max_model_len, list(info.architectures), info.num_workers) == (
            512,
            ["Qwen3ForCausalLM"],
            1,
        )
        assert info.vocab_size == 512 and list(info.eos_token_ids) == [1]
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"nanovllm.v1.Generation", "grpc.health.v1.Health"} <= services
        pool_file = ProtoReflectionDescriptorDatabase(channel).FindFileContainingSymbol(
            "nanovllm.v1.Generation"
        )
        assert pool_file.name == "nanovllm/v1/generate.proto"
    with grpc.insecure_channel(service.worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert "nanovllm.worker.v1.Worker" in set(ProtoReflectionDescriptorDatabase(channel).get_services())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    return tmp_path


def test_no_reachable_worker_is_unavailable(logs) -> None:
    router = start_router([f"127.0.0.1:{_free_port()}"], log_path=logs / "router.log")
    try:
        _, error = collect(router.address, greedy_request("hi", 4))
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker" in error.details()
        with grpc.insecure_channel(router.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            health = stub.Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Liveness stays SERVING: a router without workers is not ready, but not broken either.
            alive = stub.Check(health_pb2.HealthCheckRequest(service="nanovllm.liveness"))
            assert alive.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert router.stop() == 0


@pytest.fixture
def own_worker(qwen3_dir: Path, logs: Path, kernels) -> Iterator:
    workers = []

    def start(*extra: str, port: int = 0):
        worker = start_worker(qwen3_dir, *extra, port=port, log_path=logs / f"worker{len(workers)}.log")
        workers.append(worker)
        wait_serving(worker.address)
        return worker

    yield start
    for worker in workers:
        if worker.proc.poll() is None:
            worker.stop()


@pytest.mark.slow
def test_queue_full_is_resource_exhausted(own_worker, logs) -> None:
    """Beyond max_queued_requests waiting requests, submits fail with RESOURCE_EXHAUSTED; every request
    ends with exactly one outcome."""
    worker = own_worker("--max-num-seqs", "1", "--max-queued-requests", "1")
    router = start_router([worker.address], log_path=logs / "router.log")
    try:
        wait_serving(router.address)

        async def run_all():
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)

                async def one(i: int):
                    request = generate_pb2.GenerateRequest(text=f"queue {i}", sampling=LONG)
                    try:
                        responses = [r async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)]
                    except grpc.aio.AioRpcError as exc:
                        return exc.code(), exc.details()
                    return responses[-1].finish_reason, None

                return await asyncio.gather(*(one(i) for i in range(6)))

        outcomes = asyncio.run(run_all())
        codes = [code for code, _ in outcomes]
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, generate_pb2.FINISH_REASON_LENGTH}
        assert codes.count(generate_pb2.FINISH_REASON_LENGTH) >= 2  # one running, one waiting
        details = next(d for c, d in outcomes if c == grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "max_queued_requests is 1" in details
        wait_idle(worker.address)
    finally:
        router.stop()


@pytest.mark.slow
def test_worker_killed_mid_stream_then_restarted(own_worker, logs) -> None:
    """Streams on a worker that dies end with UNAVAILABLE once no other worker took them within
    --resume-wait (here 1 s); the router keeps serving (health follows the worker) and reconnects when a
    worker is back on that address."""
    worker = own_worker()
    port = int(worker.address.rsplit(":", 1)[1])
    router = start_router([worker.address], "--resume-wait", "1", log_path=logs / "router.log")
    try:
        wait_serving(router.address)
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            calls = [
                stub.Generate(
                    generate_pb2.GenerateRequest(text=f"doomed {i}", sampling=LONG), timeout=CALL_TIMEOUT_S
                )
                for i in range(3)
            ]
            for call in calls:
                next(call)  # every stream is producing
            worker.kill()
            for call in calls:
                with pytest.raises(grpc.RpcError) as lost:
                    list(call)
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "went away" in lost.value.details()
            responses, error = collect(router.address, greedy_request("while down", 4))
            assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE

        own_worker(port=port)
        wait_serving(router.address)
        responses, error = collect(router.address, greedy_request("back again", 4))
        assert error is None and responses[-1].usage.completion_tokens == 4
    finally:
        assert router.stop() == 0


def test_router_disconnect_aborts_its_requests_and_worker_keeps_serving(service, logs) -> None:
    """A router that dies takes its requests with it on the worker (blocks freed), and the worker goes on
    serving its other routers."""
    doomed = start_router([service.worker.address], log_path=logs / "router.log")
    wait_serving(doomed.address)
    with grpc.insecure_channel(doomed.address) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(
            generate_pb2.GenerateRequest(text="orphan", sampling=LONG), timeout=CALL_TIMEOUT_S
        )
        next(call)
        assert worker_load(service.worker.address).num_connections == 2
        doomed.kill()
        load = wait_idle(service.worker.address)
    assert load.num_connections == 1
    responses, error = collect(service.router.address, greedy_request("still here", 4))
    assert error is None and responses[-1].usage.completion_tokens == 4


def test_router_connects_to_a_serving_worker_at_its_first_try(service, logs) -> None:
    """A router started in front of a worker that already serves loads its tokenizer while still importing
    transformers on another thread: that must wait for the import, not fail (an ImportError from two
    threads importing transformers at once used to log worker_connection_failed at every start)."""
    router = start_router([service.worker.address], log_path=logs / "router.log")
    try:
        wait_serving(router.address)
    finally:
        assert router.stop() == 0
    records = log_records(logs / "router.log")
    assert [r for r in records if r["level"] != "info"] == []
    assert [r["event"] for r in records].count("worker_connected") == 1


def log_records(path: Path) -> list[dict]:
    """The records of a server's JSON log, up to its last complete line."""
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def test_model_without_tokenizer_serves_token_ids(qwen3_dir: Path, offline, kernels, logs) -> None:
    """A model directory without tokenizer files (a converted or custom model): the router serves token-id
    prompts, with token ids and no text in the responses, and refuses what needs a tokenizer (text, chat,
    stop strings, Tokenize) with FAILED_PRECONDITION naming it; its log says so once, as a warning."""
    model = build_model("qwen3", logs / "no-tokenizer", seed=1, tokenizer=False)  # qwen3_dir's weights
    assert {p.name for p in model.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    worker = start_worker(model, log_path=logs / "worker.log")
    router = start_router([worker.address], log_path=logs / "router.log")
    try:
        wait_serving(router.address)
        prompt = [5, 17, 42, 99]
        sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling)
        responses, error = collect(router.address, request)
        assert error is None
        expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[
            0
        ]
        assert ids_of(responses) == expected["token_ids"]
        assert text_of(responses) == ""
        assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        chat = generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="hi")])
        refused = [
            generate_pb2.GenerateRequest(text="hi"),
            generate_pb2.GenerateRequest(chat=chat),
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), sampling=generate_pb2.SamplingParams(stop=["x"])
            ),
        ]
        for request in refused:
            responses, error = collect(router.address, request)
            assert responses == [] and error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"model {model.name} has no tokenizer: " in error.details()
        with grpc.insecure_channel(router.address) as channel, pytest.raises(grpc.RpcError) as tokenize:
            generate_pb2_grpc.GenerationStub(channel).Tokenize(generate_pb2.TokenizeRequest(text="hi"))
        assert tokenize.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert tokenize.value.details() == f"model {model.name} has no tokenizer: send prompt token ids"
    finally:
        router.stop()
        worker.stop()
    problems = [r for r in log_records(logs / "router.log") if r["level"] != "info"]
    assert [(r["level"], r["event"], r["model"]) for r in problems] == [
        ("warning", "model_has_no_tokenizer", model.name)  # the served name
    ]


def test_unusable_tokenizer_is_logged_with_its_reason(qwen3_dir: Path, kernels, logs) -> None:
    """Tokenizer files the router cannot load: worker_connection_failed says why, as a reason (the
    exception's type and message) and as the exception itself."""
    model = shutil.copytree(qwen3_dir, logs / "bad-tokenizer")
    (model / "tokenizer.json").write_text("{not json")
    worker = start_worker(model, log_path=logs / "worker.log")
    router = start_router([worker.address], log_path=logs / "router.log")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (failed := [r for r in log_records(logs / "router.log") if r["level"] == "error"]):
            assert time.monotonic() < deadline, "the router logged no error"
            time.sleep(0.05)
    finally:
        router.stop()
        worker.stop()
    record = failed[0]
    assert record["event"] == "worker_connection_failed" and record["worker"] == worker.address
    (exception,) = record["exception"]
    assert record["reason"] == f"{exception['exc_type']}: {exception['exc_value']}"
    assert exception["exc_type"] == "ValueError", exception
    assert exception["exc_value"].startswith(f"the tokenizer.json of model {model.name} cannot be read: ")


@pytest.mark.slow
def test_least_loaded_worker_is_picked(own_worker, logs) -> None:
    """With two workers, concurrent requests spread over both. Counted from the router's one
    request_finished line per request, which names its worker: the workers' own load is a snapshot that a
    fast engine may already have finished a request by."""
    workers = [own_worker(), own_worker()]
    router = start_router([w.address for w in workers], log_path=logs / "router.log")
    try:
        wait_serving(router.address)
        wait_for_workers(router.address, 2)  # health turns SERVING with the first worker
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            calls = [
                stub.Generate(
                    generate_pb2.GenerateRequest(text=f"spread {i}", sampling=LONG), timeout=CALL_TIMEOUT_S
                )
                for i in range(4)
            ]
            for call in calls:
                next(call)
            for call in calls:
                call.cancel()
        for worker in workers:
            wait_idle(worker.address)
    finally:
        router.stop()
    lines = (logs / "router.log").read_text().splitlines()
    served_by = collections.Counter(
        json.loads(line)["worker"] for line in lines if "request_finished" in line
    )
    assert served_by == {w.address: 2 for w in workers}


def test_cli_client_streams_an_answer(service, offline) -> None:
    """`nanovllm client --completion` prints the streamed completion to stdout and the finish reason to
    stderr. (The chat default is checked with the embedded model in tests/test_gguf.py.)"""
    proc = subprocess.run(
        [sys.executable, "-m", "nanovllm.cli", "client", "--completion", "The quick brown fox"]
        + ["--router", service.router.address, "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
        check=True,
    )
    expected = offline.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert proc.stdout == expected["text"] + "\n"
    assert "[length:" in proc.stderr and "12 completion tokens" in proc.stderr


def test_cli_serve_runs_both_and_stops_both(qwen3_dir: Path, kernels) -> None:
    """`nanovllm serve` starts a worker and a router as separate processes, says where it listens, serves
    the model under --served-model-name, and on SIGTERM stops both and exits 0."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.cli", "serve", "--model", str(qwen3_dir), "--port", "0"]
        + [
            "--metrics-port",
            "0",
            "--kv-cache-memory",
            "32MiB",
            "--max-model-len",
            "512",
            "--log-format",
            "json",
        ]
        + ["--served-model-name", "team-qwen"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        banner = serve.stdout.readline()
        assert banner.startswith(f"nanovllm loading {qwen3_dir}: router at "), banner
        router_address = banner.split("router at ")[1].split(",")[0]
        children = psutil.Process(serve.pid).children()
        assert len(children) == 2
        # printed once the router answers: the request below needs no waiting
        assert serve.stdout.readline().strip() == f"nanovllm serving {qwen3_dir}"
        assert serve.stdout.readline().startswith("try: ")
        request = greedy_request("served", 3)
        request.model = "team-qwen"
        responses, error = collect(router_address, request)
        assert error is None and responses[-1].usage.completion_tokens == 3
        with grpc.insecure_channel(router_address) as channel:
            info = generate_pb2_grpc.GenerationStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert info.model == "team-qwen"
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
    finally:
        if serve.poll() is None:
            serve.kill()


def test_cli_serve_exits_with_its_workers_error(qwen3_dir: Path, kernels) -> None:
    """A worker that cannot start (its KV cache holds less than one sequence) ends `nanovllm serve` at once,
    router included: exit status 1, with the worker's own message and which process exited on stderr."""
    command = [sys.executable, "-m", "nanovllm.cli", "serve", "--model", str(qwen3_dir), "--port", "0"]
    command += ["--metrics-port", "0"]  # another test's serve may hold the default port
    command += ["--http-port", "0", "--kv-cache-memory", "64KiB", "--max-model-len", "512"]
    serve = subprocess.run(
        [*command, "--log-level", "error"],
        check=False,
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )
    assert serve.returncode == 1
    assert "nanovllm worker: KV cache holds" in serve.stderr, serve.stderr
    assert "nanovllm serve: the worker exited with 1; stopping" in serve.stderr, serve.stderr


def test_cli_serve_whose_router_cannot_listen_exits_naming_the_port(qwen3_dir: Path, kernels) -> None:
    """A process of `nanovllm serve` that cannot even listen (the router's metrics port taken) ends it at
    once: exit status 1, the message naming the port, no traceback, its worker stopped."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = subprocess.run(
            [sys.executable, "-m", "nanovllm.cli", "serve", "--model", str(qwen3_dir), "--port", "0",
             "--http-port", "0", "--metrics-port", str(port), "--kv-cache-memory", "32MiB", "--log-level", "error"],
            check=False, capture_output=True, text=True, timeout=CALL_TIMEOUT_S,
        )  # fmt: skip
    assert serve.returncode == 1
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in serve.stderr, serve.stderr
    assert "nanovllm serve: nanovllm router exited with 1 before listening" in serve.stderr, serve.stderr
    assert "Traceback" not in serve.stderr and "Exception ignored" not in serve.stderr, serve.stderr


def test_cli_serve_killed_leaves_no_process(qwen3_dir: Path, kernels) -> None:
    """`nanovllm serve` SIGKILLed (it cannot stop its worker and router itself): they stop, told by the
    kernel that their parent died (nanovllm/server_process.py)."""
    command = [sys.executable, "-m", "nanovllm.cli", "serve", "--model", str(qwen3_dir), "--port", "0"]
    command += ["--metrics-port", "0"]  # another test's serve may hold the default port
    serve = subprocess.Popen(
        [*command, "--http-port", "0", "--kv-cache-memory", "32MiB", "--log-level", "error"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stdout.readline().startswith("nanovllm loading")  # both listen
        children = psutil.Process(serve.pid).children()
        assert len(children) == 2
    finally:
        serve.kill()
        serve.wait()
    _, alive = psutil.wait_procs(children, timeout=CALL_TIMEOUT_S)
    assert alive == []


def test_port_in_use_is_a_clear_error(service, logs) -> None:
    """A second server on a port in use exits with a message instead of sharing the port."""
    port = service.router.address.rsplit(":", 1)[1]
    args = ["router", "--worker", service.worker.address, "--host", "127.0.0.1", "--port", port]
    args += ["--metrics-port", "0"]
    with pytest.raises(RuntimeError, match="exited with 1 before listening"):
        start(args, logs / "router.log")
    assert "cannot listen on 127.0.0.1:" in (logs / "router.log").read_text()


def test_last_response_says_where_the_time_went(own_worker, logs) -> None:
    """Two requests on a worker that runs one at a time, the second sent once the first has its first
    token: only the last response of each carries timings; the second waited on the worker for the rest of
    the first's run (nearly all of its 400 tokens), and its queue time says so; queue and prefill (the
    worker's) fit inside the time to first token (the router's), and the decode rate is the tokens after
    the first over the decode time."""
    worker = own_worker("--max-num-seqs", "1")
    router = start_router([worker.address], log_path=logs / "router.log")
    try:
        wait_serving(router.address)

        async def run_both():
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)

                def call(text: str, max_tokens: int):
                    params = generate_pb2.SamplingParams(
                        temperature=0, max_tokens=max_tokens, ignore_eos=True
                    )
                    request = generate_pb2.GenerateRequest(text=text, sampling=params, return_token_ids=True)
                    return stub.Generate(request, timeout=CALL_TIMEOUT_S)

                first = call("first of two", 400)
                started = [await first.read()]  # running on the worker now
                second = asyncio.create_task(_responses(call("second of two", 48)))
                return [started + await _responses(first), await second]

        ran, waited = asyncio.run(run_both())
        for responses in (ran, waited):
            assert all(not r.HasField("timings") for r in responses[:-1])
            assert responses[-1].HasField("timings")
            t = responses[-1].timings
            assert t.queue_s >= 0 and t.prefill_s > 0 and t.decode_s > 0
            assert t.queue_s + t.prefill_s <= t.time_to_first_token_s
            # The rate counts the tokens after those that came with the first; the first response may
            # also carry updates that waited behind it (a worker's coalesced steps, the router's merge).
            total = len(ids_of(responses))
            lowest, highest = (total - len(responses[0].token_ids)) / t.decode_s, (total - 1) / t.decode_s
            assert lowest * (1 - 1e-9) <= t.decode_tokens_per_s <= highest * (1 + 1e-9)
        assert waited[-1].timings.queue_s > 0.5 * ran[-1].timings.decode_s
        wait_idle(worker.address)
    finally:
        router.stop()


async def _responses(call) -> list:
    """The rest of a streaming call's responses (read(), which a call that was read from must keep using)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


@pytest.mark.parametrize(
    ("model", "gguf", "name"),
    [
        ("/cache/gguf/SmolLM2-135M-Instruct.Q4_1-50e7131530aa1b1c", "/x/SmolLM2-135M-Instruct.Q4_1.gguf",
         "SmolLM2-135M-Instruct"),
        ("/d", "/x/Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B"),
        ("/d", "/x/model-bf16.gguf", "model"),
        ("/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd", None, "Qwen/Qwen3-0.6B"),
        ("/models/my-finetune", None, "my-finetune"),
    ],
)  # fmt: skip
def test_a_model_is_served_under_its_own_name(model: str, gguf: str | None, name: str) -> None:
    """Never a cache path: the GGUF file's name without its quantization tag, a Hugging Face cache entry's
    repository, a directory's name."""
    from nanovllm.worker.service.server import default_served_name

    assert default_served_name(model, gguf) == name


def test_step_outputs_that_wait_leave_as_one_message() -> None:
    """A worker whose router reads slower than the engine steps sends what waits back to back as one
    message, every update in order; load and cache messages keep their place and end a run."""
    from nanovllm.worker.service import server
    from nanovllm.worker.service.server import coalesced

    def step(*tokens: tuple[str, int]) -> worker_pb2.StepOutputs:
        return worker_pb2.StepOutputs(
            updates=[worker_pb2.RequestUpdate(request_id=rid, new_token_ids=[t]) for rid, t in tokens]
        )

    load = worker_pb2.StepOutputs(load=worker_pb2.WorkerLoad(num_running=2))
    waiting = [step(("a", 1), ("b", 2)), step(("a", 3)), load, step(("b", 4)), step(("a", 5)), None]

    async def drain() -> list[worker_pb2.StepOutputs]:
        outbox: asyncio.Queue = asyncio.Queue()
        for msg in waiting:
            outbox.put_nowait(msg)
        return [msg async for msg in coalesced(outbox)]

    sent = asyncio.run(drain())
    assert [[(u.request_id, *u.new_token_ids) for u in m.updates] for m in sent] == [
        [("a", 1), ("b", 2), ("a", 3)],
        [],
        [("b", 4), ("a", 5)],
    ]
    assert sent[1] == load
    # However long the router stalled, one message stays far below what it takes in one read.
    limit = server.MAX_COALESCED_UPDATES
    waiting = [step(*[("a", 0)] * (limit // 2 + 1)) for _ in range(3)] + [None]
    assert [len(m.updates) for m in asyncio.run(drain())] == [limit // 2 + 1] * 3
