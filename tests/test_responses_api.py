"""OpenAI's Responses API on the router (router/faces/responses.py), stateless: driven by the official
`openai` client against a router and a worker (random Qwen3 with Qwen3's chat template): a plain response
equal to the chat completion it stands for, a stream whose semantic events come in the order the client's
own accumulator checks, input items and instructions, a function call and its output round trip, a JSON
schema; the events of reasoning, text and calls built without a model; bad bodies refused naming the field."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from nanovllm.router.faces.openai_protocol import ProtocolError
from nanovllm.router.faces.response_objects import TERMINAL_EVENTS
from nanovllm.router.faces.response_store import ResponseStore, StoreFull
from nanovllm.router.faces.responses import ResponseBuilder, parse_responses_request
from nanovllm.v1 import generate_pb2
from tests.chat_templates import QWEN3
from tests.metrics import scrape, total
from tests.model_factory import build_tokenizer
from tests.services import (
    ServerProcess,
    library_errors,
    router_and_worker,
    start_router,
    wait_idle,
    wait_serving,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


TOKENS = {"alice": "alice-0123456789abcdef", "bob": "bob-0123456789abcdef0"}


def _bound(client: openai.OpenAI, model: str) -> openai.OpenAI:
    """The client with its `model` argument bound to the served name (the model directory's)."""
    client.responses.create = functools.partial(client.responses.create, model=model)
    client.responses.stream = functools.partial(client.responses.stream, model=model)
    return client


@dataclass
class Served:
    worker: ServerProcess
    router: ServerProcess
    store: Path
    tokens: Path
    model: str

    def client(self, name: str = "alice", router: ServerProcess | None = None) -> openai.OpenAI:
        base = f"http://{(router or self.router).http_address}/v1"
        return _bound(openai.OpenAI(base_url=base, api_key=TOKENS[name], max_retries=0), self.model)


@pytest.fixture(scope="module")
def served(qwen3_dir: Path, kernels, tmp_path_factory) -> Iterator[Served]:
    """A worker (the model's whole context: Qwen3's template writes tools in ~550 tokens) behind a router
    with two tokens and a response store of its own."""
    root = tmp_path_factory.mktemp("responses")
    tokens, store = root / "tokens", root / "responses.sqlite"
    tokens.write_text("".join(f"{name}:{token}\n" for name, token in TOKENS.items()))
    router_flags = ("--http-port", "0", "--auth-tokens-file", str(tokens), "--response-store", str(store))
    worker_flags = ("--max-model-len", "1024")
    with router_and_worker(qwen3_dir, root, worker_flags, router_flags) as (worker, router):
        yield Served(worker, router, store, tokens, qwen3_dir.name)


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return served.client()


def test_a_response_is_the_chat_completion_it_stands_for(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="",  # the one model served
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "The quick brown fox"},
        ],
        max_completion_tokens=16,
        temperature=0,
    )
    response = client.responses.create(
        instructions="Be brief.", input="The quick brown fox", max_output_tokens=16, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == 16
    items = client.responses.create(
        input=[
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "The quick brown fox"}],
            },
        ],
        max_output_tokens=16,
        temperature=0,
    )
    assert items.output_text == response.output_text  # developer = system, text parts joined


def test_a_stream_sends_the_events_in_order_and_the_same_text(client: openai.OpenAI) -> None:
    whole = client.responses.create(input="The quick brown fox", max_output_tokens=24, temperature=0)
    events = list(
        client.responses.create(input="The quick brown fox", max_output_tokens=24, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    with client.responses.stream(input="The quick brown fox", max_output_tokens=24, temperature=0) as stream:
        last = list(stream)[-1]  # the client's accumulator checked each event against those before
    assert last.type == f"response.{whole.status}" and last.response.id != whole.id
    assert last.response.output_text == whole.output_text


def test_a_function_call_and_its_output_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=128,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output and calls[0].name == "get_weather" and first.status == "completed"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)  # the grammar made it valid
    second = client.responses.create(
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    alone = client.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.output[-1].type == "message"
    assert second.usage.input_tokens > alone.usage.input_tokens  # the call and its output are in the prompt


def test_a_json_schema_answer_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
    }
    response = client.responses.create(
        input="A name, please",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )
    assert isinstance(json.loads(response.output_text)["name"], str)


def test_bad_bodies_are_400_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ({"input": "hi", "store": "yes"}, "store"),
        ({"input": "hi", "background": "yes"}, "background"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"input": []}, "input"),
        (
            {"input": [{"role": [1, 2, 3], "content": [{"type": "input_text", "text": "Hi"}]}]},
            "input[0].role",
        ),
        ({"input": [{"role": [], "content": [{"type": "input_text", "text": "Hi"}]}]}, "input[0].role"),
    ]
    for body, field in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**body)
        assert caught.value.body["param"] == field, (body, caught.value.body)
        assert field.split("[")[0] in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(input="hi", previous_response_id="resp_unknown")
    assert (
        caught.value.body["param"] == "previous_response_id"
        and "resp_unknown" in caught.value.body["message"]
    )


