"""Token ids in, text deltas out: incremental detokenization with stop strings.

Decoding uses the tokenizers library's DecodeStream, which holds back a token until the bytes it ends
with form complete UTF-8 characters, so a character split across tokens never shows up as U+FFFD.
Stop strings are matched on the decoded text; any tail that could still grow into a stop string is held
back, so a stop string never reaches the client, not even its first characters.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()) -> None:
        """Without a tokenizer (a model that has none) no text comes out, and there are no stop strings."""
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._token_ids: list[int] = []
        self._decoded = ""  # all text decoded so far (up to the stop string, once one matched)
        self._sent = 0  # how much of _decoded the client has
        self.stopped = False  # a stop string matched; nothing more will be sent

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text that is now safe to send (possibly empty)."""
        if self.stopped or self._tokenizer is None:
            return ""
        for token_id in token_ids:
            self._token_ids.append(token_id)
            piece = self._decoder.step(self._tokenizer, token_id)
            if piece:
                self._decoded += piece
        if self._stop:
            self._match_stop()
        end = len(self._decoded) if self.stopped else self._safe_end()
        delta, self._sent = self._decoded[self._sent : end], end
        return delta

    def finish(self) -> str:
        """The request ended for another reason: send everything held back. A character left incomplete
        by the last token comes out as the full decode renders it (U+FFFD). The released text can still
        hold a stop string; it is cut there and `stopped` becomes True."""
        if self.stopped or self._tokenizer is None:
            return ""
        full = self._tokenizer.decode(self._token_ids, skip_special_tokens=True)
        if full.startswith(self._decoded):
            self._decoded = full
        if self._stop:  # the released tail may complete a stop string: `stopped` tells the caller
            self._match_stop()
        delta, self._sent = self._decoded[self._sent :], len(self._decoded)
        return delta

    def _match_stop(self) -> None:
        # Only unsent text can hold a new match: the sent part never contained one, and no sent suffix
        # could start one (see _safe_end).
        window = self._decoded[self._sent :]
        hits = [i for i in (window.find(s) for s in self._stop) if i >= 0]
        if hits:
            self._decoded = self._decoded[: self._sent + min(hits)]
            self.stopped = True

    def _safe_end(self) -> int:
        """End of the text that can be sent: before the earliest unsent suffix that is a stop prefix."""
        text = self._decoded
        longest = max((len(s) for s in self._stop), default=1)
        for start in range(max(self._sent, len(text) - longest + 1), len(text)):
            tail = text[start:]
            if any(s.startswith(tail) for s in self._stop):
                return start
        return len(text)
