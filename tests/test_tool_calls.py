"""Tools and tool calls (router/calls/tool_calls.py): the parser on scripted streams (no model), the request's
checks, Qwen3's real template rendering tools and their results, and forced calls through the router."""

from __future__ import annotations

import asyncio
import itertools
import json

import grpc
import jsonschema
import pytest
from llguidance import LLMatcher

from nanovllm.common.v1 import worker_pb2
from nanovllm.router.calls.completion import CompletionText
from nanovllm.router.calls.generate_replies import build_response
from nanovllm.router.calls.reasoning import ReasoningSplit, reasoning_format
from nanovllm.router.calls.text_stream import TextStream
from nanovllm.router.calls.tool_calls import (
    ToolCallParser,
    check_tools,
    forced_call_grammar,
    tool_call_format,
)
from nanovllm.router.calls.validation import prompt_token_ids
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.chat_templates import QWEN3 as QWEN3_TEMPLATE
from tests.chat_templates import QWEN3_5 as QWEN3_5_TEMPLATE
from tests.helpers import cuts
from tests.model_factory import build_model, build_tokenizer
from tests.services import collect, library_errors, start_router, start_worker, wait_serving

HERMES = tool_call_format("hermes", [])
QWEN3 = reasoning_format("qwen3", [])
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,  # bounded calls: a random model would make up keys until max_tokens
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 16},
        "limit": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "search": SEARCH}
TWO_CALLS = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>\n'
)


def tools_chat(**chat) -> generate_pb2.Chat:
    tools = [
        generate_pb2.Tool(name=n, description=f"the {n} tool", parameters=json.dumps(s))
        for n, s in SCHEMAS.items()
    ]
    messages = chat.pop("messages", [generate_pb2.ChatMessage(role="user", content="Weather in Paris?")])
    return generate_pb2.Chat(messages=messages, tools=tools, **chat)


def parse_all(pieces: list[str]) -> tuple[str, list[generate_pb2.ToolCall]]:
    parser = ToolCallParser(HERMES, SCHEMAS)
    text, calls = "", []
    for piece in pieces:
        more_text, more_calls = parser.push(piece)
        text, calls = text + more_text, calls + more_calls
    return text + parser.finish(), calls


# --- the parser -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2])
def test_several_calls_parse_the_same_wherever_the_stream_is_cut(count) -> None:
    for pieces in cuts(TWO_CALLS, count):
        text, calls = parse_all(pieces)
        assert text == "Let me look.\n", pieces
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "c"}),
            ("get_time", {"zone": 1}),
        ], pieces
        assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
        assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "get_weather", "arguments": {"city": "Par',  # not JSON
        '["get_weather"]',  # not an object
        '{"name": "launch_rockets", "arguments": {}}',  # no such tool
        '{"name": "get_time", "arguments": "zone 1"}',  # arguments not an object
    ],
)
def test_a_call_that_does_not_parse_is_returned_as_text_as_written(body) -> None:
    """The stated rule: markup that is not a call of one of the tools reaches the client as text."""
    written = f"<tool_call>\n{body}\n</tool_call>"
    for pieces in cuts(f"ok {written} then", 1):
        assert parse_all(pieces) == (f"ok {written} then", []), pieces


def test_text_without_calls_is_unchanged_and_a_cut_call_is_released_as_text() -> None:
    for text in ["plain answer", "a < b and <tool", "<tool_cal", "x\n\n"]:
        for pieces in cuts(text, 1):
            assert parse_all(pieces) == (text, []), pieces
    assert parse_all(['<tool_call>\n{"name": "get_time", "argu']) == (
        '<tool_call>\n{"name": "get_time", "argu',
        [],
    )