# A body with one item of each kind, a tool, a text format and reasoning, every field set.
_EVERY_FIELD = {
    "input": [
        {"type": "message", "id": "msg_1", "role": "user", "content": "Hi"},
        {
            "type": "message",
            "id": "msg_2",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be brief"}],
        },
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1"},
    ],
    "instructions": "Answer",
    "tools": [WEATHER],
    "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}},
    "reasoning": {"effort": "high"},
    "metadata": {"k": "v"},
    "user": "u",
    "previous_response_id": None,
}
_JSON_VALUES = [{}, [], "text", 3, 2.5, True]  # one of each JSON type but null
# Fields that take a second JSON type: `input` a string (one user message), content as a string or parts.
_ALSO_VALID = {"input": "text", "input[0].content": [], "input[1].content": "text"}


def _same_json_type(a: object, b: object) -> bool:
    kinds = (bool, int, float, str, list, dict)
    return next(k for k in kinds if isinstance(a, k)) is next(k for k in kinds if isinstance(b, k))


def _fields(value: object, path: str) -> Iterator[tuple[str, list | dict, object]]:
    """(path, container, key) of every field under `value`, JSON schemas (tool parameters, text formats')
    not entered: they are the model's to read."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, inner in items:
        here = f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}" if path else key
        yield here, value, key
        if key not in ("parameters", "schema"):
            yield from _fields(inner, here)


def test_every_field_of_every_item_kind_refuses_each_wrong_json_type() -> None:
    """Each field of each input item kind, of a tool, the text format, reasoning and metadata, set in turn
    to every JSON type it is not: a ProtocolError (a 400) naming that field, or the item it belongs to
    where the item's kind is what is wrong; never another exception (a 500)."""
    assert parse_responses_request(_EVERY_FIELD).chat.generate  # the body itself is valid
    walked = 0
    for path, container, key in list(_fields(_EVERY_FIELD, "")):
        valid = container[key]
        if valid is None or path.startswith("input[4].") and path != "input[4].type":
            continue  # a reasoning item is context the template drops: only its kind is read
        for wrong in _JSON_VALUES:
            if (
                _same_json_type(wrong, valid)
                or path in _ALSO_VALID
                and _same_json_type(wrong, _ALSO_VALID[path])
            ):
                continue
            body = json.loads(json.dumps(_EVERY_FIELD))
            target = body
            for part in path.replace("]", "").replace("[", ".").split(".")[:-1]:
                target = target[int(part)] if isinstance(target, list) else target[part]
            target[int(key) if isinstance(target, list) else key] = wrong
            with pytest.raises(ProtocolError) as caught:
                parse_responses_request(body)
            owner = path.rsplit(".", 1)[0]
            assert caught.value.param in (path, owner), (path, wrong, caught.value.param, str(caught.value))
            walked += 1
    assert walked > 100, walked


def _responses(*parts: dict) -> list[generate_pb2.GenerateResponse]:
    return [generate_pb2.GenerateResponse(**p) for p in parts]


def test_reasoning_text_and_calls_become_items_in_order() -> None:
    """Qwen3's reasoning, then the answer, then a call: three output items, each opened, filled and closed
    before the next, and the whole response equal to what the events built."""
    request = parse_responses_request({"input": "hi", "reasoning": {"effort": "high"}, "tools": [WEATHER]})
    assert request.chat.generate[0].chat.template_kwargs["enable_thinking"] is True
    builder = ResponseBuilder(request, 0)
    call = generate_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    usage = generate_pb2.Usage(prompt_tokens=5, completion_tokens=9, cached_prompt_tokens=2)
    events = builder.start()
    for update in _responses(
        {"reasoning_text": "The user "},
        {"reasoning_text": "asks."},
        {"text": "Let me look."},
        {"tool_calls": [call], "finish_reason": generate_pb2.FINISH_REASON_TOOL_CALLS, "usage": usage},
    ):
        events += builder.add(update)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "The user asks."
    assert final["output"][2]["arguments"] == '{"city": "Paris"}'
    assert (
        final["usage"]["input_tokens_details"]["cached_tokens"] == 2 and final["usage"]["total_tokens"] == 14
    )
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]


