"""A completion's text as the client receives it: token ids decoded (with stop strings), then the
reasoning split from the answer, then tool calls parsed out of the answer. Each stage holds back what it
cannot place yet; `finish` releases everything when the completion ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nanovllm.router.calls.reasoning import ReasoningSplit, prompt_opens_reasoning
from nanovllm.router.calls.text_stream import TextStream
from nanovllm.router.calls.tool_calls import ToolCallParser
from nanovllm.router.calls.validation import ChatFormats, ValidRequest
from nanovllm.router.fleet.tokenizer import ModelTokenizer
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

    @classmethod
    def for_request(
        cls, valid: ValidRequest, tokenizer: ModelTokenizer | None, formats: ChatFormats
    ) -> CompletionText:
        """Detokenization with the request's stop strings; for a model that reasons, the reasoning split
        (open from the start when the prompt ends inside a reasoning block); for a chat with tools, the
        tool-call parser."""
        stream = TextStream(tokenizer.backend if tokenizer else None, valid.stop)
        if tokenizer is None:
            return cls(stream)
        split, tools = None, None
        if formats.reasoning is not None:
            tail = tokenizer.decode_tail(valid.prompt_token_ids)
            split = ReasoningSplit(
                formats.reasoning, in_reasoning=prompt_opens_reasoning(tail, formats.reasoning)
            )
        if formats.tool_calls is not None and valid.tools is not None:
            tools = ToolCallParser(formats.tool_calls, valid.tools.schemas)
        return cls(stream, split, tools)

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