def test_reasoning_then_a_call_finishes_with_tool_calls() -> None:
    backend = build_tokenizer().backend_tokenizer
    text = '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>'
    ids = backend.encode(text).ids
    completion = CompletionText(TextStream(backend), ReasoningSplit(QWEN3), ToolCallParser(HERMES, SCHEMAS))
    responses = [
        build_response(worker_pb2.RequestUpdate(new_token_ids=[t]), completion, "r", False, i + 1, 0)
        for i, t in enumerate(ids[:-1])
    ]
    responses.append(
        build_response(
            worker_pb2.RequestUpdate(new_token_ids=ids[-1:], finish_reason=worker_pb2.FINISH_REASON_STOP),
            completion,
            "r",
            False,
            len(ids),
            0,
        )
    )
    responses = [r for r in responses if r is not None]
    assert "".join(r.reasoning_text for r in responses) == "The user wants weather."
    assert "".join(r.text for r in responses) == ""
    (call,) = [c for r in responses for c in r.tool_calls]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo", "unit": "f"})
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_TOOL_CALLS


# --- the request's checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"parameters": '{"type": "nonsense"}'},
            r"chat.tools\[1\].parameters is not a valid JSON Schema: 'nonsense' is not valid",
        ),
        ({"parameters": "{city: str}"}, r"chat.tools\[1\].parameters is not JSON"),
        ({"parameters": "[1]"}, r"chat.tools\[1\].parameters must be a JSON object, got list"),
        ({"name": "get weather"}, r"chat.tools\[1\].name 'get weather' must be 1-64 characters"),
        ({"name": "get_weather"}, r"chat.tools\[1\].name 'get_weather' is given twice"),
    ],
)
def test_a_bad_tool_is_named(change, message) -> None:
    chat = tools_chat()
    for key, value in change.items():
        setattr(chat.tools[1], key, value)
    with pytest.raises(ValueError, match=message):
        check_tools(chat)


def test_tool_choice_and_tool_messages_are_checked() -> None:
    absent = tools_chat(tool_choice=generate_pb2.ToolChoice(function="launch_rockets"))
    with pytest.raises(
        ValueError,
        match=r"chat.tool_choice.function 'launch_rockets' names no tool in chat.tools \(get_weather, get_time, search\)",
    ):
        check_tools(absent)
    required = generate_pb2.Chat(
        messages=[generate_pb2.ChatMessage(role="user", content="x")],
        tool_choice=generate_pb2.ToolChoice(mode=generate_pb2.ToolChoice.MODE_REQUIRED),
    )
    with pytest.raises(ValueError, match="chat.tool_choice asks for a tool call, but chat.tools is empty"):
        check_tools(required)
    orphan = tools_chat(
        messages=[
            generate_pb2.ChatMessage(role="user", content="x"),
            generate_pb2.ChatMessage(
                role="assistant",
                tool_calls=[generate_pb2.ToolCall(id="call_a", name="get_time", arguments='{"zone": 0}')],
            ),
            generate_pb2.ChatMessage(role="tool", content="12:00", tool_call_id="call_b"),
        ]
    )
    with pytest.raises(
        ValueError,
        match=r"chat.messages\[2\].tool_call_id 'call_b' answers no call of an earlier assistant message",
    ):
        check_tools(orphan)
    assert (
        check_tools(tools_chat(tool_choice=generate_pb2.ToolChoice(mode=generate_pb2.ToolChoice.MODE_NONE)))
        is None
    )


@pytest.mark.parametrize("forced", ["*", "get_time"])
@pytest.mark.parametrize("reasoning", ["none", "optional", "open"])
def test_forced_call_grammars_compile(forced, reasoning) -> None:
    chat = tools_chat(
        tool_choice=generate_pb2.ToolChoice(mode=generate_pb2.ToolChoice.MODE_REQUIRED)
        if forced == "*"
        else generate_pb2.ToolChoice(function=forced)
    )
    grammar = forced_call_grammar(
        check_tools(chat), HERMES, None if reasoning == "none" else QWEN3, reasoning == "open"
    )
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""


