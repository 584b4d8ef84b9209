"""The JSON objects of OpenAI's Responses API that the router writes, as TypedDicts: the Response object,
its output items, its stream's events and the record a store keeps of it. At run time they are plain dicts,
so `json.dumps` writes them in the order they were built (the order OpenAI sends); the types let a checker
see which fields each event has. OpenAI's SDK defines the same shapes; it is not a dependency here.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict, TypeGuard

# An input item as a request sends it (or as a stored conversation keeps it): checked where it becomes a
# chat message (router/faces/responses.py), otherwise passed on as sent.
InputItem = dict[str, Any]


class Echoed(TypedDict):
    """The request's fields a Response object echoes back, as sent or with OpenAI's defaults."""

    instructions: str | None
    metadata: dict[str, str]
    max_output_tokens: int | None
    temperature: Any  # a number once the chat parse checked it
    top_p: Any
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: Any
    reasoning: Any
    user: str | None
    store: bool
    previous_response_id: str | None
    background: bool


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class MessageItem(TypedDict):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    content: list[OutputText]
    status: str


class ReasoningItem(TypedDict):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: str


class FunctionCallItem(TypedDict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class ResponseError(TypedDict):
    code: str
    message: str


class Usage(TypedDict):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(Echoed):
    """A Response object (`resp_...`); the echoed fields come after these on the wire."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[OutputItem]
    incomplete_details: dict[str, str] | None
    error: ResponseError | None
    usage: Usage | None


class StoredRecord(TypedDict):
    """What a store keeps of a response (router/faces/response_store.py)."""

    response: ResponseObject
    input_items: list[InputItem]  # as asked with, the conversation's earlier turns' first
    conversation: list[InputItem]  # outputs included: what a later previous_response_id continues


class InputItemList(TypedDict):
    """A page of a stored response's input items (`GET /v1/responses/{id}/input_items`)."""

    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(TypedDict):
    id: str
    object: Literal["response"]
    deleted: bool


StatusEventType = Literal[
    "response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"
]
ItemEventType = Literal["response.output_item.added", "response.output_item.done"]


class ResponseStatusEvent(TypedDict):
    """The response as it stands: at its start, and at its end (TERMINAL_EVENTS)."""

    type: StatusEventType
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(TypedDict):
    type: ItemEventType
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(TypedDict):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(TypedDict):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class OutputTextDoneEvent(TypedDict):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ReasoningTextDeltaEvent(TypedDict):
    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(TypedDict):
    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(TypedDict):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(TypedDict):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


ResponseEvent = (
    ResponseStatusEvent
    | OutputItemEvent
    | ContentPartEvent
    | OutputTextDeltaEvent
    | OutputTextDoneEvent
    | ReasoningTextDeltaEvent
    | ReasoningTextDoneEvent
    | FunctionCallArgumentsDeltaEvent
    | FunctionCallArgumentsDoneEvent
)

# A response's statuses once it ended; the stream's last events.
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def is_terminal(event: ResponseEvent) -> TypeGuard[ResponseStatusEvent]:
    """Whether `event` is a stream's last: the finished response is its `response`."""
    return event["type"] in TERMINAL_EVENTS
