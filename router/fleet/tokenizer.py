"""The model's tokenizer and chat template, rebuilt from the files a worker sends (no model volume)."""

from __future__ import annotations

import functools
import inspect
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from tokenizers import Tokenizer

from nanovllm.common.v1 import worker_pb2

if TYPE_CHECKING:
    from transformers import AutoTokenizer

_import_lock = threading.Lock()


def auto_tokenizer() -> type[AutoTokenizer]:
    """transformers' AutoTokenizer. Importing it takes seconds, so the router starts that on a thread at
    once; a worker that connects meanwhile waits here for that import to finish instead of importing
    transformers from a second thread, which fails (transformers' lazy imports are not thread-safe)."""
    with _import_lock:
        from transformers import AutoTokenizer
    return AutoTokenizer


def has_tokenizer(info: worker_pb2.WorkerInfo) -> bool:
    """Whether the worker sent a tokenizer: a converted or custom model may come without one and take
    prompt token ids only."""
    return "tokenizer.json" in info.tokenizer_files or "tokenizer.model" in info.tokenizer_files


@functools.cache
def _reserved_template_kwargs(tokenizer_class: Any) -> frozenset[str]:  # a transformers tokenizer class
    """apply_chat_template's own parameters, which a template variable must not shadow."""
    parameters = inspect.signature(tokenizer_class.apply_chat_template).parameters
    return frozenset(name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD) | {"messages"}


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's tokens, and for a chat how many of them come before its last user message's content
    (0: not worked out, or no user message): what requests with the same earlier messages share."""

    token_ids: list[int]
    before_last_user: int = 0


class ModelTokenizer:
    def __init__(self, info: worker_pb2.WorkerInfo) -> None:
        """The tokenizer a worker sent; see has_tokenizer."""
        with tempfile.TemporaryDirectory(prefix="nanovllm-tokenizer-") as tmp:
            for name, data in info.tokenizer_files.items():
                (Path(tmp) / name).write_bytes(data)
            self._hf: Any = auto_tokenizer().from_pretrained(tmp)
        if info.chat_template:
            self._hf.chat_template = info.chat_template
        self.model = info.model

    @property
    def backend(self) -> Tokenizer:
        """The tokenizers-library tokenizer, for incremental decoding."""
        return self._hf.backend_tokenizer

    def decode_tail(self, token_ids: list[int], count: int = 16) -> str:
        """The text of the last `count` tokens, special tokens included: where a prompt ends."""
        return self._hf.decode(token_ids[-count:], skip_special_tokens=False)

    @functools.cached_property
    def chat_template(self) -> str:
        """The chat template's text ("" without one; a tokenizer's several named templates joined), read
        once: every chat request's format choice looks into it."""
        template = self._hf.chat_template or ""
        return "\n".join(template.values()) if isinstance(template, dict) else template

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, with the special tokens (e.g. BOS) the tokenizer adds by itself."""
        return list(self._hf.encode(text))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        find_last_user: bool = False,
    ) -> PromptTokens:
        """Render messages with the chat template plus the generation prompt, then tokenize. The template
        writes its own special tokens, so none are added on top. `template_kwargs` become the template's
        variables (Qwen3's enable_thinking); `tools` its tools (chat.tools, in the OpenAI shape). With
        `find_last_user`, also where the last user message's content begins (PromptTokens)."""
        if not self.has_chat_template:
            raise ValueError(f"the model {self.model} has no chat template; send text or token_ids instead")
        tokenizer_class: type = type(self._hf)  # not type[Any], which mypy takes for unhashable
        reserved = sorted(set(template_kwargs or ()) & _reserved_template_kwargs(tokenizer_class))
        if reserved:
            raise ValueError(
                f"chat.template_kwargs.{reserved[0]} is not a template variable: the router sets it (the "
                f"messages and generation prompt come from the request)"
            )
        try:
            text = self._render(messages, tools, template_kwargs)
        except TemplateError as exc:  # the template's own raise_exception, e.g. roles out of order
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not find_last_user or not users or not self._hf.is_fast:  # a slow tokenizer has no offsets
            return PromptTokens(list(self._hf.encode(text, add_special_tokens=False)))
        encoding = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return PromptTokens(
            list(encoding["input_ids"]),
            self._tokens_before(
                messages, users[-1], text, encoding["offset_mapping"], tools, template_kwargs
            ),
        )

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        return self._hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )

    def _tokens_before(
        self,
        messages: list[dict[str, Any]],
        index: int,
        text: str,
        offsets: list[tuple[int, int]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> int:
        """How many of the tokens of `text` (the chat rendered; `offsets`, their characters) come before
        the content of message `index`. The messages are rendered again with another content there, one
        character that differs from the content's first: the two texts agree up to where it begins.
        Whatever a template does with the messages, the count is of tokens the prompt starts with; a
        template that renders the earlier messages differently for the other content (Qwen3's looks for
        tool responses in the last query) makes it smaller."""
        content = messages[index]["content"]
        marker = "\x01" if content.startswith("\x00") else "\x00"
        marked = [*messages[:index], {**messages[index], "content": marker}, *messages[index + 1 :]]
        try:
            other = self._render(marked, tools, template_kwargs)
        except TemplateError:  # the template refuses the marker: no count
            return 0
        common = len(os.path.commonprefix([text, other]))
        return next((i for i, (_, end) in enumerate(offsets) if end > common), len(offsets))
