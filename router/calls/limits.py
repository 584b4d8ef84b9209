"""Per-token limits on the router's public API: Generate streams open at once, and prompt plus completion
tokens within any 60 s, per token name (router/faces/auth.py; every caller is `anonymous` without auth).

A call over either limit gets RESOURCE_EXHAUSTED, with the seconds to wait in the message and in the
`retry-after` trailing metadata. A stream already admitted is never cut off: its tokens count against the
minute it produced them in, which may delay the next call.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 60.0
RETRY_AFTER_KEY = "retry-after"  # seconds, as HTTP's Retry-After


@dataclass
class _Usage:
    """One token's open streams and its tokens per second over the last minute ([second, count] pairs)."""

    streams: int = 0
    seconds: deque[list[int]] = field(default_factory=deque)
    total: int = 0

    def expire(self, now: float) -> None:
        while self.seconds and self.seconds[0][0] <= now - WINDOW_S:
            self.total -= self.seconds.popleft()[1]

    def add(self, now: float, count: int) -> None:
        second = int(now)
        if self.seconds and self.seconds[-1][0] == second:
            self.seconds[-1][1] += count
        else:
            self.seconds.append([second, count])
        self.total += count

    def wait_for(self, now: float, limit: int) -> float:
        """Seconds until the tokens used in the window drop below `limit`."""
        left = self.total
        for second, count in self.seconds:
            left -= count
            if left < limit:
                return max(second + WINDOW_S - now, 0.0)
        return 0.0


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after_s: float, limit: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit  # stream_limit or token_rate_limit


class Lease:
    """One admitted stream: `charge` counts its tokens, `close` gives its stream slot back (once)."""

    def __init__(self, limits: TokenLimits, name: str) -> None:
        self._limits, self.name, self._open = limits, name, True

    def charge(self, count: int) -> None:
        if count:
            self._limits.usage(self.name).add(self._limits.clock(), count)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._limits.usage(self.name).streams -= 1


class TokenLimits:
    """Streams at once and tokens per minute, per token name (0: no limit). Used on the event loop only."""

    def __init__(self, max_streams: int, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.max_streams = max_streams
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self._usage: dict[str, _Usage] = {}

    def usage(self, name: str) -> _Usage:
        return self._usage.setdefault(name, _Usage())

    def admit(self, name: str) -> Lease:
        """A lease for one more stream of `name`, or LimitExceeded with the seconds to wait."""
        usage, now = self.usage(name), self.clock()
        usage.expire(now)
        if self.max_streams and usage.streams >= self.max_streams:
            raise LimitExceeded(
                f"{name} has {usage.streams} streams open (limit {self.max_streams} per token); retry "
                "after one ends (about 1 s)",
                1.0,
                "stream_limit",
            )
        if self.tokens_per_minute and usage.total >= self.tokens_per_minute:
            wait = usage.wait_for(now, self.tokens_per_minute)
            raise LimitExceeded(
                f"{name} used {usage.total} tokens in the last {WINDOW_S:.0f} s (limit "
                f"{self.tokens_per_minute} per token); retry after {wait:.1f} s",
                wait,
                "token_rate_limit",
            )
        usage.streams += 1
        return Lease(self, name)


def retry_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a RESOURCE_EXHAUSTED call: whole seconds, rounded up (at least 1)."""
    return ((RETRY_AFTER_KEY, str(max(1, math.ceil(retry_after_s)))),)