def _accepts(grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized by the test tokenizer) whole and may end there."""
    import llguidance.hf

    hf = build_tokenizer()
    matcher = LLMatcher(llguidance.hf.from_tokenizer(hf), LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = hf.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_the_forced_call_starts_after_the_reasoning() -> None:
    """Thinking on: the reasoning (optional, or already open from the prompt) comes first, then the call;
    after an empty block (thinking off) the call comes at once."""
    tools = check_tools(tools_chat(tool_choice=generate_pb2.ToolChoice(function="get_time")))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    thought = "<think>\nThe user wants the time.\n</think>\n\n"
    optional = forced_call_grammar(tools, HERMES, QWEN3, reasoning_open=False)
    assert _accepts(optional, thought + call) and _accepts(optional, call)
    assert not _accepts(optional, "Sure! " + call)
    opened = forced_call_grammar(tools, HERMES, QWEN3, reasoning_open=True)
    assert _accepts(opened, "The user wants the time.\n</think>\n\n" + call)
    assert not _accepts(opened, call)  # the prompt opened the reasoning: it must be closed first
    at_once = forced_call_grammar(tools, HERMES, None, reasoning_open=False)
    assert _accepts(at_once, call) and not _accepts(at_once, thought + call)
    wrong = '<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 2}}\n</tool_call>'
    assert not _accepts(optional, wrong)  # only the named function


# --- Qwen3.5's format (qwen3_coder) ---------------------------------------------------------------------

QWEN3_CODER = tool_call_format("qwen3_coder", [])
CONFIGURE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "size": {"type": "integer"},
        "ratio": {"type": "number"},
        "on": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object"},
        "note": {},
    },
    "required": ["name", "size"],
}
CODER_SCHEMAS = {**SCHEMAS, "configure": CONFIGURE}


def _xml_call(function: str, **values: str) -> str:
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={function}>\n{parameters}</function>\n</tool_call>"


def split_and_parse(pieces: list[str], in_reasoning: bool = False) -> tuple[str, str, list[tuple[str, dict]]]:
    """(reasoning, answer text, calls) of a stream in pieces, through the reasoning split and the parser."""
    split, parser = ReasoningSplit(QWEN3, in_reasoning), ToolCallParser(QWEN3_CODER, CODER_SCHEMAS)
    reasoning, text, calls = "", "", []
    for piece in [*pieces, None]:
        thought, answer = split.push(piece) if piece is not None else split.finish()
        more_text, more_calls = parser.push(answer)
        reasoning, text, calls = reasoning + thought, text + more_text, calls + more_calls
    text += parser.finish()
    return reasoning, text, [(c.name, json.loads(c.arguments)) for c in calls]


def test_qwen3_5_calls_parse_the_same_wherever_the_stream_is_cut() -> None:
    """Reasoning, then two calls (one with nested JSON values), split at every character boundary: the same
    reasoning, text and calls as unsplit, each value of its schema's type."""
    weather = _xml_call("get_weather", city="Paris", unit="c")
    configure = _xml_call(
        "configure", name="a <b> & c", size="3", ratio="0.5", on="true", tags='["x", "y"]',
        options='{"depth": {"max": 2}, "list": [1, 2]}', note="free text",
    )  # fmt: skip
    answer = f"<think>\nThe user wants two things.\n</think>\n\nLet me look.\n{weather}\n{configure}\n"
    expected = (
        "The user wants two things.",
        "Let me look.\n",
        [
            ("get_weather", {"city": "Paris", "unit": "c"}),
            ("configure", {"name": "a <b> & c", "size": 3, "ratio": 0.5, "on": True, "tags": ["x", "y"],
                           "options": {"depth": {"max": 2}, "list": [1, 2]}, "note": "free text"}),
        ],
    )  # fmt: skip
    assert split_and_parse([answer]) == expected
    for pieces in cuts(answer, 1):
        assert split_and_parse(pieces) == expected, pieces
    # a call first, then what looks like reasoning: answer text, the whitespace before it kept wherever
    # the stream is cut (even inside the "<" that might have begun another call)
    first = _xml_call("get_time", zone="2") + "\n<think>\nlater\n</think>\n\ndone"
    for pieces in cuts(first, 1):
        assert split_and_parse(pieces) == (
            "",
            "\n<think>\nlater\n</think>\n\ndone",
            [("get_time", {"zone": 2})],
        )
    # the prompt opened the reasoning; the call comes between two texts, whitespace kept before text
    between = f"thinking\n</think>\n\nfirst {_xml_call('get_time', zone='-3')} then"
    for pieces in cuts(between, 1):
        assert split_and_parse(pieces, in_reasoning=True) == (
            "thinking",
            "first  then",
            [("get_time", {"zone": -3})],
        )


