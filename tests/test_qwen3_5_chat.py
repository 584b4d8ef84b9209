"""A Qwen3.5 chat as its users call it: `nanovllm serve` with a random Qwen3.5 and a chat template in
Qwen3.5's format (tests/chat_templates.py), driven by the official `openai` client (chat completions and
the Responses API) and by gRPC. Thinking on, the reasoning arrives apart from the answer; off, the answer
alone; a named tool_choice returns a call in Qwen3.5's own format, parsed, its arguments of their schema's
types. The random model is made to say what each check needs by a structured-output constraint (vLLM's
`structured_outputs` on HTTP, the `constraint` on gRPC) or by the forced call's grammar. An earlier
answer's reasoning sent back reaches the template (Qwen3.6's preserve_thinking)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from nanovllm.common.v1 import worker_pb2
from nanovllm.router.calls.validation import prompt_token_ids
from nanovllm.router.faces.openai_protocol import ProtocolError, parse_request
from nanovllm.router.faces.responses import parse_responses_request
from nanovllm.router.fleet.tokenizer import ModelTokenizer
from nanovllm.v1 import generate_pb2
from tests.chat_templates import QWEN3_5
from tests.model_factory import build_model, build_tokenizer
from tests.services import collect, serve_addresses

# Thinking on, the prompt opens the reasoning (`<think>\n`): the model writes the rest of it.
THOUGHT = "plan it\n</think>\n\nyes"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "days", "metric", "note"],
    "additionalProperties": False,
}
OFF = {"enable_thinking": False}


@dataclass
class Served:
    grpc: str
    client: openai.OpenAI
    model: str


@pytest.fixture(scope="module")
def served(kernels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("qwen3_5_chat")
    model = build_model("qwen3_5", root / "qwen3_5", num_layers=4, seed=3)
    log_path = root / "serve.log"
    with log_path.open("w") as log:
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nanovllm.cli",
                "serve",
                "--model",
                str(model),
                "--port",
                "0",
                "--metrics-port",
                "0",
            ]
            + ["--http-port", "0", "--kv-cache-memory", "32MiB", "--max-model-len", "1024"]
            + ["--dtype", "float32", "--log-format", "json"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        router, http, _ = serve_addresses(serve.stdout)
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0)
        yield Served(router, client, model.name)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    # serve's two children log JSON records into its stderr, where their lines can interleave; its own
    # lines are plain text
    decoder, records = json.JSONDecoder(), []
    for line in log_path.read_text().splitlines():
        at = 0
        while line.startswith("{", at):
            record, at = decoder.raw_decode(line, at)
            records.append(record)
    assert [r for r in records if "logger" in r and r["level"] == "error"] == []


def _weather_tool_args(arguments: str) -> dict:
    """The call's arguments, each of its schema's type (bool is not an integer here)."""
    args = json.loads(arguments)
    assert set(args) == {"city", "days", "metric", "note"}, args
    assert args["city"] in ("Paris", "Oslo")
    assert type(args["days"]) is int and 1 <= args["days"] <= 7
    assert type(args["metric"]) is bool
    assert type(args["note"]) is str and len(args["note"]) <= 6
    return args


def test_thinking_on_streams_the_reasoning_apart(served: Served) -> None:
    stream = served.client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=40,
        stream=True,
        extra_body={"structured_outputs": {"regex": THOUGHT}},
    )
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("plan it", "yes")


def test_thinking_off_answers_without_reasoning(served: Served) -> None:
    answer = served.client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=40,
        extra_body={"chat_template_kwargs": OFF, "structured_outputs": {"regex": "yes, plan it"}},
    )
    message = answer.choices[0].message
    assert message.content == "yes, plan it"
    assert (message.model_extra or {}).get("reasoning_content") is None


def test_a_named_tool_choice_returns_a_typed_call(served: Served) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    answer = served.client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Weather in Oslo this week?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=400,
        extra_body={"chat_template_kwargs": OFF},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _weather_tool_args(call.function.arguments)


@pytest.mark.parametrize("effort", ["medium", "minimal"])
def test_the_responses_api_splits_the_reasoning_as_its_effort_asks(served: Served, effort: str) -> None:
    """reasoning.effort switches the thinking: a reasoning item holds the thoughts, the message the
    answer alone; `minimal` turns it off, so the same words are all answer."""
    response = served.client.responses.create(
        model=served.model,
        input="Hi",
        reasoning={"effort": effort},
        temperature=0,
        max_output_tokens=40,
        extra_body={"structured_outputs": {"regex": THOUGHT}},
    )
    kinds = [item.type for item in response.output]
    if effort == "medium":
        assert kinds == ["reasoning", "message"]
        assert response.output[0].content[0].text == "plan it"
        assert response.output_text == "yes"
    else:
        assert kinds == ["message"]
        assert response.output_text == THOUGHT


def test_the_responses_api_returns_the_same_call(served: Served) -> None:
    response = served.client.responses.create(
        model=served.model,
        input="Weather in Oslo this week?",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        reasoning={"effort": "minimal"},  # thinking off
        temperature=0,
        max_output_tokens=400,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    _weather_tool_args(call.arguments)


def test_grpc_splits_the_reasoning_and_returns_the_call(served: Served) -> None:
    hi = [generate_pb2.ChatMessage(role="user", content="Hi")]
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=40, regex=THOUGHT)
    responses, error = collect(
        served.grpc, generate_pb2.GenerateRequest(chat=generate_pb2.Chat(messages=hi), sampling=sampling)
    )
    assert error is None, error
    assert "".join(r.reasoning_text for r in responses) == "plan it"
    assert "".join(r.text for r in responses) == "yes"

    chat = generate_pb2.Chat(
        messages=hi,
        tools=[generate_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER))],
        tool_choice=generate_pb2.ToolChoice(function="get_weather"),
        enable_thinking=False,
    )
    request = generate_pb2.GenerateRequest(
        chat=chat, sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=400)
    )
    responses, error = collect(served.grpc, request)
    assert error is None, error
    (call,) = [call for r in responses for call in r.tool_calls]
    assert call.name == "get_weather"
    _weather_tool_args(call.arguments)
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_TOOL_CALLS
    assert "".join(r.text for r in responses) == ""


# --- earlier turns' reasoning (Qwen3.6's preserve_thinking) ---------------------------------------------


@pytest.fixture(scope="module")
def qwen3_5_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    directory = tmp_path_factory.mktemp("qwen3_5-tokenizer")
    build_tokenizer(QWEN3_5).save_pretrained(directory)
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    info = worker_pb2.WorkerInfo(model="qwen3_5", architectures=["Qwen3_5ForCausalLM"], tokenizer_files=files)
    return ModelTokenizer(info)


def _prompt(tokenizer: ModelTokenizer, request: generate_pb2.GenerateRequest, **kwargs: bool) -> str:
    """The prompt text `request` renders to with template variables `kwargs`."""
    with_kwargs = generate_pb2.GenerateRequest()
    with_kwargs.CopyFrom(request)
    with_kwargs.chat.template_kwargs.update(kwargs)
    return tokenizer.decode_tail(prompt_token_ids(with_kwargs, tokenizer, "qwen3_5"), 10**6)


def test_earlier_reasoning_reaches_a_template_that_keeps_it(qwen3_5_tokenizer: ModelTokenizer) -> None:
    """An answer's reasoning sent back (chat: the assistant message's reasoning_content, as vLLM takes
    it; Responses: the reasoning item before it) is the template's to show: with preserve_thinking the
    history keeps it, without it the template drops it, as Qwen3.5's does."""
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "they greet me"},
        {"role": "user", "content": "And now?"},
    ]
    chat = parse_request({"messages": turns}, chat=True).generate[0]
    responses = parse_responses_request(
        {
            "input": [
                {"type": "message", "role": "user", "content": "Hi"},
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "they greet me"}]},
                {"type": "message", "role": "assistant", "content": "Hello!"},
                {"type": "message", "role": "user", "content": "And now?"},
            ]
        }
    ).chat.generate[0]
    for request in (chat, responses):
        assert request.chat.messages[1].reasoning_content == "they greet me"
        kept = _prompt(qwen3_5_tokenizer, request, preserve_thinking=True)
        assert "<think>\nthey greet me\n</think>\n\nHello!" in kept
        assert "they greet me" not in _prompt(qwen3_5_tokenizer, request)
    with pytest.raises(ProtocolError, match=r"messages\[1\].reasoning_content must be a string"):
        parse_request({"messages": [turns[0], {**turns[1], "reasoning_content": 3}]}, chat=True)
