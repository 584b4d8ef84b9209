"""OpenAI's chat and completion requests turned into Generate requests, and Generate responses turned into
OpenAI's completions and stream chunks. Pure translation: no I/O, each piece testable alone.

Unknown fields are ignored, as OpenAI's server ignores them; a known field of the wrong type is a
ProtocolError naming it (the HTTP face answers 400), and so is one of OpenAI's fields whose asked-for
effect is not served (UNSERVED): answering as if it were absent would be a silent wrong answer. Ranges are
checked where gRPC checks them, by the same validation, so both faces give the same messages.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nanovllm.v1 import generate_pb2

MAX_N = 8  # choices per request: each is a Generate call of its own, sharing the prompt's cached blocks
INT32 = (-(2**31), 2**31 - 1)
SEEDS = (-(2**63), 2**63 - MAX_N)  # int64, with room for the seed + i of each choice
TOKEN_IDS = (0, 2**32 - 1)
_FINISH: dict[int, str] = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    generate_pb2.FINISH_REASON_CANCELLED: "abort",
    generate_pb2.FINISH_REASON_ERROR: "error",
}


class ProtocolError(ValueError):
    """A request body OpenAI's API would refuse: the message names the field (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ApiError(Exception):
    """A request refused with an HTTP status of its own (401, 404, 413, 503, 507...), the status OpenAI's
    API answers it with, and the parameter the message names if any. (A ProtocolError is a 400.)"""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


# A legacy completion's max_tokens when the body has none: OpenAI's default (and vLLM's); a chat runs to
# the end of the context.
COMPLETIONS_MAX_TOKENS = 16

_JSON_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
}


# Every field of a request body, by endpoint (docs/api.md#request-fields has the table): those served,
# OpenAI's that the official client sends and that change nothing in an answer (identifiers, billing and
# caching hints: accepted), and OpenAI's not served (UNSERVED). Any other name is refused: a field nobody
# reads is an answer that silently ignores what was asked.
SERVED_COMMON = {
    "model", "n", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "stop", "stream",
    "stream_options", "max_tokens", "logprobs",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "prompt_logprobs", "structured_outputs",
}  # fmt: skip
SERVED = {
    "chat": SERVED_COMMON | {
        "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
        "chat_template_kwargs",
    },
    "completions": SERVED_COMMON | {"prompt", "echo", "best_of"},
}  # fmt: skip
WITHOUT_EFFECT = {
    "chat": {
        "user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
        "prompt_cache_options", "service_tier", "store", "parallel_tool_calls",
    },
    "completions": {"user"},
}  # fmt: skip
# OpenAI's fields not served, each with the values that ask for nothing (those pass) and what is missing.
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "text after the completion (insertion) is not supported"),
    "logit_bias": ((None, {}), "per-token logit biases are not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text comes out"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "functions": ((None, []), "the deprecated functions field is not served: give tools"),
    "function_call": ((None,), "the deprecated function_call field is not served: give tool_choice"),
    "reasoning_effort": ((None,), "reasoning effort is not served: chat_template_kwargs.enable_thinking is"),
    "verbosity": ((None,), "verbosity is not served"),
    "moderation": ((None,), "moderation is not served"),
    # Values of accepted fields that would ask for something.
    "store": ((None, False), "responses are not stored"),
    "parallel_tool_calls": ((None, True), "several tool calls in one answer cannot be turned off"),
    "service_tier": ((None, "auto", "default"), "one service tier is served"),
}


def _refuse_unknown(body: dict[str, Any], chat: bool) -> None:
    endpoint = "chat" if chat else "completions"
    known = SERVED[endpoint] | WITHOUT_EFFECT[endpoint] | UNSERVED.keys()
    for name in body:
        if name not in known:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            raise ProtocolError(name, f"{name} is not a field of {path} here (docs/api.md#request-fields)")


def _refuse_unserved(body: dict[str, Any], n: int) -> None:
    for name, (nothing, missing) in UNSERVED.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in nothing):
            raise ProtocolError(
                name, f"{name}={_shown(body[name], as_json=True)} is not served here: {missing}"
            )
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:  # the best n of best_of candidates: only best_of == n is served
        raise ProtocolError(
            "best_of",
            f"best_of={_shown(best_of, as_json=True)} is not served here: only best_of equal to n ({n}) is",
        )