@pytest.mark.parametrize(
    "body",
    [
        "<function=launch_rockets>\n</function>",  # no such tool
        "<function=get_time>\nzone=3\n</function>",  # text that is not a parameter
        "<function=get_time>\n<parameter=zone>\n3\n</parameter>\n",  # no </function>
        '{"name": "get_time", "arguments": {"zone": 1}}',  # Hermes' JSON: not this format
    ],
)
def test_a_qwen3_5_call_that_does_not_parse_is_returned_as_text_as_written(body) -> None:
    written = f"<tool_call>\n{body}\n</tool_call>"
    for pieces in cuts(f"ok {written} then", 1):
        assert split_and_parse(pieces) == ("", f"ok {written} then", []), pieces


def test_a_qwen3_5_value_that_does_not_read_as_its_type_stays_text() -> None:
    """The stated choice: a value that is not its declared type is kept as the text written; a truncated
    call comes back as text."""
    call = _xml_call("configure", name="n", size="three", on="yes", tags="x, y")
    assert split_and_parse([call])[2] == [
        ("configure", {"name": "n", "size": "three", "on": "yes", "tags": "x, y"})
    ]
    cut = call[: call.index("<parameter=on>")]
    assert split_and_parse([cut]) == ("", cut, [])


@pytest.mark.parametrize("reasoning", ["none", "optional", "open"])
def test_forced_qwen3_5_calls_are_written_in_its_own_format(reasoning) -> None:
    """tool_choice naming a function, or required, in Qwen3.5's format: the grammar takes the model's own
    markup with values of the schema's types, and refuses Hermes' JSON, another tool, or a value of the
    wrong type."""
    tools = check_tools(tools_chat(tool_choice=generate_pb2.ToolChoice(function="get_time")))
    grammar = forced_call_grammar(
        tools, QWEN3_CODER, None if reasoning == "none" else QWEN3, reasoning_open=reasoning == "open"
    )
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""
    head = {"none": "", "optional": "<think>\nThe time.\n</think>\n\n", "open": "The time.\n</think>\n\n"}[
        reasoning
    ]
    assert _accepts(grammar, head + _xml_call("get_time", zone="3"))
    assert not _accepts(grammar, head + _xml_call("get_time", zone="three"))
    assert not _accepts(
        grammar, head + '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    )
    assert not _accepts(grammar, head + _xml_call("search", query="x", limit="2"))
    required = forced_call_grammar(
        check_tools(tools_chat(tool_choice=generate_pb2.ToolChoice(mode=generate_pb2.ToolChoice.MODE_REQUIRED))),
        QWEN3_CODER, None, reasoning_open=False,
    )  # fmt: skip
    two = (
        _xml_call("search", query="rain", limit="2") + "\n" + _xml_call("get_weather", city="Oslo", unit="f")
    )
    assert _accepts(required, two)
    assert split_and_parse([two])[2] == [
        ("search", {"query": "rain", "limit": 2}),
        ("get_weather", {"city": "Oslo", "unit": "f"}),
    ]


def test_forced_qwen3_5_strings_keep_their_schemas_enum_and_length() -> None:
    """A string value is raw text in this format, not JSON: its enum and maxLength are the grammar's own
    rules, so a forced call's strings validate too (get_weather: city of at most 12, unit c or f)."""
    tools = check_tools(tools_chat(tool_choice=generate_pb2.ToolChoice(function="get_weather")))
    grammar = forced_call_grammar(tools, QWEN3_CODER, None, reasoning_open=False)
    assert _accepts(grammar, _xml_call("get_weather", city="Paris", unit="c"))
    assert _accepts(grammar, _xml_call("get_weather", city="Rio de Janei", unit="f"))
    assert not _accepts(grammar, _xml_call("get_weather", city="Rio de Janeiro", unit="f"))
    assert not _accepts(grammar, _xml_call("get_weather", city="Paris", unit="k"))


def test_qwen3_5_architectures_choose_its_format() -> None:
    for name in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        assert tool_call_format("auto", [name]) == QWEN3_CODER
    assert tool_call_format("auto", ["Qwen3ForCausalLM"]) == HERMES


def test_auto_reads_the_format_from_the_chat_template_before_the_architecture() -> None:
    """Qwen3-Coder declares Qwen3-MoE's architecture and writes Qwen3.5's format: its template says so.
    A template that shows no call format leaves it to the architecture."""
    assert tool_call_format("auto", ["Qwen3MoeForCausalLM"], QWEN3_5_TEMPLATE) == QWEN3_CODER
    assert tool_call_format("auto", ["LlamaForCausalLM"], QWEN3_TEMPLATE) == HERMES
    assert tool_call_format("auto", ["Qwen3_5ForCausalLM"], "{{ messages }}") == QWEN3_CODER
    assert tool_call_format("auto", ["LlamaForCausalLM"], "{{ messages }}") is None
    assert tool_call_format("hermes", ["Qwen3_5ForCausalLM"], QWEN3_5_TEMPLATE) == HERMES


# --- Qwen3's template -----------------------------------------------------------------------------------


def test_qwen3_template_shows_the_tools_and_renders_calls_and_results(qwen3_tokenizer) -> None:
    call = generate_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris", "unit": "c"}')
    chat = tools_chat(
        messages=[
            generate_pb2.ChatMessage(role="user", content="Weather in Paris?"),
            generate_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            generate_pb2.ChatMessage(role="tool", content="18 C, sunny", tool_call_id="call_1"),
        ]
    )
    tools = check_tools(chat)
    ids = prompt_token_ids(generate_pb2.GenerateRequest(chat=chat), qwen3_tokenizer, "qwen3-test", tools)
    prompt = qwen3_tokenizer.decode_tail(ids, len(ids))
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather", "description": "the get_weather tool"' in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        in prompt
    )
    assert prompt.endswith(
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


# --- end to end: router and worker ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_service(kernels, tmp_path_factory):
    """A random Qwen3 model (with Qwen3's template) and a router, for prompts that hold tools: the template
    writes them into the system prompt, about 1,100 tokens with the test tokenizer's small vocabulary, so
    the model's context is 4096 here (1024 in the shared models, 512 in the shared service)."""
    logs = tmp_path_factory.mktemp("tools-logs")
    model = build_model("qwen3", tmp_path_factory.mktemp("tools-model") / "qwen3", seed=1, max_position=4096)
    flags = ("--max-model-len", "2048", "--kv-cache-memory", "128MiB")
    worker = start_worker(model, *flags, log_path=logs / "worker.log")
    router = start_router([worker.address], log_path=logs / "router.log")
    try:
        wait_serving(worker.address)
        wait_serving(router.address)
        yield router
    finally:
        router.stop()
        worker.stop()
    assert library_errors(logs / "router.log") == []
    assert library_errors(logs / "worker.log") == []


async def _calls(address: str, requests: list[generate_pb2.GenerateRequest]) -> list[list]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def one(request):
            return [r async for r in stub.Generate(request, timeout=300)]

        return await asyncio.gather(*(one(r) for r in requests))


def _forced_request(choice: generate_pb2.ToolChoice, seed: int) -> generate_pb2.GenerateRequest:
    sampling = generate_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=400)
    return generate_pb2.GenerateRequest(chat=tools_chat(tool_choice=choice), sampling=sampling)


