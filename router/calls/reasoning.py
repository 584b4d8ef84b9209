"""Reasoning kept apart from the answer: a model that thinks before it answers (Qwen3 writes
`<think>...</think>` first) streams both as one text; the router sends the thoughts as `reasoning_text` and
the answer as `text`.

The split runs on the text TextStream releases (stop strings already applied), one delta at a time, so a
marker may arrive cut anywhere: inside a token, across tokens, across responses. A tail that could still
grow into the marker awaited is held back until it does or cannot; `finish` releases it as it stands.

Rules, per completion:
- Reasoning opens when the completion starts with the start marker (after whitespace), or at once when the
  prompt itself ends inside an open reasoning block (a template that writes `<think>` for the model).
  Anything else first means the model answers without reasoning: all of it is answer, markers included.
- Reasoning closes at the first end marker; later markers are answer text.
- The newlines that templates and models put around the markers (`<think>\\n`, `\\n</think>\\n\\n`) are
  dropped; other whitespace is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from nanovllm.router.calls.markers import Markers, choose_markers, marker_prefix_length

_FORMATS = {"qwen3": Markers("qwen3", "<think>", "</think>")}
# Model families whose chat templates reason in <think> markers, by Hugging Face architecture: Qwen3, and
# Qwen3.5 (and 3.6 and 3.8, which declare it), published multimodal and text-only.
_FAMILIES = dict.fromkeys(
    (
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    ),
    "qwen3",
)  # fmt: skip


def reasoning_format(setting: str, architectures: Sequence[str]) -> Markers | None:
    """The format the router splits with (RouterConfig.reasoning_parser): chosen from the model's
    architecture under "auto", or named ("none" turns the split off)."""
    return choose_markers(setting, architectures, _FORMATS, _FAMILIES)


def prompt_opens_reasoning(prompt_tail: str, fmt: Markers) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a reasoning block open for the model to fill."""
    return prompt_tail.rfind(fmt.start) > prompt_tail.rfind(fmt.end)


class _State(Enum):
    OPENING = "opening"  # at the start: the reasoning may still open
    REASONING = "reasoning"
    ANSWER = "answer"


class ReasoningSplit:
    def __init__(self, fmt: Markers, in_reasoning: bool = False) -> None:
        """in_reasoning: the prompt left a reasoning block open (see prompt_opens_reasoning)."""
        self._fmt = fmt
        self._state = _State.REASONING if in_reasoning else _State.OPENING
        self._at_reasoning_start = in_reasoning  # newlines here are the marker's, not the reasoning's
        self._at_answer_start = False
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """Feed released text; returns (reasoning, answer) now safe to send, either possibly empty."""
        self._held += text
        reasoning, answer = "", ""
        if self._state is _State.OPENING:
            stripped = self._held.lstrip()
            if self._fmt.start.startswith(stripped):  # still a prefix of the marker (or only whitespace)
                return "", ""
            if stripped.startswith(self._fmt.start):
                self._held = stripped[len(self._fmt.start) :]
                self._state, self._at_reasoning_start = _State.REASONING, True
            else:
                self._state = _State.ANSWER
        if self._state is _State.REASONING:
            if self._at_reasoning_start:
                self._held = self._held.lstrip("\n")
                self._at_reasoning_start = not self._held
            end = self._held.find(self._fmt.end)
            if end < 0:
                # Keep back what may be the end marker's start, and the newlines that would go before it.
                keep = marker_prefix_length(self._held, self._fmt.end)
                body = self._held[: len(self._held) - keep]
                body_kept = body.rstrip("\n")
                reasoning = body_kept
                self._held = self._held[len(body_kept) :]
                return reasoning, ""
            reasoning = self._held[:end].rstrip("\n")
            self._held = self._held[end + len(self._fmt.end) :]
            self._state, self._at_answer_start = _State.ANSWER, True
        if self._at_answer_start:
            self._held = self._held.lstrip("\n")
            self._at_answer_start = not self._held
        answer, self._held = self._held, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """The completion ended: what was held back, as the state it was in reads it (a stream cut inside
        the reasoning ends with reasoning)."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            return held, ""
        return "", held
