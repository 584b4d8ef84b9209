"""Qwen3.5's tool-call format (vLLM's parser for it is named `qwen3_coder`): a call is XML-like markup
between the same `<tool_call>` lines as Hermes', each argument's value written raw, not as JSON:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value becomes the JSON type its parameter's schema declares: a string stays as written; integer, number,
boolean, object and array values are read as JSON (booleans also as True/False); a value that does not
read as its declared type, or a parameter the schema does not declare a type for, stays a string, as
written. One newline after `<parameter=...>` and one before `</parameter>` are the markup's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_CALL = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")


def _declared_type(schema: Mapping[str, Any], name: str) -> str | None:
    kind = schema.get("properties", {}).get(name, {}).get("type")
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def _value(text: str, kind: str | None) -> Any:
    if kind not in _JSON_TYPES:
        return text
    if kind == "boolean" and text.strip() in ("True", "False"):
        return text.strip() == "True"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    matches = {
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "null": value is None,
    }
    return value if matches[kind] else text


def parse_call(body: str, schemas: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The (tool name, arguments) of a call's body (the text between its markers); None when it is not
    one call of one of `schemas`' tools with nothing but parameters inside."""
    call = _CALL.fullmatch(body)
    if call is None or call.group(1) not in schemas:
        return None
    name, inside = call.group(1), call.group(2)
    arguments: dict[str, Any] = {}
    at = 0
    for parameter in _PARAMETER.finditer(inside):
        if parameter.start() != at:
            return None  # text between parameters
        key = parameter.group(1)
        arguments[key] = _value(parameter.group(2), _declared_type(schemas[name], key))
        at = parameter.end()
    if inside[at:].strip():
        return None
    return name, arguments


def _string_rule(spec: Any) -> str:  # a property's schema: an object, or a boolean
    """A string value and its end: one of its `enum` (or its `const`) as written; a length within its
    `minLength`/`maxLength`, on one line; else any text without "<" (how the grammar finds its end; the
    newline before </parameter> is the regex's then: a literal would race it). A `pattern` is not
    enforced."""
    if not isinstance(spec, Mapping):  # a boolean schema
        return '/[^<]*/ "</parameter>\\n"'
    options = spec.get("enum", [spec["const"]] if "const" in spec else None)
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return f'({" | ".join(json.dumps(o) for o in options)}) "\\n</parameter>\\n"'
    low, high = spec.get("minLength"), spec.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        bounds = f"{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}"
        return f'/[^<\\n]{{{bounds}}}/ "\\n</parameter>\\n"'
    return '/[^<]*/ "</parameter>\\n"'


def call_rules(names: list[str], schemas: Mapping[str, Mapping[str, Any]]) -> str:
    """Lark rules (llguidance's dialect) for one `call` of one of `names`, in this format: its schema's
    parameters in order, the required ones always, each value under its own schema (JSON for the JSON
    types; a string as written, see _string_rule)."""
    rules = [f"call: {' | '.join(f'call{i}' for i in range(len(names)))}"]
    for i, name in enumerate(names):
        schema = schemas[name]
        required = set(schema.get("required", []))
        parts = []
        for j, (key, spec) in enumerate(schema.get("properties", {}).items()):
            kind = _declared_type(schema, key)
            if kind in _JSON_TYPES:  # one line, no whitespace free to pad it with
                strict = {**spec, "x-guidance": {"whitespace_flexible": False}}
                value = f'%json {json.dumps(strict)} "\\n</parameter>\\n"'
            else:
                value = _string_rule(spec)
            rules.append(f"p{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {value}")
            parts.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
        head = json.dumps(f"<tool_call>\n<function={name}>\n")
        rules.append(f'call{i}: {head} {" ".join(parts)} "</function>\\n</tool_call>"')
    return "\n".join(rules) + "\n"
