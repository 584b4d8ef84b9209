"""Tool calls: a chat's tools checked and shaped for the model's chat template, the calls parsed out of
the answer as it streams, and tool_choice `required` or a named function enforced as a structured-output
grammar.

Two formats, each between `<tool_call>` and `</tool_call>` lines: Hermes' as Qwen2.5 and Qwen3 write it,
each call a JSON object `{"name": ..., "arguments": {...}}`; and Qwen3.5's (router/calls/qwen3_coder.py),
`<function=NAME>` around `<parameter=ARG>` values. Parsing runs on the answer text after the
reasoning split, incrementally: text outside calls streams as it comes (a tail that may start a call is
held back); a call is sent once its end marker arrives. Rules:
- a call whose body is not a call of one of the request's tools (Hermes: a JSON object with such a `name`
  and an object of `arguments`, absent: {}) is returned as text, exactly as the model wrote it, markers
  included;
- whitespace between calls and after the last one is dropped;
- a stream that ends inside a call returns what it wrote of it as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanovllm.router.calls import qwen3_coder
from nanovllm.router.calls.markers import Markers, choose_markers, marker_prefix_length
from nanovllm.v1 import generate_pb2

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_Mode = generate_pb2.ToolChoice.Mode


_FORMATS = {
    "hermes": Markers("hermes", "<tool_call>", "</tool_call>"),
    "qwen3_coder": Markers("qwen3_coder", "<tool_call>", "</tool_call>"),
}
# The format each model family's chat template asks for, by Hugging Face architecture (Qwen3.6 and 3.8
# declare Qwen3.5's).
_FAMILIES = {
    **dict.fromkeys(
        ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), "hermes"
    ),
    **dict.fromkeys(
        (
            "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
        ),
        "qwen3_coder",
    ),
}  # fmt: skip


def tool_call_format(setting: str, architectures: Sequence[str], chat_template: str = "") -> Markers | None:
    """The format calls are parsed in (RouterConfig.tool_call_parser), or named ("none": calls stay in the
    text). Under "auto": the one the chat template writes calls in, where its text shows it (`<function=`
    for Qwen3.5's, else `<tool_call>` for Hermes'), since an architecture can be ambiguous (Qwen3-Coder
    declares Qwen3-MoE's and writes Qwen3.5's format); else the model family's, by architecture."""
    if setting == "auto" and "<tool_call>" in chat_template:
        return _FORMATS["qwen3_coder" if "<function=" in chat_template else "hermes"]
    return choose_markers(setting, architectures, _FORMATS, _FAMILIES)


# --- the request ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTools:
    """A chat's tools as the template and the parser take them, and what tool_choice forces."""

    schemas: dict[str, dict[str, Any]]  # name -> the arguments' JSON Schema
    template_tools: list[dict[str, Any]]  # the chat template's `tools`
    forced: str | None  # None (auto), "*" (required: any tool) or a tool's name


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        # ValueError, as every bad field of a request: the router answers it with INVALID_ARGUMENT.
        raise ValueError(f"{field} must be a JSON object, got {type(value).__name__}")  # noqa: TRY004
    return value


def check_tools(chat: generate_pb2.Chat) -> ChatTools | None:
    """The chat's tools, or None when it offers none or tool_choice is MODE_NONE. ValueError names the
    field: a bad tool name or schema, a tool_choice naming no tool, a tool message answering no call."""
    _check_tool_messages(chat)
    choice = chat.tool_choice.WhichOneof("choice")
    mode = chat.tool_choice.mode if choice == "mode" else _Mode.MODE_AUTO
    if not chat.tools:
        if choice == "function" or mode == _Mode.MODE_REQUIRED:
            raise ValueError("chat.tool_choice asks for a tool call, but chat.tools is empty")
        return None
    import jsonschema  # here, not at the top: it costs every router's start 0.13 s, and few calls have tools

    schemas: dict[str, dict[str, Any]] = {}
    template_tools = []
    for i, tool in enumerate(chat.tools):
        if not _NAME.fullmatch(tool.name):
            raise ValueError(f"chat.tools[{i}].name {tool.name!r} must be 1-64 characters of [a-zA-Z0-9_-]")
        if tool.name in schemas:
            raise ValueError(f"chat.tools[{i}].name {tool.name!r} is given twice")
        field = f"chat.tools[{i}].parameters"
        schema = _json_object(tool.parameters, field) if tool.parameters else {"type": "object"}
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"{field} is not a valid JSON Schema: {exc.message}") from None
        schemas[tool.name] = schema
        function = {"name": tool.name, "description": tool.description, "parameters": schema}
        template_tools.append({"type": "function", "function": function})
    if mode == _Mode.MODE_NONE:
        return None
    forced = "*" if mode == _Mode.MODE_REQUIRED else None
    if choice == "function":
        if chat.tool_choice.function not in schemas:
            raise ValueError(
                f"chat.tool_choice.function {chat.tool_choice.function!r} names no tool in chat.tools "
                f"({', '.join(schemas)})"
            )
        forced = chat.tool_choice.function
    return ChatTools(schemas, template_tools, forced)


