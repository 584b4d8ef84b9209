"""The model's tokenizer and chat template, rebuilt from the files a worker sends (no model volume), on the
tokenizers library and Jinja alone: the router imports neither transformers nor torch
(docs/architecture.md#the-routers-tokenizer). A worker whose model has no tokenizer.json sends one converted by transformers."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from tokenizers import AddedToken, Tokenizer, processors

from nanovllm.common.v1 import worker_pb2
from nanovllm.router.fleet.chat_template import render_chat

# The tokenizer's named special tokens, which chat templates read by these names (transformers' list).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names transformers' apply_chat_template takes for itself, so a template variable of one of them would
# render differently there: refused, as the router sets the messages and the generation prompt.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def has_tokenizer(info: worker_pb2.WorkerInfo) -> bool:
    """Whether the worker sent a tokenizer: a converted or custom model may come without one and take
    prompt token ids only."""
    return "tokenizer.json" in info.tokenizer_files


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's tokens, and for a chat how many of them come before its last user message's content
    (0: not worked out, or no user message): what requests with the same earlier messages share."""

    token_ids: list[int]
    before_last_user: int = 0


class ModelTokenizer:
    def __init__(self, info: worker_pb2.WorkerInfo) -> None:
        """The tokenizer a worker sent (see has_tokenizer), set up as transformers sets up the same files:
        the named special tokens added where tokenizer.json lacks them, and the BOS/EOS a plain text gets
        from tokenizer_config.json's add_bos_token / add_eos_token when it names them."""
        files = info.tokenizer_files
        config: dict[str, Any] = (
            json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        )
        named = json.loads(files["special_tokens_map.json"]) if "special_tokens_map.json" in files else {}
        try:
            self.backend = Tokenizer.from_str(files["tokenizer.json"].decode())
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception, its message all it says
            raise ValueError(f"the tokenizer.json of model {info.model} cannot be read: {exc}") from None
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name, named.get(name)))) is not None
        }
        vocab = self.backend.get_vocab(with_added_tokens=True)
        missing = [
            AddedToken(t, special=True, normalized=False)
            for t in self.special_tokens.values()
            if t not in vocab
        ]
        if missing:
            self.backend.add_special_tokens(missing)
        if "add_bos_token" in config or "add_eos_token" in config or self.backend.post_processor is None:
            self._set_post_processor(bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
        jinja = files["chat_template.jinja"].decode() if "chat_template.jinja" in files else ""
        if not jinja and "chat_template.json" in files:  # the older file of the same template
            jinja = json.loads(files["chat_template.json"]).get("chat_template", "")
        self.templates = self._templates(info.chat_template or jinja, config.get("chat_template"))
        self.model = info.model

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """What transformers' fast tokenizers do with those two settings: BOS before and EOS after a text."""
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
        pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
        special = [(t, self.backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t]
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )

    @staticmethod
    def _templates(sent: str, configured: object) -> dict[str, str]:
        """The model's chat templates by name: its chat_template.jinja (the worker's field, or the file) as
        "default", or tokenizer_config.json's one template or list of named ones."""
        if sent:
            return {"default": sent}
        if isinstance(configured, str):
            return {"default": configured}
        if isinstance(configured, list):
            return {t["name"]: t["template"] for t in configured if isinstance(t, dict) and "name" in t}
        return {}

    def _template(self, tools: list[dict[str, Any]] | None) -> str:
        """As transformers picks: the one template, or "tool_use" when tools are given and it has one,
        else "default"."""
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" not in self.templates:
            raise ValueError(
                f"the model {self.model} has chat templates {sorted(self.templates)} but none named 'default'"
            )
        return self.templates["default"]

    def decode_tail(self, token_ids: list[int], count: int = 16) -> str:
        """The text of the last `count` tokens, special tokens included: where a prompt ends."""
        return self.backend.decode(token_ids[-count:], skip_special_tokens=False)

    @functools.cached_property
    def chat_template(self) -> str:
        """The chat template's text ("" without one; a tokenizer's several named templates joined), read
        once: every chat request's format choice looks into it."""
        return "\n".join(self.templates.values())

    @property
    def has_chat_template(self) -> bool:
        return bool(self.templates)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, with the special tokens (e.g. BOS) the tokenizer adds by itself."""
        return list(self.backend.encode(text).ids)

    def single_token(self, word: str) -> int:
        """The id of `word` spelled as one token (a reranker's "yes"), else ValueError."""
        ids = self.backend.encode(word, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"the tokenizer spells {word!r} as {len(ids)} tokens {list(ids)}, not one")
        return ids[0]

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
        reserved = sorted(set(template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"chat.template_kwargs.{reserved[0]} is not a template variable: the router sets it (the "
                f"messages and generation prompt come from the request)"
            )
        try:
            text = self._render(messages, tools, template_kwargs)
        except TemplateError as exc:  # the template's own raise_exception, e.g. roles out of order
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc
        encoding = self.backend.encode(text, add_special_tokens=False)
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not find_last_user or not users:
            return PromptTokens(list(encoding.ids))
        before = self._tokens_before(messages, users[-1], text, encoding.offsets, tools, template_kwargs)
        return PromptTokens(list(encoding.ids), before)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        return render_chat(self._template(tools), messages, self.special_tokens, tools, template_kwargs)

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
        if not isinstance(content, str):  # parts: the first one's text (an image's placeholder is no NUL)
            content = content[0].get("text", "") if content else ""
        marker = "\x01" if content.startswith("\x00") else "\x00"
        marked = [*messages[:index], {**messages[index], "content": marker}, *messages[index + 1 :]]
        try:
            other = self._render(marked, tools, template_kwargs)
        except TemplateError:  # the template refuses the marker: no count
            return 0
        common = len(os.path.commonprefix([text, other]))
        return next((i for i, (_, end) in enumerate(offsets) if end > common), len(offsets))