def _assert_valid_calls(responses, names) -> list[generate_pb2.ToolCall]:
    calls = [c for r in responses for c in r.tool_calls]
    assert calls, "".join(r.text for r in responses)
    for call in calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_required_returns_calls_that_validate_50_of_50_seeds(tools_service) -> None:
    """The random Qwen3 model behind the router, its tools rendered by Qwen3's own chat template:
    tool_choice required with 3 tools, 50 seeds. Every stream
    holds at least one call, every call validates against its tool's schema, and a stream that ends
    on its own ends with TOOL_CALLS (one cut by max_tokens mid-call returns that part as text)."""
    required = generate_pb2.ToolChoice(mode=generate_pb2.ToolChoice.MODE_REQUIRED)
    results = asyncio.run(_calls(tools_service.address, [_forced_request(required, s) for s in range(50)]))
    for responses in results:
        _assert_valid_calls(responses, SCHEMAS)
        assert responses[-1].finish_reason in (
            generate_pb2.FINISH_REASON_TOOL_CALLS,
            generate_pb2.FINISH_REASON_LENGTH,
        )
    assert sum(r[-1].finish_reason == generate_pb2.FINISH_REASON_TOOL_CALLS for r in results) > 0


def test_a_named_function_is_always_that_function(tools_service) -> None:
    named = generate_pb2.ToolChoice(function="search")
    results = asyncio.run(_calls(tools_service.address, [_forced_request(named, s) for s in range(10)]))
    for responses in results:
        assert {c.name for c in _assert_valid_calls(responses, {"search"})} == {"search"}


