"""Property-based fuzzing of the public Generate API against real router and worker processes.

`requests()` draws GenerateRequests, mostly malformed in some field: out-of-range and non-finite floats,
huge or empty lists, token ids outside the vocabulary, long ids and stop strings, unpaired surrogates
stripped by protobuf, missing prompts; `raw_messages()` draws bytes that may not parse at all. Each case
is one call whose outcome must be a clean one: a finished stream, or a status that blames the request.
`Bystanders` keep valid greedy streams running meanwhile: no fuzz case may fail or change them.

tests/test_fuzz.py runs a few hundred cases in CI; bench/robustness.py runs thousands.
"""

from __future__ import annotations

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


@st.composite
def sampling_params(draw: st.DrawFn) -> generate_pb2.SamplingParams:
    fields = {
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
    values = {name: draw(strategy) for name, strategy in fields.items()}
    return generate_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})


@st.composite
def requests(draw: st.DrawFn) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(
        request_id=draw(st.one_of(TEXT, st.text(min_size=300, max_size=5000))),
        priority=draw(INT32),
        return_token_ids=draw(st.booleans()),
    )
    prompt = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if prompt == "text":
        request.text = draw(st.one_of(TEXT, st.text(min_size=500, max_size=20_000)))
    elif prompt == "chat":
        roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)
        for _ in range(draw(st.integers(0, 4))):
            request.chat.messages.add(role=draw(roles), content=draw(TEXT))
    elif prompt == "token_ids":
        ids = draw(st.one_of(st.lists(SMALL_IDS, max_size=40), st.lists(TOKEN_IDS, max_size=600)))
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
