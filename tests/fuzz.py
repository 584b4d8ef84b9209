"""Property-based fuzzing of the public Generate API against real router and worker processes.

`requests()` draws GenerateRequests, mostly malformed in some field: out-of-range and non-finite floats,
huge or empty lists, token ids outside the vocabulary, long ids and stop strings, unpaired surrogates
stripped by protobuf, missing prompts; `raw_messages()` draws bytes that may not parse at all. Each case
is one call whose outcome must be a clean one: a finished stream, or a status that blames the request.
`http_bodies()` does the same for the router's OpenAI-compatible HTTP face: JSON bodies whose fields are
valid or anything JSON can hold (wrong types, nesting, lone surrogates, NaN, integers past 64 bits), huge
arrays, giant `n`, truncated JSON, invalid UTF-8 and random bytes; each must be answered with a 4xx or a
clean completion, never a 5xx. `Bystanders` keep valid greedy streams running meanwhile: no fuzz case may
fail or change them.

tests/test_fuzz.py runs a few hundred gRPC cases and 1,000 HTTP bodies in CI; bench/robustness.py runs
thousands.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field

import grpc
from hypothesis import strategies as st
from typing_extensions import Self

from nanovllm.v1 import generate_pb2, generate_pb2_grpc

# What a request may legitimately end with. INTERNAL, UNKNOWN (an unhandled error) and UNAVAILABLE (a
# healthy single worker) are failures of the server, not of the request.
ACCEPTED_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,  # the case cancelled its own call after a few responses
    }
)
# A case reads at most this many responses and then cancels: valid requests with huge max_tokens would
# otherwise run to max_model_len.
MAX_RESPONSES = 4
CALL_TIMEOUT_S = 60.0

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 0.01, 0.5, 1.0, 2.0, 100.0, 1e30]),
)
SMALL_IDS = st.integers(0, 600)  # around the test model's 512-token vocabulary
TOKEN_IDS = st.one_of(SMALL_IDS, UINT32)
TEXT = st.text(max_size=64)


def _optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


# The strategies a draw uses are built once, here: one built inside a draw is validated again at every draw
# (measured: half of the HTTP bodies' generation time).
SAMPLING_FIELDS: dict[str, st.SearchStrategy] = {
    "temperature": _optional(FLOATS),
    "top_k": _optional(st.one_of(st.integers(-2, 60), INT32)),
    "top_p": _optional(FLOATS),
    "min_p": _optional(FLOATS),
    "repetition_penalty": _optional(FLOATS),
    "presence_penalty": _optional(FLOATS),
    "frequency_penalty": _optional(FLOATS),
    "seed": _optional(st.integers(-(2**63), 2**63 - 1)),
    "max_tokens": _optional(st.one_of(st.integers(-2, 8), INT32)),
    "min_tokens": _optional(st.one_of(st.integers(-2, 8), INT32)),
    "stop": _optional(st.lists(st.one_of(TEXT, st.text(min_size=200, max_size=3000)), max_size=20)),
    "stop_token_ids": _optional(
        st.one_of(st.lists(TOKEN_IDS, max_size=8), st.lists(SMALL_IDS, min_size=100, max_size=3000))
    ),
    "ignore_eos": _optional(st.booleans()),
    "logprobs": _optional(st.one_of(st.integers(-2, 25), INT32)),
}


@st.composite
def sampling_params(draw: st.DrawFn) -> generate_pb2.SamplingParams:
    values = {name: draw(strategy) for name, strategy in SAMPLING_FIELDS.items()}
    return generate_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})


REQUEST_IDS = st.one_of(TEXT, st.text(min_size=300, max_size=5000))
PROMPT_KINDS = st.sampled_from(["text", "chat", "token_ids", "none"])
PROMPT_TEXTS = st.one_of(TEXT, st.text(min_size=500, max_size=20_000))
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)
PROMPT_IDS = st.one_of(st.lists(SMALL_IDS, max_size=40), st.lists(TOKEN_IDS, max_size=600))


@st.composite
def requests(draw: st.DrawFn) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(
        request_id=draw(REQUEST_IDS),
        priority=draw(INT32),
        return_token_ids=draw(st.booleans()),
    )
    prompt = draw(PROMPT_KINDS)
    if prompt == "text":
        request.text = draw(PROMPT_TEXTS)
    elif prompt == "chat":
        for _ in range(draw(st.integers(0, 4))):
            request.chat.messages.add(role=draw(ROLES), content=draw(TEXT))
    elif prompt == "token_ids":
        ids = draw(PROMPT_IDS)
        request.token_ids.ids.extend(ids)
        if not ids:
            request.token_ids.SetInParent()  # an empty list, but the prompt set
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_params()))
    return request


def raw_messages() -> st.SearchStrategy[bytes]:
    """Bytes for the Generate method: random, truncated valid messages, invalid UTF-8 in a string field."""
    return st.one_of(
        st.binary(max_size=200),
        requests()
        .map(lambda r: r.SerializeToString())
        .flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),
        st.binary(min_size=1, max_size=20).map(lambda b: b"\x0a" + bytes([len(b) + 1]) + b"\xff" + b),
    )


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    finish_reasons: list[int]


def _finish(call, responses_seen: list) -> Outcome:
    reasons: list[int] = []
    try:
        for response in call:
            responses_seen.append(response)
            if response.finish_reason:
                reasons.append(response.finish_reason)
            if len(responses_seen) >= MAX_RESPONSES:
                call.cancel()
        return Outcome(grpc.StatusCode.OK, "", reasons)
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", reasons)


def run_request(channel: grpc.Channel, request: generate_pb2.GenerateRequest) -> Outcome:
    call = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT_S)
    return _finish(call, [])


def run_raw(channel: grpc.Channel, payload: bytes) -> Outcome:
    method = channel.unary_stream(
        "/nanovllm.v1.Generation/Generate",
        request_serializer=lambda b: b,
        response_deserializer=generate_pb2.GenerateResponse.FromString,
    )
    return _finish(method(payload, timeout=CALL_TIMEOUT_S), [])


def check(outcome: Outcome) -> None:
    """The outcome blames the request or succeeds; a stream never ends in FINISH_REASON_ERROR."""
    if outcome.code not in ACCEPTED_CODES:
        raise AssertionError(f"{outcome.code.name}: {outcome.details}")
    if generate_pb2.FINISH_REASON_ERROR in outcome.finish_reasons:
        raise AssertionError(f"a stream ended in FINISH_REASON_ERROR: {outcome}")


# --- the HTTP face ---------------------------------------------------------------------------------------

LONE_SURROGATES = st.sampled_from(["\ud800", "a\udfff", "\udc00\ud800"])
# Past each wire type's range (int32, int64, uint64, double), and JSON's odd corners.
EDGES = st.sampled_from(
    [-1, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64 + 1, 10**400, 1e308, -0.0, "", [], {}]
)
JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN and infinities too: Python's json writes and reads them
    EDGES,
    TEXT,
    LONE_SURROGATES,
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
HOSTILE = st.one_of(EDGES, LONE_SURROGATES, JSON_VALUES)
MAX_HTTP_TOKENS = 6  # a valid body generates at most this many tokens per choice


def _huge(item: object) -> st.SearchStrategy[list]:
    return st.integers(1_000, 20_000).map(lambda k: [item] * k)


def _valid_or_hostile(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, HOSTILE)


def _small_length(value: object) -> bool:
    """Not a length that would make a valid body generate for long (a hostile value must be refused)."""
    return not (isinstance(value, int) and not isinstance(value, bool) and MAX_HTTP_TOKENS < value < 2**31)


def _nested_fields(value: object) -> list[tuple[list | dict, object]]:
    """(container, key) of every field at any depth under `value`."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    found: list[tuple[list | dict, object]] = []
    for key, inner in items:
        found += [(value, key), *_nested_fields(inner)]
    return found


