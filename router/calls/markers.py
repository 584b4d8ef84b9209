"""Spans a model marks in its text (reasoning, tool calls): each model family's markers, chosen by
architecture or by name, and how much of a streamed tail to hold back while a marker may still be
arriving."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Markers:
    """One format's start and end markers (`name` is its --*-parser value)."""

    name: str
    start: str
    end: str


def choose_markers(
    setting: str, architectures: Sequence[str], formats: Mapping[str, Markers], families: Mapping[str, str]
) -> Markers | None:
    """The format a router flag selects: under "auto" the one the model's architecture is listed with in
    `families` (architecture -> format name), None when it is not; else the one named ("none": None)."""
    if setting == "auto":
        name = next((families[a] for a in architectures if a in families), None)
        return None if name is None else formats[name]
    return formats.get(setting)


def marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: what to hold back."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
