"""OpenAI's Responses API (`POST /v1/responses`): a body becomes the chat completion it asks for
(router/faces/openai_protocol.py parses and validates that, once for both), continuing a stored
conversation (`previous_response_id`: router/faces/response_store.py) when it names one; the chat call's
Generate responses become a Response object, or its stream of semantic events (`response.created` ...
`response.completed`, each with its `sequence_number`).

A background response runs to its end without its client (router/faces/http_api.py keeps its events in
the store, where any process replays and follows them).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from nanovllm.router.faces.openai_protocol import (
    Choice,
    OpenAIRequest,
    ProtocolError,
    check_unicode,
    parse_request,
)
from nanovllm.v1 import generate_pb2

# Fields of a Responses body: those served, those accepted without effect, and those refused with the
# values that ask for nothing.
SERVED = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "text", "reasoning", "stream", "metadata", "user", "store", "previous_response_id", "background",
}  # fmt: skip
WITHOUT_EFFECT = {"safety_identifier", "prompt_cache_key", "service_tier", "truncation", "include"}
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "parallel_tool_calls": ((None, True), "several tool calls in one answer cannot be turned off"),
    "conversation": ((None,), "conversations are not served"),
    "prompt": ((None,), "prompt templates are not served"),
}
# A response's statuses once it ended; the stream's last events.
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


@dataclass
class ResponsesRequest:
    """One /v1/responses call: the chat request it runs, and what its Response object echoes back."""

    chat: OpenAIRequest
    echoed: dict[str, Any]
    items: list[dict[str, Any]]  # this request's input, as items with ids
    history: list[dict[str, Any]]  # the conversation it continues, as input items (outputs included)
    earlier_inputs: list[dict[str, Any]]  # the input items of the conversation's earlier turns
    store: bool
    background: bool
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    owner: str = ""  # the caller's token name, set by the HTTP face

    def record(self, response: dict[str, Any]) -> dict[str, Any]:
        """What the store keeps of this finished response (router/faces/response_store.py)."""
        outputs = [_as_input(item) for item in response["output"]]
        return {
            "response": response,
            "input_items": [*self.earlier_inputs, *self.items],
            "conversation": [*self.history, *self.items, *(o for o in outputs if o is not None)],
        }


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise ProtocolError(f"{where}.content", f"{where}.content must be a string or input_text parts")


def _as_input(item: dict[str, Any]) -> dict[str, Any] | None:
    """An output item as the input item a later turn sends back (reasoning is not: Qwen3's template drops
    earlier turns' reasoning)."""
    if item["type"] == "message":
        text = "".join(part["text"] for part in item["content"])
        return {
            "type": "message",
            "id": item["id"],
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
    if item["type"] == "function_call":
        return {k: item[k] for k in ("type", "id", "call_id", "name", "arguments")}
    return None


def _items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`input` as a list of items, each with an id (as input_items lists them)."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    if not isinstance(items, list) or not items:
        raise ProtocolError("input", "input must be a string or a non-empty list of items")
    prefixes = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}
    with_ids = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ProtocolError(f"input[{i}]", f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind not in (*prefixes, "reasoning"):
            raise ProtocolError(
                f"input[{i}].type",
                f"input[{i}].type {kind!r} is not message, function_call or function_call_output",
            )
        with_ids.append(
            item if "id" in item else {"id": prefixes.get(kind, "rs_") + uuid.uuid4().hex, **item}
        )
    return with_ids


def _messages(instructions: Any, items: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """`instructions` and the conversation's items as chat messages; consecutive function calls become one
    assistant turn. Items before `first` are earlier turns' (errors name this request's `input[i]`)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ProtocolError("instructions", "instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input[{i - first}]" if i >= first else f"previous_response_id's input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role", ""))
            if role is None:
                raise ProtocolError(
                    f"{where}.role", f"{where}.role must be user, assistant, system or developer"
                )
            messages.append({"role": role, "content": _item_text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ProtocolError(
                    where, f"{where} (function_call) needs string call_id, name and arguments"
                )
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if (
                messages
                and messages[-1]["role"] == "assistant"
                and messages[-1].get("tool_calls") is not None
            ):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise ProtocolError(where, f"{where} (function_call_output) needs string call_id and output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: Qwen3's template drops it from the history anyway
        else:
            raise ProtocolError(
                f"{where}.type",
                f"{where}.type {kind!r} is not message, function_call or function_call_output",
            )
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ProtocolError("tools", "tools must be a list")
    chat_tools = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("name"), str)
        ):
            raise ProtocolError(
                f"tools[{i}]", f"tools[{i}] must be a function tool: {{'type': 'function', 'name': ...}}"
            )
        function = {"name": tool["name"], "description": tool.get("description") or ""}
        if tool.get("parameters") is not None:
            function["parameters"] = tool["parameters"]
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ProtocolError(
        "tool_choice", "tool_choice must be auto, none, required or {'type': 'function', 'name': ...}"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ProtocolError("text.format.schema", "text.format.schema must be an object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]}}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise ProtocolError(
        "text.format.type", f"text.format.type {kind!r} is not text, json_object or json_schema"
    )


def parse_responses_request(
    body: Any, previous: dict[str, Any] | None = None, can_store: bool = False
) -> ResponsesRequest:
    """The chat completion a /v1/responses body asks for, continuing `previous` (the stored record of its
    previous_response_id), and the fields its answer echoes. `can_store`: whether a store is configured
    (without one, `store` true is refused; absent, it means true only with one)."""
    if not isinstance(body, dict):
        raise ProtocolError("body", "the request body must be a JSON object")
    check_unicode(body)  # every field, names included: those echoed and stored too
    for name, value in body.items():
        if name in UNSERVED:
            allowed, why = UNSERVED[name]
            if value not in allowed:
                raise ProtocolError(name, f"{name}={json.dumps(value)[:80]}: {why}")
        elif name not in SERVED | WITHOUT_EFFECT:
            raise ProtocolError(name, f"unknown field {name!r} for /v1/responses")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(v, str) for v in metadata.values())
        and len(metadata) <= 16
    ):
        raise ProtocolError("metadata", "metadata must be an object of at most 16 string values")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ProtocolError("user", "user must be a string")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise ProtocolError("store", "store must be a boolean")
    if store and not can_store:
        raise ProtocolError("store", "store=true: this router keeps no responses (--response-store off)")
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise ProtocolError("background", "background must be a boolean")
    if background and (store is False or not can_store):
        raise ProtocolError(
            "background", "background=true needs a stored response (store true, a --response-store)"
        )
    items = _items(body)
    history = previous["conversation"] if previous else []
    messages = _messages(body.get("instructions"), [*history, *items], len(history))
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream", False)}
    for ours, theirs in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p")):
        if theirs in body:
            chat[ours] = body[theirs]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:  # Qwen3's thinking switch
        chat["chat_template_kwargs"] = {"enable_thinking": reasoning["effort"] not in ("none", "minimal")}
    try:
        parsed = parse_request(chat, chat=True)
    except ProtocolError as exc:  # named as the chat field: say which Responses field it came from
        raise ProtocolError(exc.param, f"{exc} (from this /v1/responses body)") from None
    parsed.generate[0].return_token_ids = True  # counted for usage's reasoning_tokens (ResponseBuilder.add)
    echoed = {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": True,
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "user": body.get("user"),
        "store": can_store and store is not False,
        "previous_response_id": body.get("previous_response_id"),
        "background": bool(background),
    }
    earlier = previous["input_items"] if previous else []
    return ResponsesRequest(parsed, echoed, items, history, earlier, echoed["store"], bool(background))


def _usage(choice: Choice, reasoning_tokens: int) -> dict[str, Any]:
    usage = choice.usage or generate_pb2.Usage()
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseBuilder:
    """A Response object and its output items, built as the chat call's Generate responses arrive; the
    stream's events say what each step added (`events`), the whole object comes from `response`."""

    def __init__(self, request: ResponsesRequest, created_at: int) -> None:
        self.request, self.created_at = request, created_at
        self.choice = Choice(0)
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self.reasoning_tokens = 0  # the tokens of responses that carried reasoning and no answer text
        self.sequence = 0

    def response(self, status: str) -> dict[str, Any]:
        finished = status in TERMINAL
        return {
            "id": self.request.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.request.chat.model,
            "output": self.output if finished else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "usage": _usage(self.choice, self.reasoning_tokens) if finished else None,
            **self.request.echoed,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        events = self._close()
        item: dict[str, Any]
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": []}
        else:
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant", "content": []}
        item["status"] = "in_progress"
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        events.append(
            self._event("response.output_item.added", output_index=index, item=dict(item, content=[]))
        )
        part = (
            {"type": "reasoning_text", "text": ""}
            if kind == "reasoning"
            else {"type": "output_text", "text": "", "annotations": []}
        )
        item["content"].append(part)
        if kind == "message":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        return events

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = [] if self.open is not None and self.open["type"] == kind else self._open(kind)
        item = self.open
        assert item is not None  # opened above
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(
            self._event(
                name,
                item_id=item["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        part, at = item["content"][0], {"item_id": item["id"], "output_index": index, "content_index": 0}
        item["status"] = "completed"
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", **at, text=part["text"])]
        else:
            events = [
                self._event("response.output_text.done", **at, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **at, part=dict(part)),
            ]
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def add(self, response: generate_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The events one Generate response makes (the final ones too, when it is the last)."""
        self.choice.add(response)
        if response.reasoning_text and not response.text:
            self.reasoning_tokens += len(response.token_ids)
        events: list[dict[str, Any]] = []
        if response.reasoning_text:
            events += self._delta("reasoning", response.reasoning_text)
        if response.text:
            events += self._delta("message", response.text)
        for call in response.tool_calls:
            events += self._close()
            item = {
                "type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed",
            }  # fmt: skip
            self.output.append(item)
            index = len(self.output) - 1
            events += [
                self._event("response.output_item.added", output_index=index, item=dict(item, arguments="", status="in_progress")),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=dict(item)),
            ]  # fmt: skip
        if response.finish_reason:
            events += self.finish()
        return events

    @property
    def status(self) -> str:
        """The finished response's: incomplete when it ran out of max_output_tokens."""
        return "incomplete" if self.choice.finish == generate_pb2.FINISH_REASON_LENGTH else "completed"

    def finish(self) -> list[dict[str, Any]]:
        events = self._close()
        if not self.output:  # nothing generated: still one (empty) message, as OpenAI answers
            events += self._open("message") + self._close()
        return [*events, self._event(f"response.{self.status}", response=self.response(self.status))]

    def fail(self, message: str, status: str = "failed") -> list[dict[str, Any]]:
        """The last event of a response whose call failed mid-stream, or (status "cancelled") of a
        background response cancelled: OpenAI's stream has no event of its own for that."""
        events = self._close()
        failed = self.response(status)
        failed["error"] = {"code": "server_error" if status == "failed" else status, "message": message}
        return [*events, self._event("response.failed", response=failed)]
