"""Config fields that are also command-line flags. One declaration gives the dataclass field, its default,
the flag (`--field-name` unless `flag` says otherwise), its NANOVLLM_* environment variable and its help
text; nanovllm/cli.py builds the commands from them. Fields declared without `option` are not flags."""

from __future__ import annotations

from dataclasses import MISSING, field, fields
from typing import Any


def option(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | None = None,
    negate: bool = False,
    required: bool = False,
    default_factory: Any = MISSING,
) -> Any:
    """`negate`: a boolean field set through a switch that turns it off (e.g. --no-prefix-caching for
    enable_prefix_caching). `required`: the command fails without it (flag or environment)."""
    metadata = {"help": help, "flag": flag, "negate": negate, "required": required}
    return field(default=default, default_factory=default_factory, metadata=metadata)


def flag_name(cls: type, name: str) -> str:
    """The command-line flag of `cls`'s option field `name`, e.g. "--worker-tls-cert"."""
    declared = next(f for f in fields(cls) if f.name == name)
    return declared.metadata["flag"] or "--" + name.replace("_", "-")