def typed_field(
    body: dict[str, Any],
    name: str,
    kinds: type | tuple[type, ...],
    default: Any = None,
    param: str | None = None,
) -> Any:
    """`body[name]` if it is of one of the JSON types of `kinds`, `default` if absent or null; otherwise a
    ProtocolError naming the field (`param`, a path such as input[0].role; `name` by default) and the type
    it needs."""
    param = param or name
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; OpenAI's schema keeps them apart.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ProtocolError(param, f"{param} must be a number, got a boolean")
    if not isinstance(value, kinds):
        expected = " or ".join(_JSON_NAMES[k] for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise ProtocolError(param, f"{param} must be {expected}, got {_JSON_NAMES.get(type(value), 'null')}")
    return value


def _shown(value: Any, as_json: bool = False) -> str:
    """A value for a message (as Python or JSON writes it), cut short (an integer may have thousands of
    digits)."""
    text = json.dumps(value) if as_json else repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _integer(
    body: dict[str, Any], name: str, bounds: tuple[int, int] = INT32, default: int | None = None
) -> int | None:
    """An integer field within the range its protobuf field holds (or a tighter one)."""
    value = typed_field(body, name, int, default)
    if value is not None and not bounds[0] <= value <= bounds[1]:
        raise ProtocolError(name, f"{name} must be in [{bounds[0]}, {bounds[1]}], got {_shown(value)}")
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = typed_field(body, name, (int, float))
    try:
        return None if value is None else float(value)
    except OverflowError:  # an integer past float's range
        raise ProtocolError(name, f"{name} must be a finite number, got {_shown(value)}") from None


def check_unicode(body: dict[str, Any]) -> None:
    """Refuse a string anywhere in the body that holds an unpaired surrogate: JSON's \\u escapes can
    write one, Python's json reads it, and it is not Unicode (protobuf and the tokenizer cannot take it).
    Iterative: the body may nest deeply."""
    pending: list[tuple[str, Any]] = [("body", body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{path}.{key}", item) for key, item in value.items())
            pending.extend((path, key) for key in value)
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as exc:
                param = path.removeprefix("body.") or "body"
                raise ProtocolError(
                    param, f"{param} holds an unpaired surrogate at character {exc.start}: not valid Unicode"
                ) from None


@dataclass(frozen=True)
class OpenAIRequest:
    """One HTTP request as the router runs it: a Generate request per choice, and how to answer."""

    generate: list[generate_pb2.GenerateRequest]
    stream: bool
    include_usage: bool
    chat: bool
    model: str
    logprobs: int | None = None  # top logprobs per token, when asked
    # Completions with echo: the prompt comes back before the completion (its text as sent, or its
    # tokens' text), with its tokens' logprobs when logprobs are asked for; `score_only`: max_tokens 0,
    # the prompt scored and nothing generated (one token is, and dropped).
    echo: bool = False
    echo_text: str | None = None
    score_only: bool = False
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's logprobs in vLLM's shape
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _sampling(body: dict[str, Any], chat: bool) -> tuple[generate_pb2.SamplingParams, int | None]:
    sampling = generate_pb2.SamplingParams()
    # OpenAI's fields, then vLLM's extensions (min_p, repetition_penalty, top_k, min_tokens, ignore_eos).
    for name in (
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "repetition_penalty",
    ):
        value = _number(body, name)
        if value is not None:
            setattr(sampling, name, value)
    for name in ("top_k", "min_tokens"):
        value = _integer(body, name)
        if value is not None:
            setattr(sampling, name, value)
    sampling.ignore_eos = typed_field(body, "ignore_eos", bool, False)
    max_tokens = _integer(body, "max_completion_tokens") if chat else None
    max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens")
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_MAX_TOKENS
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    seed = _integer(body, "seed", SEEDS)
    if seed is not None:
        sampling.seed = seed
    stop = typed_field(body, "stop", (str, list))
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not all(isinstance(s, str) for s in stops):
        raise ProtocolError("stop", "stop must be a string or a list of strings")
    sampling.stop.extend(stops)
    logprobs = None
    if chat:
        if typed_field(body, "logprobs", bool, False):
            logprobs = _integer(body, "top_logprobs", default=0)
    else:
        logprobs = _integer(body, "logprobs")
    if logprobs is not None:
        sampling.logprobs = logprobs
    _response_format(body, sampling)
    _structured_outputs(body, sampling)
    return sampling, logprobs


# vLLM's `structured_outputs` extension: one constraint, as the gRPC SamplingParams' `constraint` oneof.
_STRUCTURED_OUTPUTS: dict[str, type | tuple[type, ...]] = {
    "json": (dict, str),
    "regex": str,
    "grammar": str,
    "choice": list,
}


def _structured_outputs(body: dict[str, Any], sampling: generate_pb2.SamplingParams) -> None:
    constraint = typed_field(body, "structured_outputs", dict)
    if constraint is None:
        return
    unknown = sorted(set(constraint) - _STRUCTURED_OUTPUTS.keys())
    if unknown or len(constraint) != 1:
        raise ProtocolError(
            "structured_outputs",
            f"structured_outputs must hold exactly one of {', '.join(_STRUCTURED_OUTPUTS)}; got "
            f"{', '.join(sorted(constraint)) or 'none'}",
        )
    if sampling.WhichOneof("constraint") is not None:
        raise ProtocolError(
            "structured_outputs", "structured_outputs and response_format cannot both constrain"
        )
    kind = next(iter(constraint))
    param = f"structured_outputs.{kind}"
    value = typed_field(constraint, kind, _STRUCTURED_OUTPUTS[kind], param=param)
    if value is None:
        raise ProtocolError(param, f"{param} is null")
    if kind == "json":
        sampling.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        if not value or not all(isinstance(c, str) for c in value):
            raise ProtocolError(param, f"{param} must be a list of strings, at least one")
        sampling.choice.choices.extend(value)
    else:
        setattr(sampling, kind, value)


def _response_format(body: dict[str, Any], sampling: generate_pb2.SamplingParams) -> None:
    response_format = typed_field(body, "response_format", dict)
    if response_format is None:
        return
    kind = response_format.get("type")
    if kind == "json_object":
        sampling.json_object = True
    elif kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ProtocolError("response_format", "response_format.json_schema.schema must be an object")
        sampling.json_schema = json.dumps(schema)
    elif kind != "text":
        raise ProtocolError(
            "response_format", f"response_format.type {kind!r} is not text, json_object or json_schema"
        )


def _content(message: dict[str, Any], i: int, entry: generate_pb2.ChatMessage) -> None:
    """The message's content into `entry`: a string, or parts (text; images as `image_url` parts with a
    base64 `data:` URL), kept as parts when one is an image, else joined."""
    where = f"messages[{i}].content"
    content = typed_field(message, "content", (str, list), "", param=where)
    if isinstance(content, str):
        entry.content = content
        return
    parts = []
    for j, part in enumerate(content):
        kind = typed_field(part, "type", str, param=f"{where}[{j}].type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(
                generate_pb2.ContentPart(text=typed_field(part, "text", str, "", param=f"{where}[{j}].text"))
            )
        elif kind == "image_url":
            parts.append(generate_pb2.ContentPart(image=_image_url(part, f"{where}[{j}]")))
        else:
            raise ProtocolError(
                f"{where}[{j}]", f"{where}[{j}] must be a text or image_url part: {{'type': 'text', ...}}"
            )
    if any(part.HasField("image") for part in parts):
        entry.parts.extend(parts)
    else:
        entry.content = "".join(part.text for part in parts)


def image_source(url: str, where: str) -> generate_pb2.ImagePart:
    """An image given as a base64 `data:` URL (`data:image/png;base64,...`): its bytes; an http(s) URL: for
    the router to fetch, if --image-url-hosts allows its host (router/calls/images.py)."""
    if url.startswith(("http://", "https://")):
        return generate_pb2.ImagePart(url=url)
    header, comma, payload = url.partition(",")
    if not header.startswith("data:") or not comma or not header.endswith(";base64"):
        raise ProtocolError(
            where,
            f"{where} must be a base64 data: URL (data:image/png;base64,...) or an http(s) URL; got {url[:40]!r}",
        )
    try:
        return generate_pb2.ImagePart(data=base64.b64decode(payload, validate=True))
    except binascii.Error as exc:
        raise ProtocolError(where, f"{where}: its base64 payload does not decode: {exc}") from None


def _image_url(part: dict[str, Any], where: str) -> generate_pb2.ImagePart:
    """An `image_url` part's image: `{"type": "image_url", "image_url": {"url": ...}}` (or the URL
    string)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ProtocolError(f"{where}.image_url", f"{where}.image_url must be {{'url': 'data:...'}}")
    return image_source(url, f"{where}.image_url.url")


def _chat(body: dict[str, Any]) -> generate_pb2.Chat:
    messages = typed_field(body, "messages", list)
    if not messages:
        raise ProtocolError("messages", "messages must be a non-empty list")
    chat = generate_pb2.Chat()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ProtocolError(f"messages[{i}]", f"messages[{i}] must be an object with a string role")
        entry = chat.messages.add(role=message["role"])
        _content(message, i, entry)
        for j, call in enumerate(
            typed_field(message, "tool_calls", list, [], param=f"messages[{i}].tool_calls")
        ):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise ProtocolError(where, f"{where} needs a function")
            arguments = function.get("arguments", "{}")
            entry.tool_calls.add(
                id=typed_field(call, "id", str, "", param=f"{where}.id"),
                name=typed_field(function, "name", str, "", param=f"{where}.function.name"),
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        entry.tool_call_id = typed_field(
            message, "tool_call_id", str, "", param=f"messages[{i}].tool_call_id"
        )
        entry.reasoning_content = typed_field(  # vLLM's: an earlier answer's reasoning, sent back
            message, "reasoning_content", str, "", param=f"messages[{i}].reasoning_content"
        )
    for i, tool in enumerate(typed_field(body, "tools", list, [])):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ProtocolError(
                f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        parameters = function.get("parameters")
        chat.tools.add(
            name=function["name"],
            description=typed_field(
                function, "description", str, "", param=f"tools[{i}].function.description"
            ),
            parameters=json.dumps(parameters) if parameters is not None else "",
        )
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        modes = {
            "auto": generate_pb2.ToolChoice.MODE_AUTO,
            "none": generate_pb2.ToolChoice.MODE_NONE,
            "required": generate_pb2.ToolChoice.MODE_REQUIRED,
        }
        if choice not in modes:
            raise ProtocolError("tool_choice", f"tool_choice {choice!r} is not auto, none or required")
        chat.tool_choice.mode = modes[choice]
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ProtocolError(
                "tool_choice", "tool_choice must name a function: {'function': {'name': ...}}"
            )
        chat.tool_choice.function = name
    kwargs = typed_field(body, "chat_template_kwargs", dict)  # vLLM's extension: Qwen3's enable_thinking
    if kwargs:
        try:
            chat.template_kwargs.update(kwargs)
        except (ValueError, OverflowError) as exc:  # a number past a double's range
            raise ProtocolError(
                "chat_template_kwargs", f"chat_template_kwargs cannot be taken: {exc}"
            ) from None
    return chat


def parse_request(body: Any, chat: bool) -> OpenAIRequest:
    """The Generate requests for a /v1/chat/completions (chat) or /v1/completions body."""
    if not isinstance(body, dict):
        raise ProtocolError("body", "the request body must be a JSON object")
    check_unicode(body)
    _refuse_unknown(body, chat)
    sampling, logprobs = _sampling(body, chat)
    prompt: dict[str, Any]  # GenerateRequest's prompt field
    if chat:
        prompt = {"chat": _chat(body)}
    else:
        text = typed_field(body, "prompt", (str, list))
        if isinstance(text, list):
            if all(isinstance(t, int) and not isinstance(t, bool) for t in text) and text:
                if not all(TOKEN_IDS[0] <= t <= TOKEN_IDS[1] for t in text):
                    raise ProtocolError("prompt", f"prompt token ids must be in [0, {TOKEN_IDS[1]}]")
                prompt = {"token_ids": generate_pb2.TokenIds(ids=text)}
            elif len(text) == 1 and isinstance(text[0], str):
                prompt = {"text": text[0]}
            else:
                raise ProtocolError("prompt", "prompt must be a string, one string in a list, or token ids")
        elif text is None:
            raise ProtocolError("prompt", "prompt is required")
        else:
            prompt = {"text": text}
    model = typed_field(body, "model", str, "")
    n = _integer(body, "n", (1, MAX_N), 1)
    assert n is not None  # it has a default
    _refuse_unserved(body, n)
    echo = not chat and typed_field(body, "echo", bool, False)
    score_only = echo and sampling.HasField("max_tokens") and sampling.max_tokens == 0
    prompt_logprobs = _integer(body, "prompt_logprobs")  # vLLM's extension: its own object, below
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    if echo:
        if logprobs is not None:
            sampling.prompt_logprobs = max(logprobs, prompt_logprobs or 0)
        if score_only:
            sampling.max_tokens = 1
    requests = []
    for i in range(n):
        choice_sampling = generate_pb2.SamplingParams()
        choice_sampling.CopyFrom(sampling)
        if n > 1 and sampling.HasField("seed"):
            choice_sampling.seed = sampling.seed + i  # distinct choices, each reproducible
        requests.append(generate_pb2.GenerateRequest(sampling=choice_sampling, model=model, **prompt))
    options = typed_field(body, "stream_options", dict, {})
    return OpenAIRequest(
        generate=requests,
        stream=typed_field(body, "stream", bool, False),
        include_usage=bool(options.get("include_usage")),
        chat=chat,
        model=model,
        logprobs=logprobs,
        echo=echo,
        echo_text=prompt.get("text") if echo else None,
        score_only=score_only,
        prompt_logprobs=prompt_logprobs,
    )


# --- responses ------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One choice's text and state, gathered from its Generate responses."""

    index: int
    text: str = ""
    reasoning: str = ""
    tool_calls: list[generate_pb2.ToolCall] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    finish: int = 0
    usage: generate_pb2.Usage | None = None
    timings: generate_pb2.Timings | None = None

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        self.text += response.text
        self.reasoning += response.reasoning_text
        self.tool_calls.extend(response.tool_calls)
        self.logprobs.extend(response.logprobs)
        self.prompt_token_ids.extend(response.prompt_token_ids)
        self.prompt_logprobs.extend(response.prompt_logprobs)
        if response.finish_reason:
            self.finish, self.usage = response.finish_reason, response.usage
            self.timings = response.timings if response.HasField("timings") else None


def timings_dict(timings: generate_pb2.Timings) -> dict[str, float]:
    """A choice's `timings` (an extension of OpenAI's objects, as llama.cpp's server adds one): the
    Generate response's Timings fields, in seconds."""
    return {f.name: round(getattr(timings, f.name), 6) for f in generate_pb2.Timings.DESCRIPTOR.fields}


def _tool_call(call: generate_pb2.ToolCall, index: int | None = None) -> dict[str, Any]:
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}


def _logprobs(entries, decode, chat: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object; `decode(token_id)` gives a token's text; `offset`: where the first token's
    text starts in the choice's text (completions' text_offset)."""
    if chat:
        content = [
            {
                "token": decode(e.token_id),
                "logprob": e.logprob,
                "top_logprobs": [{"token": decode(t.token_id), "logprob": t.logprob} for t in e.top],
            }
            for e in entries
        ]
        return {"content": content}
    tokens = [decode(e.token_id) for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{decode(t.token_id): t.logprob for t in e.top} for e in entries],
        "text_offset": _offsets(tokens, offset),
    }


def _offsets(tokens: list[str], start: int) -> list[int]:
    """Where each token's text starts, the first at `start` (each token decoded alone)."""
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(token)
    return offsets


def _echo(
    request: OpenAIRequest, choice_prompt_ids: list[int], prompt_logprobs, decode
) -> tuple[str, dict | None]:
    """A completion's echoed prompt: its text, and (with logprobs) its tokens' logprobs object, whose
    first token has none (nothing precedes it)."""
    tokens = [decode(t) for t in choice_prompt_ids]
    text = request.echo_text if request.echo_text is not None else "".join(tokens)
    if request.logprobs is None:
        return text, None
    scored = [None, *prompt_logprobs]
    return text, {
        "tokens": tokens,
        "token_logprobs": [e.logprob if e is not None else None for e in scored],
        "top_logprobs": [
            {decode(t.token_id): t.logprob for t in e.top} if e is not None else None for e in scored
        ],
        "text_offset": _offsets(tokens, 0),
    }


def _vllm_prompt_logprobs(prompt_logprobs, decode) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` object: per prompt token (the first None), the actual token and the most
    likely ones, keyed by token id, each with its logprob, rank and text."""
    out: list[dict[str, Any] | None] = [None]
    for e in prompt_logprobs:
        entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": decode(e.token_id)}}
        for rank, t in enumerate(e.top, start=1):
            entry.setdefault(
                str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": decode(t.token_id)}
            )
        out.append(entry)
    return out


def _joined(first: dict | None, later: dict | None) -> dict | None:
    """Two completions logprobs objects one after the other."""
    if first is None or later is None:
        return later if first is None else first
    return {key: first[key] + later[key] for key in first}


def _header(request: OpenAIRequest, chat_object: str) -> dict[str, Any]:
    """The fields every answer and chunk starts with; completions are "text_completion" objects."""
    return {
        "id": ("chatcmpl-" if request.chat else "cmpl-") + request.id,
        "object": chat_object if request.chat else "text_completion",
        "created": request.created,
        "model": request.model,
    }


def usage_dict(choices: list[Choice], score_only: bool = False) -> dict[str, Any]:
    prompt = max((c.usage.prompt_tokens for c in choices if c.usage), default=0)
    completion = 0 if score_only else sum(c.usage.completion_tokens for c in choices if c.usage)
    cached = max((c.usage.cached_prompt_tokens for c in choices if c.usage), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_body(request: OpenAIRequest, choices: list[Choice], decode) -> dict[str, Any]:
    """The non-streaming answer."""
    rendered = []
    for c in choices:
        entry: dict[str, Any] = {"index": c.index, "finish_reason": _FINISH.get(c.finish)}
        if request.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.reasoning:
                message["reasoning_content"] = c.reasoning
            if c.tool_calls:
                message["tool_calls"] = [_tool_call(t) for t in c.tool_calls]
            entry["message"] = message
        else:
            entry["text"] = c.text
        entry["logprobs"] = (
            _logprobs(c.logprobs, decode, request.chat) if request.logprobs is not None else None
        )
        if request.echo:
            echoed, logprobs = _echo(request, c.prompt_token_ids, c.prompt_logprobs, decode)
            generated = "" if request.score_only else c.text
            entry["text"] = echoed + generated
            if request.logprobs is not None:
                after = None if request.score_only else _logprobs(c.logprobs, decode, False, len(echoed))
                entry["logprobs"] = _joined(logprobs, after)
        if c.timings is not None:
            entry["timings"] = timings_dict(c.timings)
        if request.prompt_logprobs is not None and not request.chat:
            entry["prompt_logprobs"] = _vllm_prompt_logprobs(c.prompt_logprobs, decode)
        rendered.append(entry)
    body = {**_header(request, "chat.completion"), "choices": rendered}
    if request.prompt_logprobs is not None and request.chat:  # vLLM puts it beside the choices
        body["prompt_logprobs"] = _vllm_prompt_logprobs(choices[0].prompt_logprobs, decode)
    return {**body, "usage": usage_dict(choices, request.score_only)}


def chunk_body(
    request: OpenAIRequest,
    index: int,
    response: generate_pb2.GenerateResponse,
    first: bool,
    calls_before: int,
    decode,
    text_before: int = 0,
) -> dict[str, Any]:
    """One stream chunk for one Generate response of choice `index`; `first`: the choice's first chunk
    (which carries the role); `calls_before`: tool calls this choice streamed before; `text_before`: the
    length of the text it streamed before (completions' text_offset)."""
    finish = _FINISH.get(response.finish_reason) if response.finish_reason else None
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if response.text:
            delta["content"] = response.text
        if response.reasoning_text:
            delta["reasoning_content"] = response.reasoning_text
        if response.tool_calls:
            delta["tool_calls"] = [_tool_call(t, calls_before + i) for i, t in enumerate(response.tool_calls)]
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": index, "text": response.text, "finish_reason": finish}
    if request.logprobs is not None:
        choice["logprobs"] = (
            _logprobs(response.logprobs, decode, request.chat, text_before) if response.logprobs else None
        )
    if request.echo:
        echoed, logprobs = "", None
        if response.prompt_token_ids:  # the choice's first response: the prompt goes first
            echoed, logprobs = _echo(
                request, list(response.prompt_token_ids), response.prompt_logprobs, decode
            )
        generated = "" if request.score_only else response.text
        choice["text"] = echoed + generated
        if request.logprobs is not None:
            after = None
            if response.logprobs and not request.score_only:
                after = _logprobs(response.logprobs, decode, False, text_before + len(echoed))
            choice["logprobs"] = _joined(logprobs, after)
    if response.HasField("timings"):
        choice["timings"] = timings_dict(response.timings)
    chunk = {**_header(request, "chat.completion.chunk"), "choices": [choice]}
    if request.prompt_logprobs is not None and response.prompt_token_ids:  # a choice's first response
        scored = _vllm_prompt_logprobs(response.prompt_logprobs, decode)
        (chunk if request.chat else choice)["prompt_logprobs"] = scored
    return chunk


def usage_chunk(request: OpenAIRequest, choices: list[Choice]) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    usage = usage_dict(choices, request.score_only)
    return {**_header(request, "chat.completion.chunk"), "choices": [], "usage": usage}
