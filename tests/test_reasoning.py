"""Reasoning kept apart from the answer (router/calls/reasoning.py): the split on scripted text and token streams
(no model), Qwen3's real chat template with thinking on and off, and the router's responses end to end."""

from __future__ import annotations

import itertools
import subprocess
import sys

import grpc
import pytest
from google.protobuf import struct_pb2

from nanovllm.common.errors import ConfigError
from nanovllm.common.server_config import RouterConfig
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.calls.completion import CompletionText
from nanovllm.router.calls.generate_replies import build_response, failed_response, merge_responses
from nanovllm.router.calls.reasoning import ReasoningSplit, prompt_opens_reasoning, reasoning_format
from nanovllm.router.calls.text_stream import TextStream
from nanovllm.router.calls.validation import prompt_token_ids
from nanovllm.router.fleet.tokenizer import ModelTokenizer
from nanovllm.v1 import generate_pb2
from tests.helpers import cuts
from tests.model_factory import build_tokenizer
from tests.services import collect

QWEN3_FORMAT = reasoning_format("qwen3", [])
THOUGHT = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


def split_all(pieces: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    """Push the pieces one by one, then finish; the concatenated (reasoning, answer)."""
    split = ReasoningSplit(QWEN3_FORMAT, in_reasoning)
    outs = [split.push(piece) for piece in pieces] + [split.finish()]
    return "".join(r for r, _ in outs), "".join(a for _, a in outs)


# --- the split on text ----------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2])
def test_every_cut_gives_the_same_split(count) -> None:
    """Markers and their newlines cut anywhere, in one or two places (inside a marker, between its
    characters and the newlines around it)."""
    for pieces in cuts(THOUGHT, count):
        assert split_all(pieces) == ("The user greets me.\nI greet back.", "Hello there!"), pieces


def test_character_at_a_time_never_sends_a_marker_or_its_newlines() -> None:
    split = ReasoningSplit(QWEN3_FORMAT)
    sent = [split.push(c) for c in THOUGHT] + [split.finish()]
    reasoning = [r for r, _ in sent if r]
    assert "".join(reasoning) == "The user greets me.\nI greet back."
    assert not any("<" in r or ">" in r for r in reasoning)
    # Reasoning streams as it comes, not all at the end: released before the end marker arrived.
    end_at = THOUGHT.index("</think>")
    assert "".join(r for r, _ in sent[:end_at]) == "The user greets me.\nI greet back."


def test_a_text_without_reasoning_is_unchanged_byte_for_byte() -> None:
    for text in ["Hello <think> there", "  \n leading space", "<thinking about it>", "<", "<thi", "", "\n\n"]:
        for pieces in cuts(text, 1):
            assert split_all(pieces) == ("", text), pieces


def test_reasoning_only_stream_and_a_stream_cut_inside_the_reasoning() -> None:
    assert split_all(["<think>\nstill thinking"]) == ("still thinking", "")
    # Cut inside the end marker: what was held back is released as the reasoning it was.
    assert split_all(["<think>\nalmost\n</thi"]) == ("almost\n</thi", "")
    # Cut inside the start marker: it never opened, so it is answer text.
    assert split_all(["  <thi"]) == ("", "  <thi")


def test_only_the_first_end_marker_closes_and_later_markers_are_answer() -> None:
    text = "<think>a</think>b<think>c</think>d"
    assert split_all([text]) == ("a", "b<think>c</think>d")


def test_a_prompt_that_opens_the_reasoning() -> None:
    """A template that writes <think> for the model: the completion starts inside the reasoning."""
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", QWEN3_FORMAT)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", QWEN3_FORMAT)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", QWEN3_FORMAT)
    for pieces in cuts("\nweighing it\n</think>\n\nyes", 1):
        assert split_all(pieces, in_reasoning=True) == ("weighing it", "yes"), pieces


def test_format_follows_the_model_and_the_flag() -> None:
    assert reasoning_format("auto", ["Qwen3ForCausalLM"]) == QWEN3_FORMAT
    assert reasoning_format("auto", ["Qwen3MoeForCausalLM"]) == QWEN3_FORMAT
    for qwen3_5 in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration"):
        assert reasoning_format("auto", [qwen3_5]) == QWEN3_FORMAT  # the same <think> markers
    assert reasoning_format("auto", ["LlamaForCausalLM"]) is None
    assert reasoning_format("none", ["Qwen3ForCausalLM"]) is None
    assert reasoning_format("qwen3", ["LlamaForCausalLM"]) == QWEN3_FORMAT
    with pytest.raises(ConfigError, match="--reasoning-parser must be one of auto, none, qwen3, got 'r1'"):
        RouterConfig(workers=["w:1"], reasoning_parser="r1")


# --- the split on token streams through the router's responses -----------------------------------------


@pytest.fixture(scope="module")
def backend():
    return build_tokenizer().backend_tokenizer


def responses_for(backend, ids: list[int], group: list[int], stop=(), finish=True):
    """The router's responses for `ids` arriving in updates of `group[i]` tokens, merged pairwise as a
    lagging stream merges them; the last update finishes the request unless a stop string did."""
    stream, split = TextStream(backend, stop), ReasoningSplit(QWEN3_FORMAT)
    completion = CompletionText(stream, split)
    out, start = [], 0
    for i, size in enumerate(group):
        chunk = ids[start : start + size]
        start += size
        last = start >= len(ids)
        update = worker_pb2.RequestUpdate(
            new_token_ids=chunk,
            finish_reason=worker_pb2.FINISH_REASON_STOP if last and finish else 0,
        )
        response = build_response(update, completion, "r", True, start, 0)
        if i % 2 and out and response is not None and not out[-1].finish_reason:
            out[-1] = merge_responses(out[-1], response)
        elif response is not None:
            out.append(response)
        if response is not None and response.finish_reason:
            break
    return out, stream, split


