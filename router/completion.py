"""A completion's text as the client receives it: token ids decoded (with stop strings), then the
reasoning split from the answer, then tool calls parsed out of the answer. Each stage holds back what it
cannot place yet; `finish` releases everything when the completion ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nanovllm.router.reasoning import ReasoningSplit
from nanovllm.router.text_stream import TextStream
from nanovllm.router.tool_calls import ToolCallParser
from nanovllm.v1 import generate_pb2


@dataclass
class Delta:
    """What a response carries of the completion."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[generate_pb2.ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_calls)


class CompletionText:
    def __init__(
        self, stream: TextStream, split: ReasoningSplit | None = None, tools: ToolCallParser | None = None
    ) -> None:
        self.stream = stream
        self.split = split
        self.tools = tools

    @property
    def stopped(self) -> bool:
        """A stop string matched: the completion ends here."""
        return self.stream.stopped

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def push(self, token_ids: Sequence[int], last: bool) -> Delta:
        """The delta for new tokens; with `last` (the request finished) everything held back too. A stop
        string matched in the new text makes this the last delta whatever `last` says."""
        text = self.stream.push(token_ids)
        if last and not self.stream.stopped:
            text += self.stream.finish()
        return self._after_text(text, last or self.stream.stopped)

    def finish(self) -> Delta:
        """The completion ended early (an error): everything held back."""
        return self._after_text(self.stream.finish(), last=True)

    def _after_text(self, text: str, last: bool) -> Delta:
        reasoning = ""
        if self.split is not None:
            reasoning, text = self.split.push(text)
            if last:
                more_reasoning, more_text = self.split.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        calls: list[generate_pb2.ToolCall] = []
        if self.tools is not None:
            text, calls = self.tools.push(text)
            if last:
                text += self.tools.finish()
        return Delta(text, reasoning, calls)
