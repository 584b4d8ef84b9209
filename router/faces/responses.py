"""OpenAI's Responses API (`POST /v1/responses`): a body becomes the chat completion it asks for
(router/faces/openai_protocol.py parses and validates that, once for both), continuing a stored
conversation (`previous_response_id`: router/faces/response_store.py) when it names one; the chat call's
Generate responses become a Response object, or its stream of semantic events (`response.created` ...
`response.completed`, each with its `sequence_number`), typed in router/faces/response_objects.py.

What happens to a response after that (stored, run in the background, followed, cancelled) is
router/faces/response_service.py's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from nanovllm.router.faces.openai_protocol import (
    Choice,
    OpenAIRequest,
    ProtocolError,
    check_unicode,
    parse_request,
    typed_field,
)
from nanovllm.router.faces.response_objects import (
    TERMINAL,
    ContentPartEvent,
    Echoed,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    InputItem,
    ItemEventType,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseEvent,
    ResponseObject,
    ResponseStatusEvent,
    StatusEventType,
    StoredRecord,
    Usage,
)
from nanovllm.v1 import generate_pb2

# Fields of a Responses body: those served, those accepted without effect, and those refused with the
# values that ask for nothing.
SERVED = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "text", "reasoning", "stream", "metadata", "user", "store", "previous_response_id", "background",
    "structured_outputs",  # vLLM's extension, as on chat completions
}  # fmt: skip
WITHOUT_EFFECT = {"safety_identifier", "prompt_cache_key", "service_tier", "truncation", "include"}
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "parallel_tool_calls": ((None, True), "several tool calls in one answer cannot be turned off"),
    "conversation": ((None,), "conversations are not served"),
    "prompt": ((None,), "prompt templates are not served"),
}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


@dataclass
class ResponsesRequest:
    """One /v1/responses call: the chat request it runs, and what its Response object echoes back."""

    chat: OpenAIRequest
    echoed: Echoed
    items: list[InputItem]  # this request's input, as items with ids
    history: list[InputItem]  # the conversation it continues, as input items (outputs included)
    earlier_inputs: list[InputItem]  # the input items of the conversation's earlier turns
    store: bool
    background: bool
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    owner: str = ""  # the caller's token name, set by router/faces/response_service.py

    def record(self, response: ResponseObject) -> StoredRecord:
        """What the store keeps of this finished response (router/faces/response_store.py)."""
        outputs = [_as_input(item) for item in response["output"]]
        return {
            "response": response,
            "input_items": [*self.earlier_inputs, *self.items],
            "conversation": [*self.history, *self.items, *outputs],
        }


def _item_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as a chat message's: its text, or (with `input_image` parts, whose
    `image_url` is a base64 data: URL) text and image_url parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content", f"{where}.content must be a string or input_text parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = (
            typed_field(part, "type", str, param=f"{where}.content[{j}].type")
            if isinstance(part, dict)
            else None
        )
        if kind in _TEXT_PARTS:
            parts.append(
                {
                    "type": "text",
                    "text": typed_field(part, "text", str, "", param=f"{where}.content[{j}].text"),
                }
            )
        elif kind == "input_image":
            url = typed_field(part, "image_url", str, param=f"{where}.content[{j}].image_url")
            if url is None:
                raise ProtocolError(
                    f"{where}.content[{j}].image_url",
                    f"{where}.content[{j}] needs an image_url (a data: URL)",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise ProtocolError(
                f"{where}.content[{j}]", f"{where}.content[{j}] must be an input_text or input_image part"
            )
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _as_input(item: OutputItem) -> InputItem:
    """An output item as the input item a later turn sends back (a reasoning item as it is: templates
    that keep earlier turns' reasoning show it, the others drop it)."""
    if item["type"] == "reasoning":
        return {"type": "reasoning", "id": item["id"], "content": list(item["content"])}
    if item["type"] == "message":
        text = "".join(part["text"] for part in item["content"])
        return {
            "type": "message",
            "id": item["id"],
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
    return {k: item[k] for k in ("type", "id", "call_id", "name", "arguments")}


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
        kind = typed_field(item, "type", str, "message", param=f"input[{i}].type")
        typed_field(item, "id", str, param=f"input[{i}].id")
        if kind not in (*prefixes, "reasoning"):
            raise ProtocolError(
                f"input[{i}].type",
                f"input[{i}].type {kind!r} is not message, function_call or function_call_output",
            )
        with_ids.append(
            item if "id" in item else {"id": prefixes.get(kind, "rs_") + uuid.uuid4().hex, **item}
        )
    return with_ids


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's `reasoning_text` parts, joined (its summary is not the reasoning)."""
    parts = typed_field(item, "content", list, [], param=f"{where}.content")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            raise ProtocolError(
                f"{where}.content[{j}]", f"{where}.content[{j}] must be a reasoning_text part"
            )
        texts.append(typed_field(part, "text", str, "", param=f"{where}.content[{j}].text"))
    return "".join(texts)


def _required_string(item: dict[str, Any], key: str, where: str) -> str:
    value = typed_field(item, key, str, param=f"{where}.{key}")
    if value is None:
        raise ProtocolError(f"{where}.{key}", f"{where}.{key} is required: a string")
    return value


def _messages(instructions: Any, items: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """`instructions` and the conversation's items as chat messages; consecutive function calls become one
    assistant turn. Items before `first` are earlier turns' (errors name this request's `input[i]`)."""
    messages: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant turn after it
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ProtocolError("instructions", "instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input[{i - first}]" if i >= first else f"previous_response_id's input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(typed_field(item, "role", str, "", param=f"{where}.role"))
            if role is None:
                raise ProtocolError(
                    f"{where}.role", f"{where}.role must be user, assistant, system or developer"
                )
            messages.append({"role": role, "content": _item_content(item.get("content"), where)})
            if role == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            call_id, name, arguments = (
                _required_string(item, k, where) for k in ("call_id", "name", "arguments")
            )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if (
                messages
                and messages[-1]["role"] == "assistant"
                and messages[-1].get("tool_calls") is not None
            ):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            call_id, output = (_required_string(item, k, where) for k in ("call_id", "output"))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":  # shown by templates that keep earlier turns' reasoning (preserve_thinking)
            reasoning += _reasoning_text(item, where)
        else:
            raise ProtocolError(
                f"{where}.type",
                f"{where}.type {kind!r} is not message, function_call or function_call_output",
            )
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = typed_field(body, "tools", list, [])
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
        function = {
            "name": tool["name"],
            "description": typed_field(tool, "description", str, "", param=f"tools[{i}].description"),
        }
        parameters = typed_field(tool, "parameters", dict, param=f"tools[{i}].parameters")
        if parameters is not None:
            function["parameters"] = parameters
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


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    text = typed_field(body, "text", dict)
    fmt = None if text is None else typed_field(text, "format", dict, param="text.format")
    if fmt is None:
        return None
    kind = typed_field(fmt, "type", str, param="text.format.type")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ProtocolError("text.format.schema", "text.format.schema must be an object")
        name = typed_field(fmt, "name", str, "", param="text.format.name")
        return {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"]}}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise ProtocolError(
        "text.format.type", f"text.format.type {kind!r} is not text, json_object or json_schema"
    )


def parse_responses_request(
    body: Any, previous: StoredRecord | None = None, can_store: bool = False
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
    for name in ("model", "temperature", "top_p", "structured_outputs"):
        if name in body:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = typed_field(body, "reasoning", dict)
    effort = None if reasoning is None else typed_field(reasoning, "effort", str, param="reasoning.effort")
    if effort is not None:  # Qwen3's thinking switch
        chat["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
    try:
        parsed = parse_request(chat, chat=True)
    except ProtocolError as exc:  # named as the chat field: say which Responses field it came from
        raise ProtocolError(exc.param, f"{exc} (from this /v1/responses body)") from None
    parsed.generate[0].return_token_ids = True  # counted for usage's reasoning_tokens (ResponseBuilder.add)
    echoed: Echoed = {
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


def _usage(choice: Choice, reasoning_tokens: int) -> Usage:
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
    stream's events say what each step added (`events`), the whole object comes from `response`. An event
    carries copies of the items it shows, as they were then: the builder goes on changing its own."""

    def __init__(self, request: ResponsesRequest, created_at: int) -> None:
        self.request, self.created_at = request, created_at
        self.choice = Choice(0)
        self.output: list[OutputItem] = []
        self.open: MessageItem | ReasoningItem | None = None  # the reasoning or message item being streamed
        self.reasoning_tokens = 0  # the tokens of responses that carried reasoning and no answer text
        self.sequence = 0

    def response(self, status: str) -> ResponseObject:
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

    def _next(self) -> int:
        """The next event's sequence_number."""
        self.sequence += 1
        return self.sequence - 1

    def _status_event(self, kind: StatusEventType, response: ResponseObject) -> ResponseStatusEvent:
        return ResponseStatusEvent(type=kind, sequence_number=self._next(), response=response)

    def _item_event(self, kind: ItemEventType, index: int, item: OutputItem) -> OutputItemEvent:
        return OutputItemEvent(type=kind, sequence_number=self._next(), output_index=index, item=item)

    def start(self) -> list[ResponseEvent]:
        return [
            self._status_event("response.created", self.response("in_progress")),
            self._status_event("response.in_progress", self.response("in_progress")),
        ]

    def _open(
        self, kind: Literal["reasoning", "message"]
    ) -> tuple[list[ResponseEvent], MessageItem | ReasoningItem]:
        """Close the item being streamed, and open a `kind` item (returned too) with one empty part."""
        events = self._close()
        item: MessageItem | ReasoningItem
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": [], "status": "in_progress"}  # fmt: skip
        else:
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant", "content": [], "status": "in_progress"}  # fmt: skip
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        events.append(self._item_event("response.output_item.added", index, item.copy()))
        # The part goes into a new list: the event's copy of the item keeps the empty one.
        if item["type"] == "reasoning":
            item["content"] = [ReasoningText(type="reasoning_text", text="")]
        else:
            part = OutputText(type="output_text", text="", annotations=[])
            item["content"] = [part]
            events.append(ContentPartEvent(type="response.content_part.added", sequence_number=self._next(), item_id=item["id"], output_index=index, content_index=0, part=part.copy()))  # fmt: skip
        return events, item

    def _delta(self, kind: Literal["reasoning", "message"], text: str) -> list[ResponseEvent]:
        item, events = self.open, list[ResponseEvent]()
        if item is None or item["type"] != kind:
            events, item = self._open(kind)
        index = len(self.output) - 1
        item["content"][0]["text"] += text
        if item["type"] == "reasoning":
            events.append(ReasoningTextDeltaEvent(type="response.reasoning_text.delta", sequence_number=self._next(), item_id=item["id"], output_index=index, content_index=0, delta=text))  # fmt: skip
        else:
            events.append(OutputTextDeltaEvent(type="response.output_text.delta", sequence_number=self._next(), item_id=item["id"], output_index=index, content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return events

    def _close(self) -> list[ResponseEvent]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        events: list[ResponseEvent] = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(ReasoningTextDoneEvent(type="response.reasoning_text.done", sequence_number=self._next(), item_id=item["id"], output_index=index, content_index=0, text=text))  # fmt: skip
        else:
            part = item["content"][0]
            events.append(OutputTextDoneEvent(type="response.output_text.done", sequence_number=self._next(), item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=[]))  # fmt: skip
            events.append(ContentPartEvent(type="response.content_part.done", sequence_number=self._next(), item_id=item["id"], output_index=index, content_index=0, part=part.copy()))  # fmt: skip
        events.append(self._item_event("response.output_item.done", index, item.copy()))
        return events

    def add(self, response: generate_pb2.GenerateResponse) -> list[ResponseEvent]:
        """The events one Generate response makes (the final ones too, when it is the last)."""
        self.choice.add(response)
        if response.reasoning_text and not response.text:
            self.reasoning_tokens += len(response.token_ids)
        events: list[ResponseEvent] = []
        if response.reasoning_text:
            events += self._delta("reasoning", response.reasoning_text)
        if response.text:
            events += self._delta("message", response.text)
        for call in response.tool_calls:
            events += self._close()
            item: FunctionCallItem = {
                "type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed",
            }  # fmt: skip
            self.output.append(item)
            index = len(self.output) - 1
            events += [
                self._item_event("response.output_item.added", index, {**item, "arguments": "", "status": "in_progress"}),
                FunctionCallArgumentsDeltaEvent(type="response.function_call_arguments.delta", sequence_number=self._next(), item_id=item["id"], output_index=index, delta=call.arguments),
                FunctionCallArgumentsDoneEvent(type="response.function_call_arguments.done", sequence_number=self._next(), item_id=item["id"], output_index=index, name=call.name, arguments=call.arguments),
                self._item_event("response.output_item.done", index, item.copy()),
            ]  # fmt: skip
        if response.finish_reason:
            events += self.finish()
        return events

    @property
    def status(self) -> Literal["completed", "incomplete"]:
        """The finished response's: incomplete when it ran out of max_output_tokens."""
        return "incomplete" if self.choice.finish == generate_pb2.FINISH_REASON_LENGTH else "completed"

    def finish(self) -> list[ResponseEvent]:
        events = self._close()
        if not self.output:  # nothing generated: still one (empty) message, as OpenAI answers
            events += self._open("message")[0] + self._close()
        status = self.status
        kind: StatusEventType = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._status_event(kind, self.response(status))]

    def fail(self, message: str, status: Literal["failed", "cancelled"] = "failed") -> list[ResponseEvent]:
        """The last events of a response whose call failed mid-stream, or (status "cancelled") of a
        background response cancelled: OpenAI's stream has no event of its own for that."""
        events = self._close()
        failed = self.response(status)
        failed["error"] = {"code": "server_error" if status == "failed" else status, "message": message}
        return [*events, self._status_event("response.failed", failed)]