@pytest.mark.parametrize("sizes", [(1,), (2,), (3,), (1, 4, 2)])
def test_token_streams_split_markers_inside_and_across_tokens_and_responses(backend, sizes) -> None:
    ids = backend.encode(THOUGHT).ids
    assert len(ids) > len(backend.encode("<think>").ids) > 1  # the markers do span several tokens
    group = list(itertools.islice(itertools.cycle(sizes), len(ids)))
    out, _, _ = responses_for(backend, ids, group)
    assert "".join(r.reasoning_text for r in out) == "The user greets me.\nI greet back."
    assert "".join(r.text for r in out) == "Hello there!"
    assert [t for r in out for t in r.token_ids] == ids[: sum(len(r.token_ids) for r in out)]
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_STOP


def test_a_stop_string_inside_the_reasoning_ends_it_there(backend) -> None:
    ids = backend.encode(THOUGHT).ids
    out, stream, _ = responses_for(backend, ids, [1] * len(ids), stop=["greet back"])
    assert stream.stopped
    assert "".join(r.reasoning_text for r in out) == "The user greets me.\nI "
    assert "".join(r.text for r in out) == ""
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_STOP


def test_an_engine_error_inside_the_reasoning_releases_it_as_reasoning(backend) -> None:
    ids = backend.encode("<think>\nhalf a tho").ids
    completion = CompletionText(TextStream(backend), ReasoningSplit(QWEN3_FORMAT))
    sent = build_response(worker_pb2.RequestUpdate(new_token_ids=ids), completion, "r", False, len(ids), 0)
    last = failed_response("r", completion, "boom")
    assert (sent.reasoning_text if sent else "") + last.reasoning_text == "half a tho"
    assert last.text == "" and last.finish_reason == generate_pb2.FINISH_REASON_ERROR


# --- Qwen3's chat template ------------------------------------------------------------------------------


def render(tokenizer: ModelTokenizer, chat: generate_pb2.Chat) -> str:
    ids = prompt_token_ids(generate_pb2.GenerateRequest(chat=chat), tokenizer, "qwen3-test")
    return tokenizer.decode_tail(ids, len(ids))


def test_enable_thinking_false_renders_qwen3s_no_think_prompt(qwen3_tokenizer) -> None:
    messages = [generate_pb2.ChatMessage(role="user", content="Hi")]
    thinking = render(qwen3_tokenizer, generate_pb2.Chat(messages=messages))
    assert thinking == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    off = render(qwen3_tokenizer, generate_pb2.Chat(messages=messages, enable_thinking=False))
    assert off == thinking + "<think>\n\n</think>\n\n"
    assert not prompt_opens_reasoning(off, QWEN3_FORMAT)
    # The same through template_kwargs; enable_thinking itself wins over a kwarg of its name.
    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": False})
    assert render(qwen3_tokenizer, generate_pb2.Chat(messages=messages, template_kwargs=kwargs)) == off
    on = generate_pb2.Chat(messages=messages, template_kwargs=kwargs, enable_thinking=True)
    assert render(qwen3_tokenizer, on) == thinking


@pytest.mark.parametrize("key", ["add_generation_prompt", "messages", "tokenize"])
def test_template_kwargs_cannot_shadow_the_routers_own(qwen3_tokenizer, key) -> None:
    kwargs = struct_pb2.Struct()
    kwargs.update({key: True})
    chat = generate_pb2.Chat(
        messages=[generate_pb2.ChatMessage(role="user", content="Hi")], template_kwargs=kwargs
    )
    with pytest.raises(ValueError, match=f"chat.template_kwargs.{key} is not a template variable"):
        render(qwen3_tokenizer, chat)


# --- end to end: router and worker ----------------------------------------------------------------------


def forced(regex: str, **chat) -> generate_pb2.GenerateRequest:
    """A chat request whose output is forced to match `regex` (the random model says what we need)."""
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=60, regex=regex)
    chat = generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="Hi")], **chat)
    return generate_pb2.GenerateRequest(chat=chat, sampling=sampling)


def test_router_streams_reasoning_apart_from_the_answer(service) -> None:
    """The random Qwen3 model forced to write a reasoning block (markers in ordinary tokens): the router,
    choosing the qwen3 format from the architecture, streams the reasoning as reasoning_text."""
    responses, error = collect(service.router.address, forced("<think>\nplan it\n</think>\n\nyes"))
    assert error is None, error
    assert "".join(r.reasoning_text for r in responses) == "plan it"
    assert "".join(r.text for r in responses) == "yes"
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_STOP


def test_a_reserved_template_kwarg_is_invalid_argument(service) -> None:
    kwargs = struct_pb2.Struct()
    kwargs.update({"add_generation_prompt": False})
    _, error = collect(service.router.address, forced("x", template_kwargs=kwargs))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.template_kwargs.add_generation_prompt" in error.details()


def test_client_prints_the_reasoning_on_stderr_and_the_answer_on_stdout(service) -> None:
    """`nanovllm client`: stdout carries the answer alone (pipe-friendly), the reasoning goes to stderr
    (dimmed on a terminal). --no-think is accepted here; this model's template has no thinking switch,
    and the rendering of enable_thinking=false is tested above with Qwen3's."""
    client = subprocess.run(
        [sys.executable, "-m", "nanovllm.cli", "client", "--router", service.router.address, "--no-think"]
        + ["--regex", "<think>\nplan it\n</think>\n\nyes", "Hi"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert client.stdout == "yes\n"
    assert client.stderr.startswith("plan it") and "[stop:" in client.stderr
