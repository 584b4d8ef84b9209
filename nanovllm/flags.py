"""Command-line flags made from config dataclasses: each field declared with `option`
(common/options.py) becomes a flag, read from the command line, else from NANOVLLM_<FLAG>, else its
default, and `build` turns the resolved values back into the dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nanovllm.common.options import flag_name

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Flag:
    name: str  # e.g. "--max-num-seqs"
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    # "value"; "switch" (a boolean); "tristate" (a boolean or None for auto: --X sets it, --no-X clears it);
    # "list" (repeatable; comma-separated in the environment)
    kind: str = "value"
    required: bool = False
    field: str = ""  # the config field it sets; a switch with `negate` sets it to the switch's opposite
    negate: bool = False

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "NANOVLLM_" + self.dest.upper()

    @property
    def off_name(self) -> str:
        """A tristate's second flag, e.g. --no-deterministic."""
        return "--no-" + self.name.removeprefix("--")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        shown = "" if self.default in (None, False, []) else f"; default {self.default}"
        help_text = f"{self.help} [env {self.env}{shown}]".replace("%", "%%")  # argparse formats help with %
        if self.kind == "switch":
            parser.add_argument(self.name, action="store_true", default=None, help=help_text)
        elif self.kind == "tristate":
            parser.add_argument(
                self.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif self.kind == "list":
            parser.add_argument(self.name, action="append", type=self.type, help=help_text)
        else:
            parser.add_argument(self.name, type=self.type, help=help_text)

    def resolve(self, value: Any) -> Any:
        """The command line's value, else the environment's, else the default."""
        if value is not None:
            return value
        raw = os.environ.get(self.env)
        if raw is None or raw == "":
            if self.required:
                raise SystemExit(f"nanovllm: {self.name} is required (or set {self.env})")
            return self.default
        if self.kind == "switch":
            return raw.strip().lower() in TRUE_WORDS
        if self.kind == "tristate":
            word = raw.strip().lower()
            if word not in TRUE_WORDS + FALSE_WORDS + ("auto",):
                raise SystemExit(f"nanovllm: {self.env}={raw!r} is not on, off or auto ({self.name})")
            return None if word == "auto" else word in TRUE_WORDS
        try:
            if self.kind == "list":
                return [self.type(item.strip()) for item in raw.split(",") if item.strip()]
            return self.type(raw)
        except ValueError as exc:
            raise SystemExit(f"nanovllm: {self.env}={raw!r} is not a valid {self.name}: {exc}") from exc


def _kind(hint: Any) -> tuple[str, Callable[[str], Any]]:
    """The flag kind and value parser for a field's type: int, float, str, bool, bool | None (a tristate),
    list[str], X | None (the first of a union's types: kv_cache_memory's str | int | float is given as a
    string)."""
    if hint == bool | None:
        return "tristate", bool
    if isinstance(hint, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is list:
        return "list", typing.get_args(hint)[0]
    return ("switch", bool) if hint is bool else ("value", hint)


def flags_of(cls: type, only: Sequence[str] = (), defaults: dict[str, Any] | None = None) -> list[Flag]:
    """The flags of `cls`'s fields declared with `option` (those in `only`, when given)."""
    hints = typing.get_type_hints(cls)
    flags = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or (only and f.name not in only):
            continue
        kind, parse = _kind(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING and not f.metadata["required"]:
            default = f.default_factory()
        else:
            default = None
        if f.metadata["negate"]:
            kind, default = "switch", False
        flags.append(
            Flag(
                name=flag_name(cls, f.name),
                help=f.metadata["help"],
                type=parse,
                default=(defaults or {}).get(f.name, default),
                kind=kind,
                required=f.metadata["required"],
                field=f.name,
                negate=f.metadata["negate"],
            )
        )
    return flags


def build(cls: type, options: dict[str, Any], **given: Any) -> Any:
    """An instance of `cls` from the resolved options of its flags; `given` fields override them."""
    values = {f.field: (not options[f.dest]) if f.negate else options[f.dest] for f in flags_of(cls)}
    return cls(**{**values, **given})


def resolve_all(flags: Sequence[Flag], args: argparse.Namespace) -> dict[str, Any]:
    return {flag.dest: flag.resolve(getattr(args, flag.dest)) for flag in flags}
