"""Public requests (nanovllm.v1) checked and turned into engine terms: prompt token ids, images and
SamplingParams. Every failure is a ValueError whose message names the field and the numbers, or a
NoTokenizerError for what needs a tokenizer the model does not have.

Checking runs in two parts: `check_request` looks at sizes and fields without tokenizing (cheap, on the
event loop), so an oversized request is refused before any tokenizer work; `validate_generate`
tokenizes (the router runs it on a thread) and checks the prompt against the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from google.protobuf import json_format

from nanovllm.common.block_hash import PromptImage
from nanovllm.common.images import ResizedImage, expand_placeholders
from nanovllm.common.request_checks import check_prompt
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.common.server_config import RequestLimits
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.calls.images import (
    check_images,
    check_link_size,
    decode_image,
    image_parts,
    model_images,
    num_tokens,
)
from nanovllm.router.calls.markers import Markers
from nanovllm.router.calls.reasoning import prompt_opens_reasoning
from nanovllm.router.calls.tool_calls import (
    ChatTools,
    check_tools,
    forced_call_grammar,
    template_message,
)
from nanovllm.router.fleet.tokenizer import ModelTokenizer, PromptTokens
from nanovllm.v1 import generate_pb2


class NoTokenizerError(Exception):
    """The request needs the model's tokenizer (a text or chat prompt, stop strings) and it has none."""


@dataclass(frozen=True)
class ValidRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: list[str]
    tools: ChatTools | None = None  # a chat's tools, for the answer's tool-call parser
    # A chat's tokens before its last user message's content, for a worker that takes the hint
    # (WorkerInfo.shared_prefix_hints; Submit.shared_prefix_tokens); 0 otherwise.
    shared_prefix_tokens: int = 0
    # A chat's images, decoded and resized, in prompt order: each fills its run of placeholder tokens.
    images: tuple[ResizedImage, ...] = ()
    image_spans: tuple[PromptImage, ...] = ()  # where each image's placeholder tokens lie, for routing


def _prompt_bytes(request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest) -> int:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return len(request.text.encode())
    if kind == "chat":
        chat = request.chat
        return chat.template_kwargs.ByteSize() + sum(
            len(m.role.encode()) + len(m.content.encode()) + sum(len(p.text.encode()) for p in m.parts)
            for m in chat.messages
        )
    return 0


def check_prompt_size(
    request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
    limits: RequestLimits,
    max_model_len: int,
) -> None:
    size, limit = _prompt_bytes(request), limits.prompt_bytes(max_model_len)
    if size > limit:
        raise ValueError(
            f"the prompt is {size} bytes; at most {limit} are accepted ({limits.prompt_bytes_per_token} bytes "
            f"per token of max_model_len {max_model_len}); send fewer, or token_ids"
        )