def test_a_response_cut_by_max_output_tokens_is_incomplete() -> None:
    builder = ResponseBuilder(parse_responses_request({"input": "hi", "max_output_tokens": 2}), 0)
    events = builder.add(
        generate_pb2.GenerateResponse(text="ab", finish_reason=generate_pb2.FINISH_REASON_LENGTH)
    )
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_errors_of_the_chat_fields_say_they_came_from_the_responses_body() -> None:
    with pytest.raises(ProtocolError, match="from this /v1/responses body"):
        parse_responses_request({"input": "hi", "temperature": "hot"})


def test_a_conversation_continues_from_its_stored_response(served: Served, client: openai.OpenAI) -> None:
    """The second turn names the first: its prompt is the first's with the answer and the new input after
    it (its tokens equal a stateless request's that sends it all), and the first turn's blocks are cached."""
    opening = "Tell me about the quick brown fox that jumps over the lazy dog, in a few words please."
    first = client.responses.create(input=opening, max_output_tokens=8, temperature=0)
    assert first.store is True
    second = client.responses.create(
        previous_response_id=first.id, input="And the dog?", max_output_tokens=8, temperature=0
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the first turn's prompt, from the cache
    stateless = client.responses.create(
        input=[
            {"role": "user", "content": opening},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And the dog?"},
        ],
        max_output_tokens=8,
        temperature=0,
        store=False,
    )
    assert stateless.output_text == second.output_text and stateless.store is False
    assert stateless.usage.input_tokens == second.usage.input_tokens
    # retrieve, the input items (earlier turns' first, newest first by default), delete
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id)
    texts = [item.content[0].text for item in items.data]
    assert texts == ["And the dog?", opening]
    assert [
        i.content[0].text for i in client.responses.input_items.list(second.id, order="asc").data
    ] == texts[::-1]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stateless.id)  # store false: not kept
    with pytest.raises(openai.NotFoundError):
        served.client("bob").responses.retrieve(first.id)  # another token's
    with pytest.raises(openai.NotFoundError):
        served.client("bob").responses.create(previous_response_id=first.id, input="hi")
    with pytest.raises(openai.BadRequestError, match="not a background response"):
        client.responses.cancel(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(previous_response_id=first.id, input="hi")


@contextlib.contextmanager
def _another_router(
    served: Served, log: Path, store: str | None = None, *extra: str
) -> Iterator[ServerProcess]:
    """A router on the same worker and tokens, and on `store` (default: the same SQLite file, as the
    processes of --processes N share it)."""
    other = start_router(
        [served.worker.address],
        "--http-port", "0", "--auth-tokens-file", str(served.tokens),
        "--response-store", store or str(served.store), *extra,
        log_path=log,
    )  # fmt: skip
    try:
        wait_serving(other.address)
        yield other
    finally:
        other.stop()


def test_a_stored_stream_continues_on_another_router_sharing_the_store(served: Served, tmp_path) -> None:
    """Two routers (as --processes N are, and with the same file) share the SQLite store: a streamed
    response stored by one is continued and retrieved through the other."""
    with _another_router(served, tmp_path / "router-b.log") as other:
        with served.client().responses.stream(
            input="The quick brown fox", max_output_tokens=8, temperature=0
        ) as stream:
            first = list(stream)[-1].response
        there = served.client(router=other)
        assert there.responses.retrieve(first.id).output_text == first.output_text
        second = there.responses.create(
            previous_response_id=first.id, input="More.", max_output_tokens=4, temperature=0
        )
        assert served.client().responses.retrieve(second.id).previous_response_id == first.id


def test_the_store_refuses_past_its_size_and_forgets_past_its_time(tmp_path) -> None:
    async def run() -> None:
        store = ResponseStore(tmp_path / "full.sqlite", ttl_s=60, max_bytes=2**20)
        for i in range(8):  # 8 x 200 KB: past 1 MiB
            await store.put("alice", f"resp_{i}", {"blob": "x" * 200_000})
        with pytest.raises(StoreFull, match=r"the response store is full: .* MiB of its 1 MiB"):
            await store.check_space()
        assert await store.get("bob", "resp_0") is None  # another owner's
        await store.delete("alice", "resp_0")
        expired = ResponseStore(tmp_path / "expired.sqlite", ttl_s=-1, max_bytes=2**20)
        await expired.put("alice", "resp_x", {"a": 1})
        assert await expired.get("alice", "resp_x") is None  # past its time to live
        await expired.check_space()  # which also deletes it
        assert await store.get("alice", "resp_1") == {"blob": "x" * 200_000}

    asyncio.run(run())


def _sse(
    address: str, method: str, path: str, body: dict | None = None, limit: int | None = None
) -> list[bytes]:
    """The `data:` payloads of a server-sent event stream, as sent; the connection closed after `limit`."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Authorization": f"Bearer {TOKENS['alice']}", "Content-Type": "application/json"}
    try:
        connection.request(method, path, json.dumps(body) if body else None, headers)
        response = connection.getresponse()
        assert response.status == 200, response.read()
        events = []
        for line in response:
            if line.startswith(b"data: "):
                events.append(line[len(b"data: ") :].rstrip(b"\n"))
                if len(events) == limit or json.loads(events[-1])["type"] in TERMINAL_EVENTS:
                    break
        return events
    finally:
        connection.close()  # before its end: the client is gone


def test_a_background_response_resumes_on_another_router(served: Served, tmp_path) -> None:
    """Started on one router, its client gone after 5 events; resumed on another from event 6: the events
    are byte for byte those the response kept (an uninterrupted stream of it), and the prompt was computed
    once."""
    with _another_router(served, tmp_path / "router-b.log") as other:
        _assert_a_background_stream_resumes(served, served.router, other)


def _assert_a_background_stream_resumes(served: Served, first: ServerProcess, second: ServerProcess) -> None:
    prompt_before = total(scrape(served.worker.metrics_address), "nanovllm:prompt_tokens_total")
    body = {
        "model": served.model, "input": "The quick brown fox", "max_output_tokens": 24, "temperature": 0,
        "background": True, "stream": True,
    }  # fmt: skip
    head = _sse(first.http_address, "POST", "/v1/responses", body, limit=5)
    response_id = json.loads(head[0])["response"]["id"]
    assert [json.loads(e)["sequence_number"] for e in head] == [0, 1, 2, 3, 4]
    path = f"/v1/responses/{response_id}?stream=true"
    tail = _sse(second.http_address, "GET", path + "&starting_after=4")
    whole = _sse(second.http_address, "GET", path)
    assert head + tail == whole
    assert json.loads(whole[-1])["type"] in ("response.completed", "response.incomplete")
    final = served.client(router=second).responses.retrieve(response_id)
    deltas = [json.loads(e) for e in whole if json.loads(e)["type"] == "response.output_text.delta"]
    assert final.background and final.output_text == "".join(d["delta"] for d in deltas)
    prompt_after = total(scrape(served.worker.metrics_address), "nanovllm:prompt_tokens_total")
    computed = final.usage.input_tokens - final.usage.input_tokens_details.cached_tokens
    assert prompt_after - prompt_before == computed  # once: the resumed stream ran nothing


@contextlib.contextmanager
def _redis_server(tmp_path: Path) -> Iterator[str]:
    """A real redis-server on a free port (`make venv` installs it), persisting nothing; its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in server.stdout:  # its log: ready once it says so
            if "Ready to accept connections" in line:
                break
        else:
            raise AssertionError(f"redis-server exited with {server.wait()} before it was ready")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_two_routers_share_a_redis_store(served: Served, tmp_path) -> None:
    """Two router instances on a Redis store (as replicas on several machines are): a conversation
    started on one continues on the other, and a background stream left on one resumes on the other."""
    with (
        _redis_server(tmp_path) as url,
        _another_router(served, tmp_path / "router-a.log", url) as a,
        _another_router(served, tmp_path / "router-b.log", url) as b,
    ):
        opening = "Tell me about the quick brown fox that jumps over the lazy dog, in a few words please."
        first = served.client(router=a).responses.create(input=opening, max_output_tokens=8, temperature=0)
        second = served.client(router=b).responses.create(
            previous_response_id=first.id, input="And the dog?", max_output_tokens=8, temperature=0
        )
        assert second.usage.input_tokens_details.cached_tokens >= 16
        assert served.client(router=a).responses.retrieve(second.id).output_text == second.output_text
        with pytest.raises(openai.NotFoundError):
            served.client(router=a).responses.retrieve(first.id.replace("resp_", "resp_0"))
        _assert_a_background_stream_resumes(served, a, b)


def test_a_background_response_cancelled_stops_its_request(served: Served, client: openai.OpenAI) -> None:
    # long enough that the cancel (sent as soon as the first token came) finds it running
    started = client.responses.create(input="The quick brown fox", max_output_tokens=900, background=True)
    assert started.status == "queued" and started.background
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    assert cancelled.usage.output_tokens < 900
    wait_idle(served.worker.address)  # the worker's request was aborted: nothing runs
    with pytest.raises(openai.BadRequestError, match="background=true needs a stored response"):
        client.responses.create(input="hi", background=True, store=False)
    plain = client.responses.create(input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only a background response's events"):
        list(client.responses.retrieve(plain.id, stream=True))
    with pytest.raises(openai.BadRequestError, match="not a background response"):
        client.responses.cancel(plain.id)


def test_a_full_store_refuses_to_store_before_anything_runs(served: Served, tmp_path) -> None:
    full = tmp_path / "full.sqlite"

    async def fill() -> None:
        store = ResponseStore(full, ttl_s=3600, max_bytes=2**20)
        for i in range(6):
            await store.put("alice", f"resp_{i}", {"blob": "x" * 200_000})

    asyncio.run(fill())
    with _another_router(
        served, tmp_path / "router-full.log", str(full), "--response-store-max-bytes", "1048576"
    ) as router:
        client = served.client(router=router)
        with pytest.raises(openai.APIStatusError) as caught:
            client.responses.create(input="hi", max_output_tokens=2)
        assert caught.value.status_code == 507 and "the response store is full" in caught.value.message
        assert client.responses.create(
            input="hi", max_output_tokens=2, store=False
        ).status  # not stored: served


def test_a_router_stopping_stops_its_background_responses(served: Served, tmp_path) -> None:
    """A router stopped (a drain of 0.1 s) while its background response runs: nothing is left running on
    the worker and the router's log holds no error, whether the response finished in time or was stopped
    (its record then stays as last kept)."""
    log = tmp_path / "router-stopping.log"
    with _another_router(served, log, None, "--drain-timeout", "0.1") as router:
        started = served.client(router=router).responses.create(
            input="The quick brown fox", max_output_tokens=400, background=True
        )
        assert started.status == "queued"
    wait_idle(served.worker.address)
    assert (
        library_errors(log) == [] and "background_response_failed" not in log.read_text()
    )  # no bug on the way


THINKING = QWEN3.replace(
    """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}""",
    """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}""",
)


def test_reasoning_items_with_thinking_on(qwen3_dir: Path, kernels, tmp_path) -> None:
    """A thinking model's template (as Qwen3-Thinking's: the generation prompt opens the reasoning): with
    thinking on, what the model writes is a reasoning item, streamed as reasoning_text deltas; with
    reasoning.effort none, Qwen3's template closes the block and the answer is a message."""
    assert THINKING != QWEN3
    model = tmp_path / "thinking"
    shutil.copytree(qwen3_dir, model)
    build_tokenizer(THINKING).save_pretrained(model)
    with router_and_worker(model, tmp_path, ("--max-model-len", "1024"), ("--http-port", "0")) as (_, router):
        client = _bound(
            openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="none", max_retries=0),
            "thinking",
        )
        thought = client.responses.create(
            input="Why is the sky blue?", reasoning={"effort": "high"}, max_output_tokens=12, temperature=0
        )
        assert thought.output[0].type == "reasoning" and thought.output[0].content[0].text
        assert 0 < thought.usage.output_tokens_details.reasoning_tokens <= thought.usage.output_tokens
        events = list(
            client.responses.create(
                input="Why is the sky blue?", reasoning={"effort": "high"}, max_output_tokens=12, temperature=0,
                stream=True,
            )
        )  # fmt: skip
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == thought.output[0].content[0].text
        plain = client.responses.create(
            input="Why is the sky blue?", reasoning={"effort": "none"}, max_output_tokens=12, temperature=0
        )
        assert [item.type for item in plain.output] == ["message"]
        assert plain.usage.output_tokens_details.reasoning_tokens == 0