def _check_tool_messages(chat: generate_pb2.Chat) -> None:
    called: set[str] = set()
    for i, message in enumerate(chat.messages):
        for j, call in enumerate(message.tool_calls):
            _json_object(call.arguments or "{}", f"chat.messages[{i}].tool_calls[{j}].arguments")
            called.add(call.id)
        if message.role == "tool" and message.tool_call_id not in called:
            raise ValueError(
                f"chat.messages[{i}].tool_call_id {message.tool_call_id!r} answers no call of an earlier "
                f"assistant message"
            )


def template_message(message: generate_pb2.ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (the OpenAI shape transformers documents)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if any(part.WhichOneof("part") == "image" for part in message.parts):
        # text and images in order: the template writes each image's placeholder
        rendered["content"] = [
            {"type": "text", "text": part.text} if part.WhichOneof("part") == "text" else {"type": "image"}
            for part in message.parts
        ]
    elif message.parts:  # text parts alone: one text, as a template without parts support reads it
        rendered["content"] = "".join(part.text for part in message.parts)
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments or "{}")},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning_content:
        rendered["reasoning_content"] = message.reasoning_content
    return rendered


def forced_call_grammar(
    tools: ChatTools, fmt: Markers, reasoning: Markers | None, reasoning_open: bool
) -> str:
    """A Lark grammar (llguidance's dialect) for an answer of one or more calls of the forced tools, each
    call's arguments under its tool's schema. With a reasoning format the reasoning comes first: optional,
    or already open when the prompt opened it; it may not contain "<" (the grammar's way to find its end)."""
    assert tools.forced is not None  # only a forced tool_choice has a grammar
    names = list(tools.schemas) if tools.forced == "*" else [tools.forced]
    calls_rule = 'calls: call ("\\n" call)*\n'
    if fmt.name == "qwen3_coder":
        call_rule = qwen3_coder.call_rules(names, tools.schemas)
    else:
        call_rule = _hermes_call_rule(names, tools.schemas, fmt)
    if reasoning is None:
        return "start: calls\n" + calls_rule + call_rule
    end = f"{json.dumps(reasoning.end)} /\\n*/"
    if reasoning_open:
        start = f"start: /[^<]*/ {end} calls\n"
    else:
        start = f"start: think? calls\nthink: {json.dumps(reasoning.start)} /[^<]*/ {end}\n"
    return start + calls_rule + call_rule


def _hermes_call_rule(names: list[str], schemas: dict[str, dict[str, Any]], fmt: Markers) -> str:
    calls = {
        # The JSON as Hermes writes it, one line: whitespace left free lets a model pad a call forever.
        "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schemas[name]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in names
        ],
    }
    return (
        f"call: {json.dumps(fmt.start + chr(10))} %json {json.dumps(calls)} {json.dumps(chr(10) + fmt.end)}\n"
    )


# --- the answer -----------------------------------------------------------------------------------------


class ToolCallParser:
    def __init__(self, fmt: Markers, schemas: dict[str, dict[str, Any]]) -> None:
        """`schemas`: the request's tools, name -> the arguments' JSON Schema."""
        self._fmt = fmt
        self._schemas = schemas
        self._held = ""
        self._in_call = False
        self._after_call = False  # whitespace here is dropped
        self.num_calls = 0

    def push(self, text: str) -> tuple[str, list[generate_pb2.ToolCall]]:
        """Feed answer text; returns the text now safe to send and the calls completed."""
        self._held += text
        out = ""
        calls: list[generate_pb2.ToolCall] = []
        while True:
            if self._in_call:
                end = self._held.find(self._fmt.end)
                if end < 0:
                    return out, calls
                body, self._held = self._held[:end], self._held[end + len(self._fmt.end) :]
                self._in_call = False
                call = self._parse(body)
                if call is None:
                    out += self._fmt.start + body + self._fmt.end
                else:
                    calls.append(call)
                    self._after_call = True
                continue
            if self._after_call:
                stripped = self._held.lstrip()
                if len(stripped) < len(self._fmt.start) and self._fmt.start.startswith(stripped):
                    # held, whitespace too, until what follows says: a call, text or the end
                    return out, calls
                if stripped.startswith(self._fmt.start):
                    self._held = stripped  # the next call: whitespace between calls goes
                else:
                    self._after_call = False
            start = self._held.find(self._fmt.start)
            if start >= 0:
                out += self._held[:start]
                self._held = self._held[start + len(self._fmt.start) :]
                self._in_call = True
                continue
            keep = marker_prefix_length(self._held, self._fmt.start)
            out += self._held[: len(self._held) - keep]
            self._held = self._held[len(self._held) - keep :]
            return out, calls

    def finish(self) -> str:
        """The answer ended: what was held back, as text (a call cut off is returned as written)."""
        held, self._held = self._held, ""
        if self._in_call:
            return self._fmt.start + held
        return "" if self._after_call and not held.strip() else held

    def _parse(self, body: str) -> generate_pb2.ToolCall | None:
        call = (
            qwen3_coder.parse_call(body, self._schemas)
            if self._fmt.name == "qwen3_coder"
            else self._hermes(body)
        )
        if call is None:
            return None
        self.num_calls += 1
        return generate_pb2.ToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            name=call[0],
            arguments=json.dumps(call[1], ensure_ascii=False),
        )

    def _hermes(self, body: str) -> tuple[str, dict[str, Any]] | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self._schemas:
            return None
        arguments = value.get("arguments", {})
        return (value["name"], arguments) if isinstance(arguments, dict) else None