@st.composite
def _one_field_hostile(draw: st.DrawFn, valid: st.SearchStrategy) -> object:
    """A valid value (an item, a tool, a message) with one field at any depth hostile: a wrong JSON type
    where a nested field's reader expects another."""
    value = json.loads(json.dumps(draw(valid)))
    fields = _nested_fields(value)
    if fields:
        container, key = draw(st.sampled_from(fields))
        container[key] = draw(HOSTILE)
    return value


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": TEXT}
)


def _valid_or_nested_hostile(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, _one_field_hostile(valid))


TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "get_weather"]), "parameters": st.just({"type": "object"})}
        ),
    }
)
# A chat message of each shape the chat face reads: text parts, an assistant's tool calls, a tool's answer.
CHAT_MESSAGE = st.sampled_from(
    [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
)
HTTP_FIELDS: dict[str, st.SearchStrategy] = {
    "model": TEXT,
    "temperature": st.sampled_from([0, 0.001, 0.5, 1, 2.0]),
    "top_p": st.floats(0.01, 1.0),
    "seed": st.integers(0, 2**31),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4), _huge("x")),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)),
    "top_logprobs": st.integers(0, 5),
    "n": st.one_of(st.integers(1, 3), st.sampled_from([10**6, 2**63, 2**64 + 1])),
    "user": TEXT,
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            {"type": "json_schema", "json_schema": []},
            {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
        ]
    ),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "tools": st.one_of(
        st.lists(_valid_or_nested_hostile(TOOL), max_size=2),
        _huge({"type": "function", "function": {"name": "f"}}),
    ),
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}, {"function": "f"}]
    ),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "chat_template_kwargs": st.one_of(
        st.fixed_dictionaries({"enable_thinking": st.booleans()}), st.just({"messages": []})
    ),
    "unknown_field": JSON_VALUES,
}


