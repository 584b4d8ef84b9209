"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders them, on
Jinja alone: the router imports neither transformers nor torch (docs/architecture.md#the-routers-tokenizer).

What a template sees is what transformers gives it: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the loop-control extension, a `tojson` that writes JSON without HTML escaping (and takes
`indent`, `separators`, `sort_keys`), the globals `raise_exception`, `strftime_now`, `dict` and
`namespace`, the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) beside the request's
template variables, messages without their None fields, and a message's reasoning under
`reasoning_content` and `thinking` whichever name it came under. The messages and tools are plain JSON
values here (the router builds them from a request), so nothing is left to strip for the sandbox.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning may come under; templates read the first (gpt-oss's read `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed attributes (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's tokens for training
    masks): rendered as its body, as transformers does when no mask is asked for."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled once per text (a model's; a request cannot send its own)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as a template reads it: its None fields dropped, its reasoning under every name read."""
    plain = {key: value for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in REASONING_FIELDS if plain.get(key) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    special_tokens: Mapping[str, str],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of `messages` with the generation prompt; `template_kwargs` override the special
    tokens' names where they collide, as in transformers."""
    if not messages:
        raise ValueError("a chat needs at least one message")
    variables = {**special_tokens, **(template_kwargs or {})}
    return compile_template(source).render(
        messages=[_message(m) for m in messages],
        tools=tools,
        documents=None,
        add_generation_prompt=True,
        **variables,
    )
