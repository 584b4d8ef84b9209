"""The router's OpenAI-compatible HTTP face (router/faces/http_api.py), driven by the official `openai` client:
the same answers as gRPC, streaming and not, usage, stop, seeds, logprobs, n, typed errors, and a client
that leaves mid-stream freeing its KV blocks."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from nanovllm.router.faces.openai_protocol import ProtocolError, parse_request
from nanovllm.v1 import generate_pb2
from tests.metrics import scrape, total
from tests.services import (
    collect,
    router_and_worker,
    start_router,
    wait_for_log,
    wait_idle,
)

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


class Http:
    def __init__(self, worker, router, router_log: Path, model: str) -> None:
        self.worker, self.router, self.router_log = worker, router, router_log
        self.model = model  # the served name: by default the model directory's
        self.client = openai.OpenAI(
            base_url=f"http://{router.http_address}/v1", api_key="none", max_retries=0
        )


@pytest.fixture(scope="module")
def http(qwen3_dir: Path, kernels, tmp_path_factory) -> Iterator[Http]:
    logs = tmp_path_factory.mktemp("http-logs")
    with router_and_worker(qwen3_dir, logs, router_flags=("--http-port", "0")) as (worker, router):
        yield Http(worker, router, logs / "router.log", qwen3_dir.name)


def raw(http: Http, path: str, body: bytes | None = None) -> tuple[int, dict]:
    """Status and JSON body of a plain HTTP request (a POST when `body` is given)."""
    request = urllib.request.Request(
        f"http://{http.router.http_address}{path}", data=body, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def grpc_text(http: Http, max_tokens: int, **sampling) -> str:
    chat = generate_pb2.Chat(messages=[generate_pb2.ChatMessage(**m) for m in MESSAGES])
    params = generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, **sampling)
    responses, error = collect(http.router.address, generate_pb2.GenerateRequest(chat=chat, sampling=params))
    assert error is None, error
    return "".join(r.text for r in responses)


def test_chat_equals_grpc_streaming_or_not(http: Http) -> None:
    expected = grpc_text(http, 24)
    whole = http.client.chat.completions.create(
        model=http.model, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert whole.choices[0].message.content == expected
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(
        http.client.chat.completions.create(
            model=http.model,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    wait_for_log(
        http.router_log, "request_finished", api="http", completion_tokens=whole.usage.completion_tokens
    )


def test_completion_with_stop_and_seed(http: Http) -> None:
    plain = http.client.completions.create(
        model=http.model, prompt="The quick brown fox", max_tokens=32, temperature=0
    )
    text = plain.choices[0].text
    assert plain.object == "text_completion" and text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = http.client.completions.create(
        model=http.model, prompt="The quick brown fox", max_tokens=32, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = http.client.completions.create(
        model=http.model, prompt="The quick brown fox", max_tokens=32, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text
    seeded = [
        http.client.completions.create(
            model=http.model, prompt="Prefix caching", max_tokens=24, temperature=1.0, seed=7
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_logprobs_and_n(http: Http) -> None:
    answer = http.client.chat.completions.create(
        model=http.model, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    several = http.client.chat.completions.create(
        model=http.model, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=3, n=3
    )
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert len({c.message.content for c in several.choices}) > 1  # seeds 3, 4, 5


def test_an_almost_greedy_temperature_is_accepted(http: Http) -> None:
    """0.001, as OpenAI clients send for "almost greedy": run at 0.01 (common/sampling_params.py), so it
    gives what 0.01 gives with the same seed."""
    answers = [
        http.client.chat.completions.create(
            model=http.model, messages=MESSAGES, max_tokens=12, temperature=t, seed=11
        )
        .choices[0]
        .message.content
        for t in (0.001, 0.01)
    ]
    assert answers[0] == answers[1]


def test_models_and_health(http: Http) -> None:
    models = http.client.models.list()
    assert [m.id for m in models.data] == [http.model] and models.data[0].object == "model"
    assert raw(http, "/health") == (200, {"status": "serving"})
    # An answer names the model it was asked for, or the one served when the body names none.
    body = {"prompt": "hi", "max_tokens": 1}
    assert raw(http, "/v1/completions", json.dumps(body).encode())[1]["model"] == http.model
    named = json.dumps({**body, "model": http.model}).encode()
    assert raw(http, "/v1/completions", named)[1]["model"] == http.model
    # Another name is a 404 naming the one served, on both faces.
    with pytest.raises(
        openai.NotFoundError, match=f"model 'qwen3-999b' is not served here; served: '{http.model}'"
    ):
        http.client.completions.create(model="qwen3-999b", prompt="hi", max_tokens=1)
    request = generate_pb2.GenerateRequest(text="hi", model="qwen3-999b")
    _, error = collect(http.router.address, request)
    assert error is not None and error.code() == grpc.StatusCode.NOT_FOUND and http.model in error.details()


def test_bad_requests_are_400_in_openais_shape(http: Http) -> None:
    with pytest.raises(openai.BadRequestError, match=r"top_p must be in \(0, 1\], got 1.5"):
        http.client.chat.completions.create(model=http.model, messages=MESSAGES, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        http.client.chat.completions.create(model=http.model, messages=MESSAGES, n=1000)
    status, body = raw(http, "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and body["error"]["param"] == "body"
    wrong_type = json.dumps({"messages": MESSAGES, "max_tokens": "ten"}).encode()
    status, body = raw(http, "/v1/chat/completions", wrong_type)
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_reads_them(http: Http) -> None:
    """lm-evaluation-harness (local-completions) scores a choice with echo, logprobs=1 and max_tokens 1 or
    0: the text is the prompt, then the completion; the logprobs cover the prompt's tokens first (the
    first has none), then the completion's, text_offset placing each in the text; they are the worker's
    prompt logprobs as gRPC returns them, and streaming says the same."""
    prompt = "The capital of France is Paris"
    asked = {"model": http.model, "prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
    answer = http.client.completions.create(**asked, max_tokens=1)
    choice, n = answer.choices[0], answer.usage.prompt_tokens
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == n + 1 == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:n]) == prompt and "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n + 1)]
    assert all(
        len(top) == 1 and max(top.values()) >= value
        for top, value in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])
    )
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    responses, error = collect(
        http.router.address, generate_pb2.GenerateRequest(text=prompt, sampling=sampling)
    )
    assert error is None, error
    assert [e.logprob for r in responses for e in r.prompt_logprobs] == lp.token_logprobs[1:n]
    assert len(responses[0].prompt_token_ids) == n

    scored = http.client.completions.create(**asked, max_tokens=0)  # the prompt scored, nothing generated
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert scored.choices[0].finish_reason == "length"

    chunks = list(http.client.completions.create(**asked, max_tokens=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_a_completion_without_max_tokens_stops_at_16_as_openais(http: Http) -> None:
    """OpenAI's legacy completions default max_tokens to 16 (a chat runs to the end of the context); with
    echo and max_tokens 0 the prompt is scored and nothing generated, as before."""
    asked = {"model": http.model, "prompt": "The capital of France is", "echo": True, "logprobs": 1}
    answer = http.client.completions.create(**asked, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"
    scored = http.client.completions.create(**asked, max_tokens=0)
    assert scored.usage.completion_tokens == 0 and scored.choices[0].text == asked["prompt"]


def test_a_client_that_leaves_mid_stream_frees_its_kv_blocks(http: Http) -> None:
    stream = http.client.chat.completions.create(
        model=http.model,
        messages=MESSAGES,
        max_tokens=480,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    before = cancelled(http, "http")
    next(iter(stream))  # 479 tokens still to come (ignore_eos: vLLM's extension, taken here too)
    stream.close()
    wait_idle(http.worker.address)
    assert cancelled(http, "http") == before + 1


def cancelled(http: Http, api: str) -> float:
    """Generate calls through `api` (grpc, http) that the router counted as cancelled by their client."""
    samples = scrape(http.router.metrics_address)
    return total(samples, "nanovllm:requests_total", status="client_cancelled", api=api)


def test_no_worker_is_503(kernels, tmp_path) -> None:
    router = start_router(["127.0.0.1:1"], "--http-port", "0", log_path=tmp_path / "router.log")
    try:
        client = openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="m", messages=MESSAGES)
        assert caught.value.status_code == 503
    finally:
        router.stop()


def test_protocol_errors_name_the_field() -> None:
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": MESSAGES, "stop": [1]}, "stop"),
        ({"messages": MESSAGES, "temperature": True}, "temperature"),
        ({"messages": MESSAGES, "tool_choice": "always"}, "tool_choice"),
        ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": MESSAGES, "top_k": 2**31}, "top_k"),  # past int32, the wire type
        ({"messages": MESSAGES, "seed": 2**63}, "seed"),
        ({"messages": MESSAGES, "temperature": 10**400}, "temperature"),  # past a double
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
        ({"messages": MESSAGES, "tool_choice": {"function": "f"}}, "tool_choice"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"x": 10**400}}, "chat_template_kwargs"),
        # nested fields of the wrong JSON type (the HTTP fuzz's finds)
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": -1}]}]},
            "messages[0].content[0].text",
        ),
        ({"messages": [{"role": "user", "content": [{"type": ["text"]}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "tool_calls": 7}]}, "messages[0].tool_calls"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": [], "function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0].id",
        ),
        ({"messages": [{"role": "tool", "tool_call_id": 3, "content": "x"}]}, "messages[0].tool_call_id"),
        # vLLM's structured_outputs: one constraint, of its type, not beside response_format
        ({"messages": MESSAGES, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"messages": MESSAGES, "structured_outputs": {"regexp": "a"}}, "structured_outputs"),
        ({"messages": MESSAGES, "structured_outputs": {"regex": 7}}, "structured_outputs.regex"),
        ({"messages": MESSAGES, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        (
            {
                "messages": MESSAGES,
                "structured_outputs": {"regex": "a"},
                "response_format": {"type": "json_object"},
            },
            "structured_outputs",
        ),
    ]:
        with pytest.raises(ProtocolError) as caught:
            parse_request(body, chat=True)
        assert caught.value.param == param, (json.dumps(body), caught.value)


def test_fields_whose_effect_is_not_served_are_refused_naming_them() -> None:
    """An OpenAI field asking for what the router does not serve is a 400 naming it, not an answer without
    it; the values that ask for nothing pass."""
    prompt = {"prompt": "Hi"}
    for body, param in [
        ({**prompt, "suffix": " end"}, "suffix"),
        ({**prompt, "best_of": 3}, "best_of"),
        ({**prompt, "n": 2, "best_of": 3}, "best_of"),
        ({"messages": MESSAGES, "logit_bias": {"5": 10}}, "logit_bias"),
        ({"messages": MESSAGES, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities"),
        ({"messages": MESSAGES, "prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"messages": MESSAGES, "web_search_options": {}}, "web_search_options"),
        ({"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": MESSAGES, "function_call": "auto"}, "function_call"),
        ({"messages": MESSAGES, "reasoning_effort": "low"}, "reasoning_effort"),
        ({"messages": MESSAGES, "verbosity": "low"}, "verbosity"),
        ({"messages": MESSAGES, "moderation": {}}, "moderation"),
        ({"messages": MESSAGES, "store": True}, "store"),
        ({"messages": MESSAGES, "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"messages": MESSAGES, "service_tier": "flex"}, "service_tier"),
    ]:
        with pytest.raises(ProtocolError, match="is not served here") as caught:
            parse_request(body, chat="messages" in body)
        assert caught.value.param == param, (json.dumps(body), caught.value)
    for body in [
        {**prompt, "echo": False},
        {**prompt, "suffix": None},
        {**prompt, "best_of": 1},
        {**prompt, "n": 2, "best_of": 2},
        {"messages": MESSAGES, "logit_bias": {}},
        {"messages": MESSAGES, "modalities": ["text"], "store": False, "parallel_tool_calls": True},
        {"messages": MESSAGES, "service_tier": "auto", "functions": [], "reasoning_effort": None},
    ]:
        parse_request(body, chat="messages" in body)


def test_vllms_prompt_logprobs_on_both_endpoints(http: Http) -> None:
    """vLLM's `prompt_logprobs` extension: per prompt token (the first null) the actual token and the most
    likely ones by id, each with its logprob, rank and text; the gRPC call's values, in a completion's
    choice, beside a chat's choices, and in a stream's first chunk."""
    prompt = "The capital of France is Paris"
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    responses, error = collect(
        http.router.address, generate_pb2.GenerateRequest(text=prompt, sampling=sampling)
    )
    assert error is None, error
    ids, scored = list(responses[0].prompt_token_ids), [e for r in responses for e in r.prompt_logprobs]
    extra = {"prompt_logprobs": 2}
    completion = http.client.completions.create(
        model=http.model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
    )
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for entry, token_id, grpc_entry in zip(entries[1:], ids[1:], scored):
        actual = entry[str(token_id)]
        assert actual["logprob"] == grpc_entry.logprob and actual["rank"] == grpc_entry.rank >= 1
        assert sorted(v["rank"] for v in entry.values())[:2] == [
            1,
            2,
        ]  # the top two, the actual among them or not
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    chat = http.client.chat.completions.create(
        model=http.model, messages=MESSAGES, max_tokens=1, temperature=0, extra_body=extra
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1
    chunks = list(http.client.completions.create(
        model=http.model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra, stream=True
    ))  # fmt: skip
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == entries


def test_a_field_no_endpoint_reads_is_refused_naming_it() -> None:
    """A name that is neither served, nor one of OpenAI's accepted without effect, nor one of its refused
    ones (a typo, another server's extension) is a 400 naming it, not an answer that ignored it."""
    for body, chat, param in [
        ({"prompt": "Hi", "max_token": 5}, False, "max_token"),
        ({"messages": MESSAGES, "temprature": 0}, True, "temprature"),
        ({"messages": MESSAGES, "echo": True}, True, "echo"),  # completions' field, not chat's
        ({"prompt": "Hi", "tools": []}, False, "tools"),
    ]:
        with pytest.raises(ProtocolError, match="is not a field of") as caught:
            parse_request(body, chat=chat)
        assert caught.value.param == param


def test_the_official_client_passes_every_field_that_changes_nothing(http: Http) -> None:
    """openai's identifiers, metadata and caching hints are accepted (they change nothing in an answer)."""
    answer = http.client.chat.completions.create(
        model=http.model, messages=MESSAGES, max_tokens=2, temperature=0, user="u1", metadata={"k": "v"},
        safety_identifier="s1", prompt_cache_key="conversation-1", store=False, service_tier="auto",
        parallel_tool_calls=True,
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "length"
    completion = http.client.completions.create(model=http.model, prompt="Hi", max_tokens=2, user="u1")
    assert completion.choices[0].finish_reason == "length"


def test_tokens_are_checked_as_on_grpc(kernels, tmp_path) -> None:
    """The router's tokens file guards the HTTP face too (completions and /v1/models): no token 401, an
    unknown one 403."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:alice-0123456789abcdef\n")
    router = start_router(
        ["127.0.0.1:1"],
        "--http-port",
        "0",
        "--auth-tokens-file",
        str(tokens),
        log_path=tmp_path / "router.log",
    )
    try:
        base = f"http://{router.http_address}/v1"
        for key, error in [
            ("", openai.AuthenticationError),
            ("mallory-0123456789abcdef", openai.PermissionDeniedError),
        ]:
            client = openai.OpenAI(base_url=base, api_key=key or "unused", max_retries=0)
            if not key:
                client = client.with_options(default_headers={"Authorization": ""})
            with pytest.raises(error):
                client.chat.completions.create(model="m", messages=MESSAGES)
            with pytest.raises(error):
                client.models.list()
        alice = openai.OpenAI(base_url=base, api_key="alice-0123456789abcdef", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:  # let in, and then: no worker
            alice.chat.completions.create(model="m", messages=MESSAGES)
        assert caught.value.status_code == 503
    finally:
        router.stop()


def test_each_choice_ends_with_its_timings(http: Http) -> None:
    """The last chunk of each choice, and each choice of a whole answer, carries `timings` (seconds):
    the time to the first token within the call's own wall time, decode time and rate that agree with the
    token count; earlier chunks carry none."""
    keys = {"queue_s", "time_to_first_token_s", "prefill_s", "decode_s", "decode_tokens_per_s"}
    started = time.perf_counter()
    whole = http.client.chat.completions.create(
        model=http.model, messages=MESSAGES, max_tokens=24, temperature=0, n=2
    )
    wall = time.perf_counter() - started
    for choice in whole.choices:
        timings = choice.model_extra["timings"]
        assert set(timings) == keys and all(v >= 0 for v in timings.values())
        assert 0 < timings["time_to_first_token_s"] + timings["decode_s"] <= wall
        assert timings["queue_s"] + timings["prefill_s"] <= timings["time_to_first_token_s"]
    chunks = list(
        http.client.chat.completions.create(
            model=http.model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True
        )
    )
    ends = [c.choices[0] for c in chunks if c.choices and "timings" in (c.choices[0].model_extra or {})]
    assert len(ends) == 1 and ends[0].finish_reason is not None and ends[0] is chunks[-1].choices[0]
    timings = ends[0].model_extra["timings"]
    assert set(timings) == keys and timings["time_to_first_token_s"] > 0
    assert (timings["decode_s"] > 0) == (timings["decode_tokens_per_s"] > 0)