RESPONSES_ITEM = st.one_of(
    MESSAGE,
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.sampled_from(["user", "developer"]),
            "content": st.just([{"type": "input_text", "text": "hi"}]),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": TEXT, "name": st.just("f"), "arguments": st.just("{}")}
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT}),
    st.fixed_dictionaries({"type": JSON_VALUES, "role": JSON_VALUES, "content": JSON_VALUES}),
)
RESPONSES_ITEM = st.one_of(RESPONSES_ITEM, _one_field_hostile(RESPONSES_ITEM))
RESPONSES_FIELDS: dict[str, st.SearchStrategy] = {
    "model": TEXT,
    "instructions": st.one_of(TEXT, JSON_VALUES),
    "temperature": HTTP_FIELDS["temperature"],
    "top_p": HTTP_FIELDS["top_p"],
    "stream": st.booleans(),
    "tools": st.lists(
        _valid_or_nested_hostile(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "name": st.sampled_from(["f", "g"]),
                    "description": TEXT,
                    "parameters": st.just({"type": "object"}),
                }
            )
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "name": "f"}, {"name": 3}]
    ),
    "text": _valid_or_nested_hostile(
        st.sampled_from(
            [
                {"format": {"type": "text"}},
                {"format": {"type": "json_object"}},
                {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                {"format": []},
            ]
        )
    ),
    "reasoning": _valid_or_nested_hostile(st.sampled_from([{"effort": "none"}, {"effort": "high"}, {}])),
    "metadata": _valid_or_nested_hostile(st.just({"k": "v"})),
    "store": st.booleans(),
    "previous_response_id": TEXT,
    "background": st.booleans(),
    "unknown_field": JSON_VALUES,
}


HTTP_PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"])
HTTP_LENGTHS = _valid_or_hostile(st.integers(1, MAX_HTTP_TOKENS)).filter(_small_length)
RESPONSES_INPUT = st.one_of(TEXT, st.lists(RESPONSES_ITEM, min_size=1, max_size=3), JSON_VALUES)
RESPONSES_NAMES = st.lists(st.sampled_from(sorted(RESPONSES_FIELDS)), max_size=5, unique=True)
RESPONSES_HOSTILE_NAMES = st.lists(st.sampled_from(sorted(RESPONSES_FIELDS)), max_size=2, unique=True)
CHAT_MESSAGES = st.one_of(
    st.lists(MESSAGE, min_size=1, max_size=3),
    JSON_VALUES,
    _huge({"role": "user", "content": "hi"}),
    st.lists(st.fixed_dictionaries({"role": JSON_VALUES, "content": JSON_VALUES}), max_size=2),
    st.lists(_one_field_hostile(CHAT_MESSAGE), min_size=1, max_size=3),
)
PROMPTS = st.one_of(TEXT, st.lists(SMALL_IDS, min_size=1, max_size=20), JSON_VALUES, _huge(7), _huge("x"))
HTTP_NAMES = st.lists(st.sampled_from(sorted(HTTP_FIELDS)), max_size=6, unique=True)
HTTP_HOSTILE_NAMES = st.lists(st.sampled_from(sorted(HTTP_FIELDS)), max_size=2, unique=True)


@st.composite
def http_json(draw: st.DrawFn) -> tuple[str, object]:
    """A path and a JSON value for it: mostly an object with a prompt and some fields, each valid or
    hostile; the length fields are always set and never valid and long."""
    path = draw(HTTP_PATHS)
    chat = path == "/v1/chat/completions"
    if draw(st.integers(0, 19)) == 0:
        return path, draw(JSON_VALUES)  # not an object at all, most of the time
    if path == "/v1/responses":
        body = {
            "max_output_tokens": draw(HTTP_LENGTHS),
            "input": draw(RESPONSES_INPUT),
        }
        for name in draw(RESPONSES_NAMES):
            body[name] = draw(RESPONSES_FIELDS[name])
        for name in draw(RESPONSES_HOSTILE_NAMES):
            body[name] = draw(HOSTILE)
        return path, body
    body: dict[str, object] = {"max_tokens": draw(HTTP_LENGTHS)}
    if chat:
        body["messages"] = draw(CHAT_MESSAGES)
        if draw(st.booleans()):
            body["max_completion_tokens"] = draw(HTTP_LENGTHS)
    else:
        body["prompt"] = draw(PROMPTS)
    # Valid fields, then at most two hostile ones: a body whose first field is wrong never reaches the
    # code that reads the others.
    for name in draw(HTTP_NAMES):
        body[name] = draw(HTTP_FIELDS[name])
    for name in draw(HTTP_HOSTILE_NAMES):
        body[name] = draw(HOSTILE)
    return path, body


