"""The Generate calls of one HTTP request, one per choice, each run by the same GenerationService.generate
as a gRPC call (router/faces/http_api.py). CallContext stands in for the gRPC context: the responses it is
handed come back through a queue, and an abort becomes CallAborted, which the HTTP face answers with the
matching HTTP status. RunningCalls hands a request's responses on as they come, from every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from nanovllm.common.logging import get_logger
from nanovllm.router.calls.limits import RETRY_AFTER_KEY
from nanovllm.v1 import generate_pb2

log = get_logger(__name__)

Metadata = tuple[tuple[str, str], ...]


class CallAborted(Exception):
    """A call ended with a status instead of a last response."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.code, self.retry_after = code, retry_after


# What a call says: a response, or how it was aborted; None on the queue: it ended.
Outcome = generate_pb2.GenerateResponse | CallAborted
_Queue = asyncio.Queue[tuple[int, Outcome | None]]


class CallContext:
    """The part of grpc.aio.ServicerContext that a Generate call uses, for choice `index` of an HTTP
    request: responses go into `queue` as (index, response); abort raises CallAborted."""

    def __init__(self, metadata: Metadata, index: int, queue: _Queue) -> None:
        self._metadata = metadata
        self._index, self._queue = index, queue
        self._retry_after: str | None = None

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self._retry_after = dict(metadata).get(RETRY_AFTER_KEY)

    async def write(self, response: generate_pb2.GenerateResponse) -> None:
        await self._queue.put((self._index, response))

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise CallAborted(code, message, self._retry_after)


# GenerationService.generate: (request, context, the face's name for metrics and logs).
Generate = Callable[[generate_pb2.GenerateRequest, CallContext, str], Awaitable[None]]


class RunningCalls:
    """A request's calls once they run: iterated (once), (choice index, response or CallAborted) as they
    come until every call ended; `cancel` stops those still running, which aborts their requests on the
    workers, as a gRPC cancel does."""

    def __init__(
        self,
        first: tuple[int, Outcome],
        rest: AsyncIterator[tuple[int, Outcome]],
        tasks: list[asyncio.Task[None]],
    ) -> None:
        self._first, self._rest, self._tasks = first, rest, tasks

    @classmethod
    async def start(
        cls, generate: Generate, requests: Sequence[generate_pb2.GenerateRequest], metadata: Metadata
    ) -> RunningCalls:
        """Start a call per request and wait until one of them says something: CallAborted when that is a
        refusal (before any token, so a plain HTTP error), the other calls cancelled."""
        queue: _Queue = asyncio.Queue(maxsize=2 * len(requests))
        tasks = [
            asyncio.create_task(_run(generate, request, CallContext(metadata, i, queue), i, queue))
            for i, request in enumerate(requests)
        ]
        events = _events(queue, len(tasks))
        try:
            first = await anext(events)
        except BaseException:
            await _cancel(tasks)
            raise
        if isinstance(first[1], CallAborted):
            await _cancel(tasks)
            raise first[1]
        return cls(first, events, tasks)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Outcome]]:
        yield self._first
        async for event in self._rest:
            yield event

    async def cancel(self) -> None:
        await _cancel(self._tasks)


async def _run(
    generate: Generate,
    request: generate_pb2.GenerateRequest,
    context: CallContext,
    index: int,
    queue: _Queue,
) -> None:
    """Run one choice's call, then say how it ended on the queue. A cancelled one (its client gone, or
    a sibling refused) says nothing: nobody reads the queue any more, and a full one would block."""
    outcome: CallAborted | None = None
    try:
        await generate(request, context, "http")
    except CallAborted as exc:
        outcome = exc
    except Exception as exc:  # a bug: the HTTP answer must still end
        log.exception("http_call_failed", choice=index)
        outcome = CallAborted(grpc.StatusCode.INTERNAL, f"the router failed this call: {exc}")
    await queue.put((index, outcome))


async def _events(queue: _Queue, calls: int) -> AsyncIterator[tuple[int, Outcome]]:
    """(index, response or CallAborted) until every call ended."""
    running = calls
    while running:
        index, item = await queue.get()
        if item is None:
            running -= 1
            continue
        yield index, item
        if isinstance(item, CallAborted):
            running -= 1


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