def check_request(
    request: generate_pb2.GenerateRequest,
    tokenizer: ModelTokenizer | None,
    info: worker_pb2.WorkerInfo,
    limits: RequestLimits,
) -> None:
    """Everything that can be checked without tokenizing (the model's name is the catalog's)."""
    id_bytes = len(request.request_id.encode())
    if id_bytes > limits.max_request_id_bytes:
        raise ValueError(f"request_id is {id_bytes} bytes; at most {limits.max_request_id_bytes} are allowed")
    check_prompt_size(request, limits, info.max_model_len)
    if request.WhichOneof("prompt") == "chat":
        both = next((i for i, m in enumerate(request.chat.messages) if m.content and m.parts), None)
        if both is not None:
            raise ValueError(f"chat.messages[{both}] has both content and parts: give one of them")
    check_images(image_parts(request), info, limits)
    s = request.sampling
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise ValueError(
            f"sampling.stop_token_ids has {len(s.stop_token_ids)} ids; at most {limits.max_stop_token_ids} "
            f"are allowed"
        )
    bad = next((t for t in s.stop_token_ids if t >= info.vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"sampling.stop_token_ids holds {bad}, outside the vocabulary [0, {info.vocab_size})"
        )
    if len(s.stop) > limits.max_stop_strings:
        raise ValueError(
            f"sampling.stop has {len(s.stop)} strings; at most {limits.max_stop_strings} are allowed"
        )
    for i, text in enumerate(s.stop):
        if not text:
            raise ValueError(f"sampling.stop[{i}] is empty; stop strings need at least one character")
        if len(text.encode()) > limits.max_stop_string_bytes:
            raise ValueError(
                f"sampling.stop[{i}] is {len(text.encode())} bytes; at most {limits.max_stop_string_bytes} "
                f"are allowed"
            )
    if s.stop and tokenizer is None:
        raise NoTokenizerError(
            f"model {info.model} has no tokenizer: sampling.stop needs one; use stop_token_ids"
        )
    _sampling_params(s, info.max_model_len)  # its own range checks, before any tokenizer work


def prompt_token_ids(
    request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
    tokenizer: ModelTokenizer | None,
    model: str,
    tools: ChatTools | None = None,
) -> list[int]:
    """The prompt's token ids; `tokenizer` is None for a model without one (`model` names it). A chat's
    `tools` (check_tools) are shown to the model through its template."""
    return _prompt(request, tokenizer, model, tools, find_last_user=False).token_ids


def _prompt(
    request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
    tokenizer: ModelTokenizer | None,
    model: str,
    tools: ChatTools | None,
    find_last_user: bool,
) -> PromptTokens:
    """prompt_token_ids' tokens; with `find_last_user`, a chat's also say where its last user message's
    content begins (ModelTokenizer.encode_chat)."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return PromptTokens(list(request.token_ids.ids))
    if kind is None:
        raise ValueError("prompt is not set: give one of text, chat or token_ids")
    if tokenizer is None:
        raise NoTokenizerError(f"model {model} has no tokenizer: send prompt token ids")
    if kind == "text":
        return PromptTokens(tokenizer.encode(request.text))
    if not request.chat.messages:
        raise ValueError("chat.messages is empty; a chat needs at least one message")
    chat = request.chat
    kwargs = json_format.MessageToDict(chat.template_kwargs) if chat.HasField("template_kwargs") else {}
    if chat.HasField("enable_thinking"):
        kwargs["enable_thinking"] = chat.enable_thinking
    messages = [template_message(m) for m in chat.messages]
    return tokenizer.encode_chat(messages, kwargs, tools.template_tools if tools else None, find_last_user)


@dataclass(frozen=True)
class ChatFormats:
    """How this model marks reasoning and tool calls (RouterConfig.reasoning_parser, tool_call_parser)."""

    reasoning: Markers | None = None
    tool_calls: Markers | None = None


def validate_generate(
    request: generate_pb2.GenerateRequest,
    tokenizer: ModelTokenizer | None,
    info: worker_pb2.WorkerInfo,
    formats: ChatFormats = ChatFormats(),
    limits: RequestLimits | None = None,
) -> ValidRequest:
    """Tokenize and decode the images (this may take a while: run it off the event loop) and check the
    prompt against the model. check_request must have passed. `formats` are the model's reasoning and
    tool-call formats; `limits` the router's (None: the defaults)."""
    tools = check_tools(request.chat) if request.WhichOneof("prompt") == "chat" else None
    prompt = _prompt(request, tokenizer, info.model, tools, find_last_user=info.shared_prefix_hints)
    ids, shared, images = _with_images(request, prompt, info, limits or RequestLimits())
    check_prompt(ids, info.max_model_len, info.vocab_size)
    params = _sampling_params(request.sampling, info.max_model_len - len(ids))
    if tools is not None and tools.forced is not None:
        params = _force_tool_calls(
            params, tools, formats, tokenizer.decode_tail(ids) if tokenizer else "", info
        )
    return ValidRequest(ids, params, list(request.sampling.stop), tools, shared, images.resized, images.spans)


@dataclass(frozen=True)
class _PromptImages:
    resized: tuple[ResizedImage, ...] = ()
    spans: tuple[PromptImage, ...] = ()


def _with_images(
    request: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest,
    prompt: PromptTokens,
    info: worker_pb2.WorkerInfo,
    limits: RequestLimits,
) -> tuple[list[int], int, _PromptImages]:
    """The prompt's token ids with each image's placeholder expanded to its token count, its tokens before
    the last user message's content counted after that expansion, and its images decoded and resized
    with where each lies. check_images must have passed."""
    ids, shared = prompt.token_ids, prompt.before_last_user
    parts = image_parts(request)
    vision = model_images(info)
    if not parts or vision is None:  # check_images refused images for a model without a tower
        return ids, shared, _PromptImages()
    images = tuple(decode_image(part, vision.processor, limits) for part in parts)
    check_link_size(images)
    counts = [num_tokens(image, vision.processor) for image in images]
    placeholders = [i for i, token in enumerate(ids) if token == vision.token_id]
    if len(placeholders) != len(images):
        raise ValueError(
            f"the chat rendered with {len(placeholders)} image placeholder(s) (token {vision.token_id}) "
            f"for {len(images)} image(s): the model's chat template must write one per image part"
        )
    offsets = [place + sum(counts[:k]) - k for k, place in enumerate(placeholders)]
    spans = tuple(
        PromptImage(offset, offset + count, image.content_hash)
        for offset, count, image in zip(offsets, counts, images)
    )
    # Placeholders before the last user message's content widen the tokens before it.
    shared += sum(count - 1 for place, count in zip(placeholders, counts) if place < shared)
    return expand_placeholders(ids, vision.token_id, counts), shared, _PromptImages(images, spans)


def tokenize_request(
    request: generate_pb2.TokenizeRequest,
    tokenizer: ModelTokenizer | None,
    info: worker_pb2.WorkerInfo,
    limits: RequestLimits,
) -> list[int]:
    """A Tokenize request's token ids as Generate sees them: a chat's tools shown, its images' placeholders
    expanded (the images decoded: run it off the event loop)."""
    tools = check_tools(request.chat) if request.WhichOneof("prompt") == "chat" else None
    check_images(image_parts(request), info, limits)
    prompt = _prompt(request, tokenizer, info.model, tools, find_last_user=False)
    return _with_images(request, prompt, info, limits)[0]


def _force_tool_calls(
    params: SamplingParams,
    tools: ChatTools,
    formats: ChatFormats,
    prompt_tail: str,
    info: worker_pb2.WorkerInfo,
) -> SamplingParams:
    """params under the grammar of calls to the forced tools, after the reasoning where the model
    reasons first (the prompt leaves it open, or the model may open it; not after an empty block, which is
    how a template turns thinking off)."""
    if formats.tool_calls is None:
        raise ValueError(
            f"chat.tool_choice forces a tool call, but model {info.model} has no tool-call format "
            f"(the router's --tool-call-parser)"
        )
    given = params.constraint
    if given is not None:
        raise ValueError(f"sampling.{given[0]} and a forced chat.tool_choice: one constraint at most")
    reasoning, reasoning_open = formats.reasoning, False
    if reasoning is not None:
        reasoning_open = prompt_opens_reasoning(prompt_tail, reasoning)
        if prompt_tail.rstrip().endswith(reasoning.end):
            reasoning = None
    grammar = forced_call_grammar(tools, formats.tool_calls, reasoning, reasoning_open)
    return dataclasses.replace(params, grammar=grammar)


def _sampling_params(s: generate_pb2.SamplingParams, room: int) -> SamplingParams:
    """SamplingParams (which checks every range); an unset max_tokens is the `room` the context leaves."""
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None,
        # Unset: as many as the context leaves, ending at EOS or max_model_len.
        max_tokens=s.max_tokens if s.HasField("max_tokens") else room,
        min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        json_schema=s.json_schema if s.HasField("json_schema") else None,
        json_object=s.json_object,
        regex=s.regex if s.HasField("regex") else None,
        grammar=s.grammar if s.HasField("grammar") else None,
        choice=list(s.choice.choices) if s.HasField("choice") else None,
        json_free_whitespace=s.json_free_whitespace,
    )