BODY_KINDS = st.sampled_from(["json", "json", "json", "truncated", "bad_utf8", "bytes", "deep", "huge"])
BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"])


@st.composite
def http_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A path and the bytes POSTed to it: JSON as above (with NaN where a float is one), cut short,
    broken by invalid UTF-8, or random bytes."""
    path, value = draw(http_json())
    text = json.dumps(value).encode()
    kind = draw(BODY_KINDS)
    if kind == "truncated":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif kind == "bad_utf8":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(BAD_UTF8) + text[at:]
    elif kind == "bytes":
        text = draw(st.binary(max_size=200))
    elif kind == "deep":  # past Python's recursion limit
        text = b'{"messages": ' + b"[" * draw(st.integers(1_000, 100_000))
    elif kind == "huge":  # past the body limit (4 MiB)
        text = b'{"prompt": "' + b"x" * draw(st.integers(4 * 2**20, 5 * 2**20)) + b'"}'

    return path, text


@dataclass
class HttpOutcome:
    status: int
    detail: str  # the error message, or what was wrong with a 200


def run_http(address: str, path: str, body: bytes) -> HttpOutcome:
    """POST `body`; read a streamed answer up to MAX_RESPONSES events, then hang up (which cancels it)."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return HttpOutcome(response.status, response.read().decode(errors="replace")[:500])
        if response.getheader("content-type", "").startswith("text/event-stream"):
            return HttpOutcome(200, _read_events(response))
        answer = json.loads(response.read())
        # a Response object (a background one is answered queued, before any output)
        answered = answer.get("object") == "response" if path == "/v1/responses" else answer.get("choices")
        return HttpOutcome(200, "" if answered else f"no choices or output in {answer}")
    finally:
        connection.close()


def _read_events(response: http.client.HTTPResponse) -> str:
    """'' for a clean stream (or one this reader left), else what was wrong."""
    events = 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            return ""
        chunk = json.loads(data)
        if "error" in chunk or chunk.get("type") == "response.failed":
            return f"error event: {chunk}"
        if chunk.get("type") in ("response.completed", "response.incomplete"):  # a Responses stream's end
            return ""
        events += 1
        if events >= MAX_RESPONSES:
            return ""
    return "the stream ended without [DONE]"


def check_http(outcome: HttpOutcome) -> None:
    """A 4xx that blames the body, or a clean answer; never a 5xx."""
    if not (outcome.status == 200 and outcome.detail == "" or 400 <= outcome.status < 500):
        raise AssertionError(f"HTTP {outcome.status}: {outcome.detail}")


BYSTANDER_PROMPTS = [[5, 6, 7, 8], list(range(40, 70)), [100, 3, 100, 3]]
BYSTANDER_TOKENS = 12


@dataclass
class Bystanders:
    """Valid greedy streams, one thread each, re-sent until stopped. Each must finish OK with the same
    tokens every time: a fuzz case that fails, stalls or perturbs another request shows up here."""

    address: str
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Self:
        for prompt in BYSTANDER_PROMPTS:
            thread = threading.Thread(target=self._run, args=(prompt,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=CALL_TIMEOUT_S)

    def _run(self, prompt: list[int]) -> None:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=BYSTANDER_TOKENS, ignore_eos=True),
            return_token_ids=True,
        )
        first: list[int] | None = None
        with grpc.insecure_channel(self.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            while not self._stop.is_set():
                try:
                    responses = list(stub.Generate(request, timeout=CALL_TIMEOUT_S))
                except grpc.RpcError as exc:
                    self.failures.append(f"prompt {prompt[:4]}: {exc.code().name}: {exc.details()}")
                    continue
                tokens = [t for r in responses for t in r.token_ids]
                reason = responses[-1].finish_reason if responses else None
                if reason != generate_pb2.FINISH_REASON_LENGTH or len(tokens) != BYSTANDER_TOKENS:
                    self.failures.append(f"prompt {prompt[:4]}: {len(tokens)} tokens, finish reason {reason}")
                elif first is None:
                    first = tokens
                elif tokens != first:
                    self.failures.append(f"prompt {prompt[:4]}: tokens changed from {first} to {tokens}")
                self.completed += 1