def _invalid(address: str, chat: generate_pb2.Chat, **sampling) -> str:
    """The details of the INVALID_ARGUMENT a Generate call with this chat ends in."""
    request = generate_pb2.GenerateRequest(
        chat=chat, sampling=generate_pb2.SamplingParams(max_tokens=4, **sampling)
    )
    _, error = collect(address, request)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    return error.details()


def test_bad_tools_are_invalid_argument_through_the_router(tools_service) -> None:
    address = tools_service.address
    chat = tools_chat()
    chat.tools[2].parameters = '{"type": "object", "properties": {"q": {"type": 7}}}'
    assert "chat.tools[2].parameters is not a valid JSON Schema" in _invalid(address, chat)
    absent = tools_chat(tool_choice=generate_pb2.ToolChoice(function="launch_rockets"))
    assert "chat.tool_choice.function 'launch_rockets' names no tool" in _invalid(address, absent)
    orphan = tools_chat(
        messages=[
            generate_pb2.ChatMessage(role="user", content="x"),
            generate_pb2.ChatMessage(role="tool", content="12:00", tool_call_id="call_b"),
        ]
    )
    assert "chat.messages[1].tool_call_id 'call_b' answers no call" in _invalid(address, orphan)
    forced = tools_chat(tool_choice=generate_pb2.ToolChoice(function="get_time"))
    assert "sampling.regex and a forced chat.tool_choice: one constraint at most" in _invalid(
        address, forced, regex="a+"
    )


def test_calls_are_exact_in_every_cut_of_a_long_stream() -> None:
    """Many calls back to back, cut at every pair of places: the same calls (ids aside) and no text."""
    stream = "".join(
        f'<tool_call>\n{{"name": "get_time", "arguments": {{"zone": {z}}}}}\n</tool_call>\n' for z in range(3)
    )
    for points in itertools.combinations(range(0, len(stream), 7), 2):
        pieces = [stream[: points[0]], stream[points[0] : points[1]], stream[points[1] :]]
        text, calls = parse_all(pieces)
        assert text == "" and [json.loads(c.arguments)["zone"] for c in calls] == [0, 1, 2], pieces
