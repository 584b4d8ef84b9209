"""The router's tokenizer and chat templates on the tokenizers library and Jinja alone
(router/fleet/tokenizer.py, router/fleet/chat_template.py): the same prompt text and token ids as
transformers' `apply_chat_template` and `encode` on the same files, for the templates the tests use
(ChatML, Qwen3's, Qwen3.5's, and the embedded SmolLM2's with its own tokenizer), with tools, reasoning
switches and multi-turn histories; and a router that never imports transformers or torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nanovllm.common.v1 import worker_pb2
from nanovllm.router.fleet.tokenizer import ModelTokenizer
from tests.chat_templates import QWEN3, QWEN3_5
from tests.model_factory import CHAT_TEMPLATE, build_tokenizer

QWEN_MARKERS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'The weather in a city, "now" <or> later & beyond: é',
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "enum": [1, 2]}},
            "required": ["city"],
        },
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CHATS = {
    "one turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system and turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  Spaces, tabs\tand\nnew lines; unicode: ü 日本 🙂"},
    ],
    "reasoning and tools": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call it.", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "Read the result."},
        {"role": "user", "content": "And tomorrow?"},
    ],
}
SWITCHES = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"preserve_thinking": True}]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.suffix != ".safetensors"}


def _test_tokenizer(template: str, root: Path) -> Path:
    hf = build_tokenizer(template)
    if template != CHAT_TEMPLATE:
        hf.add_tokens(QWEN_MARKERS)
    hf.save_pretrained(root)
    return root


@pytest.fixture(scope="module", params=["chatml", "qwen3", "qwen3_5", "smollm2"])
def tokenizers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers' tokenizer, the router's) over the same files, as a worker sends them."""
    if request.param == "smollm2":
        directory = request.getfixturevalue("smollm2_dir")
    else:
        template = {"chatml": CHAT_TEMPLATE, "qwen3": QWEN3, "qwen3_5": QWEN3_5}[request.param]
        directory = _test_tokenizer(template, tmp_path_factory.mktemp(request.param))
    chat_template = directory / "chat_template.jinja"
    info = worker_pb2.WorkerInfo(
        model=request.param,
        tokenizer_files=_files(directory),
        chat_template=chat_template.read_text() if chat_template.is_file() else "",
    )
    return AutoTokenizer.from_pretrained(directory), ModelTokenizer(info)


@pytest.mark.parametrize("chat", CHATS)
def test_prompt_text_and_ids_equal_transformers(tokenizers, chat: str) -> None:
    hf, ours = tokenizers
    for tools in (None, [WEATHER]):
        for switches in SWITCHES:
            messages = json.loads(json.dumps(CHATS[chat]))  # fresh copies: neither side may edit them
            expected = hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True, **switches
            )
            text = ours._render(json.loads(json.dumps(CHATS[chat])), tools, switches)
            assert text == expected, (chat, tools, switches)
            ids = ours.encode_chat(json.loads(json.dumps(CHATS[chat])), switches, tools).token_ids
            assert ids == hf.encode(expected, add_special_tokens=False), (chat, tools, switches)


def test_plain_text_ids_and_decoding_equal_transformers(tokenizers) -> None:
    """Plain text with the special tokens the tokenizer adds by itself (SmolLM2's none, as transformers
    reads its config), special tokens written in the text, and decoding with and without them."""
    hf, ours = tokenizers
    texts = ["Hello world", "  leading spaces", "<|im_start|>user\nHi<|im_end|>", "ü 日本 🙂 <eos>", ""]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        for skip in (False, True):
            assert ours.backend.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.special_tokens == hf.special_tokens_map


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path: Path) -> None:
    """tokenizer_config.json's list of named templates, as some models ship it: "tool_use" for a chat
    with tools, "default" otherwise, as transformers picks."""
    directory = _test_tokenizer(CHAT_TEMPLATE, tmp_path / "named")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = ModelTokenizer(worker_pb2.WorkerInfo(model="named", tokenizer_files=_files(directory)))
    hf = AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "user", "content": "Hi"}]
    for tools in (None, [WEATHER]):
        expected = hf.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours._render(chat, tools, None) == expected
    assert ours._render(chat, None, None) == "plain:Hi"


# Never in a router process: torch and transformers; until a call needs them (they cost its start 0.1-0.15 s
# each): numpy, jsonschema (a chat with tools), dnspython (a dns:// target), the tracing SDK (tracing on).
NOT_IMPORTED_AT_START = ("torch", "transformers", "numpy", "jsonschema", "dns", "opentelemetry.sdk")


def test_the_router_imports_neither_transformers_nor_torch(tmp_path: Path) -> None:
    """The router's entry point, and a chat rendered and tokenized by it, in a fresh interpreter, has
    loaded none of NOT_IMPORTED_AT_START."""
    directory = _test_tokenizer(QWEN3, tmp_path / "qwen3")
    script = f"""
import sys
from pathlib import Path
import nanovllm.cli, nanovllm.router.faces.server
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.fleet.tokenizer import ModelTokenizer
files = {{p.name: p.read_bytes() for p in Path({str(directory)!r}).iterdir() if p.is_file()}}
tokenizer = ModelTokenizer(worker_pb2.WorkerInfo(model="m", tokenizer_files=files))
assert tokenizer.encode_chat([{{"role": "user", "content": "Hi"}}]).token_ids
print(sorted(m for m in {NOT_IMPORTED_AT_START!r} if m in sys.modules))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_model_without_tokenizer_json_gets_one_from_its_worker(tmp_path: Path) -> None:
    """A byte-level BPE shipped as vocab.json and merges.txt: the worker converts it with transformers,
    and the router's tokenizer over that file encodes as transformers does over the originals."""
    from nanovllm.worker.service.server import _converted_tokenizer

    directory = _test_tokenizer(QWEN3, tmp_path / "bpe")
    AutoTokenizer.from_pretrained(directory).backend_tokenizer.model.save(str(directory))
    (directory / "tokenizer.json").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"})
    )
    hf = AutoTokenizer.from_pretrained(directory)
    files = {**_files(directory), **_converted_tokenizer(directory)}
    ours = ModelTokenizer(worker_pb2.WorkerInfo(model="bpe", tokenizer_files=files))
    chat = [{"role": "user", "content": "Hello world, ü 日本"}]
    expected = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(chat).token_ids == list(expected)
