"""The model's tokenizer and chat template, rebuilt from the files a worker sends (no model volume)."""

from __future__ import annotations

import functools
import inspect
import tempfile
import threading
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

    @property
    def chat_template(self) -> str:
        """The chat template's text ("" without one; a tokenizer's several named templates joined)."""
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
    ) -> list[int]:
        """Render messages with the chat template plus the generation prompt, then tokenize. The template
        writes its own special tokens, so none are added on top. `template_kwargs` become the template's
        variables (Qwen3's enable_thinking); `tools` its tools (chat.tools, in the OpenAI shape)."""
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
            text = self._hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
            )
        except TemplateError as exc:  # the template's own raise_exception, e.g. roles out of order
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc
        return list(self._hf.encode(text, add_special_tokens=False))
