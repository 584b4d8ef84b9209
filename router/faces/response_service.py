"""OpenAI's Responses API as a service, apart from HTTP: router/faces/http_api.py parses an HTTP request,
calls a method here, and turns what it returns, or the ApiError or ProtocolError it raises, into the HTTP
answer.

A response runs as the chat call its body asks for (router/faces/responses.py turns the body into one and
the call's Generate responses into a Response object or its events), continuing the stored conversation
its `previous_response_id` names, and is kept in the store (router/faces/response_store.py) when `store`.
A background response runs on in a task of this process without its client, keeping every event in the
store, where any router process sharing it replays and follows them, and asks it to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from nanovllm.common.logging import get_logger
from nanovllm.router.faces.http_calls import CallAborted, RunningCalls
from nanovllm.router.faces.openai_protocol import ApiError, ProtocolError, check_unicode
from nanovllm.router.faces.response_objects import (
    DeletedResponse,
    InputItemList,
    ResponseEvent,
    ResponseObject,
    StoredRecord,
    is_terminal,
)
from nanovllm.router.faces.response_store import Store, StoreFull, StoreUnavailable
from nanovllm.router.faces.responses import ResponseBuilder, ResponsesRequest, parse_responses_request

log = get_logger(__name__)

# How often a background response's follower looks for new events in the store (the process running it may
# be another): a token's delay at most, and a small query.
FOLLOW_POLL_S = 0.02


class ResponsesService:
    """Create, retrieve, delete and cancel responses, list their input items, and run and follow
    background ones. Every stored response is its owner's alone (the caller's token name): another
    owner's is not found, as an unknown one is."""

    def __init__(self, store: Store | None) -> None:
        self.store = store  # None: --response-store off
        self._background: set[asyncio.Task[None]] = set()  # background responses running in this process

    async def request(self, owner: str, body: Any) -> ResponsesRequest:
        """The request a /v1/responses body makes, continuing the stored response its
        previous_response_id names; ProtocolError or ApiError (404, 503, 507) if it cannot run."""
        previous = None
        if isinstance(body, dict):
            check_unicode(body)  # before the id is looked up and named in an error
        previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise ProtocolError("previous_response_id", "previous_response_id must be a string")
            previous = await self._record(owner, previous_id, "previous_response_id")
        parsed = parse_responses_request(body, previous, can_store=self.store is not None)
        if parsed.store:
            try:
                await self._store().check_space()
            except StoreFull as exc:
                raise ApiError(507, str(exc), "store") from None
            except StoreUnavailable as exc:
                raise ApiError(503, str(exc), "store") from None
        parsed.owner = owner
        return parsed

    async def answer(self, request: ResponsesRequest, calls: RunningCalls) -> ResponseObject:
        """The whole Response object once its call ended (stored when asked); CallAborted if it failed."""
        builder = ResponseBuilder(request, int(time.time()))
        async for _, item in calls:
            if isinstance(item, CallAborted):
                raise item
            builder.add(item)
        response = builder.response(builder.status)
        await self._keep(request, response)
        return response

    async def events(
        self, request: ResponsesRequest, calls: RunningCalls
    ) -> AsyncGenerator[ResponseEvent, None]:
        """The response's stream of events; its calls are cancelled when it ends, its client gone too."""
        builder = ResponseBuilder(request, int(time.time()))
        try:
            for started in builder.start():
                yield started
            async for _, item in calls:
                if isinstance(item, CallAborted):  # mid-stream: the response fails
                    for out in builder.fail(str(item)):
                        yield out
                    break
                for out in builder.add(item):
                    if is_terminal(out):
                        await self._keep(request, out["response"])  # stored before the client hears it ended
                    yield out
        finally:
            await calls.cancel()

    async def start_background(self, request: ResponsesRequest, calls: RunningCalls) -> ResponseObject:
        """Store the response as queued and run it on in a task of this process that keeps every event in
        the store; the queued Response object (its events: `follow`). ApiError 503 if the store fails."""
        builder = ResponseBuilder(request, int(time.time()))
        queued = builder.response("queued")
        try:
            await self._store().put(request.owner, request.id, request.record(queued))
        except StoreUnavailable as exc:
            await calls.cancel()
            raise ApiError(503, str(exc), "store") from None
        runner = asyncio.create_task(self._run_background(request, builder, calls))
        self._background.add(runner)  # held: the loop keeps only weak references to tasks
        runner.add_done_callback(self._background.discard)
        return queued

    async def _run_background(
        self, request: ResponsesRequest, builder: ResponseBuilder, calls: RunningCalls
    ) -> None:
        """A background response's call to its end (or a cancel asked for through any process), each
        update's events kept as they come, then the finished record."""
        owner, response_id, store = request.owner, request.id, self._store()
        try:
            pending = builder.start()
            async for _, item in calls:
                if isinstance(item, CallAborted):
                    pending += builder.fail(str(item))
                    break
                pending += builder.add(item)
                if pending and is_terminal(pending[-1]):
                    break
                if await store.append_events(owner, response_id, pending):  # a cancel was asked for
                    pending = builder.fail("cancelled by POST /v1/responses/{id}/cancel", "cancelled")
                    break
                pending = []
            # The finished record first: whoever sees the last event (a follower, a cancel) finds it final.
            await store.put(owner, response_id, request.record(_finished(pending)))
            await store.append_events(owner, response_id, pending)
        except Exception:  # the store failing, or a bug: the response must still end, as failed
            log.exception("background_response_failed", response_id=response_id)
            failed = builder.fail("the router failed this response")
            with contextlib.suppress(StoreUnavailable):  # nothing more to do if it is the store
                await store.put(owner, response_id, request.record(_finished(failed)))
                await store.append_events(owner, response_id, failed)
        finally:
            await calls.cancel()

    async def close(self) -> None:
        """Stop the background responses still running (past the drain): their worker requests are
        aborted; their records stay as last kept."""
        for runner in self._background:
            runner.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def retrieve(self, owner: str, response_id: str) -> ResponseObject:
        return (await self._record(owner, response_id))["response"]

    async def delete(self, owner: str, response_id: str) -> DeletedResponse:
        await self._record(owner, response_id)
        await self._store().delete(owner, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def replay(
        self, owner: str, response_id: str, starting_after: str
    ) -> AsyncGenerator[ResponseEvent, None]:
        """A background response's events after the sequence number `starting_after` (as the query
        gave it), then live (`follow`); ApiError when the response is not one or the number not one."""
        record = await self._record(owner, response_id)
        if not record["response"].get("background"):
            raise ApiError(400, "only a background response's events are kept to stream again", "stream")
        if not starting_after.lstrip("-").isdigit():
            raise ApiError(400, f"starting_after must be an event's sequence_number, got {starting_after!r}")
        return self.follow(owner, response_id, int(starting_after))

    async def input_items(
        self, owner: str, response_id: str, order: str, limit: str, after: str | None
    ) -> InputItemList:
        """The input items a stored response was asked with, its conversation's earlier turns' included:
        `order` desc (the default, as OpenAI's) or asc, `limit` 1 to 100, `after` an item id (the query's
        values as sent)."""
        record = await self._record(owner, response_id)
        if order not in ("asc", "desc") or not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ApiError(400, f"order must be asc or desc and limit 1 to 100, got {order!r}, {limit!r}")
        items = record["input_items"][:: -1 if order == "desc" else 1]
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[: int(limit)]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }

    async def cancel(self, owner: str, response_id: str) -> ResponseObject:
        """Stop a background response (its process sees the request at its next event and aborts the
        worker's request); the response once it ended, cancelled or not."""
        record = await self._record(owner, response_id)
        if not record["response"].get("background"):
            raise ApiError(400, f"{response_id} is not a background response: only those can be cancelled")
        await self._store().request_cancel(owner, response_id)
        async for _ in self.follow(owner, response_id, -1):  # until its last event is kept
            pass
        return await self.retrieve(owner, response_id)

    async def follow(self, owner: str, response_id: str, after: int) -> AsyncGenerator[ResponseEvent, None]:
        """A background response's kept events past `after`, then the new ones as they are kept, until its
        last (polled: the process running it may be another)."""
        store = self._store()
        while True:
            new = await store.events_after(owner, response_id, after)
            for event in new:
                yield event
            if new:
                after = new[-1]["sequence_number"]
                if is_terminal(new[-1]):
                    return
            else:
                await asyncio.sleep(FOLLOW_POLL_S)

    async def _keep(self, request: ResponsesRequest, response: ResponseObject) -> None:
        """Store a finished response; a store that fails now costs the record, never the answer."""
        if request.store:
            try:
                await self._store().put(request.owner, request.id, request.record(response))
            except StoreUnavailable as exc:
                log.error("response_not_stored", response_id=request.id, error=str(exc))

    async def _record(self, owner: str, response_id: str, param: str | None = None) -> StoredRecord:
        """The owner's stored record of `response_id`, or ApiError: 404 (none for them), 503 (the store
        failed), naming `param`."""
        try:
            record = None if self.store is None else await self.store.get(owner, response_id)
        except StoreUnavailable as exc:
            raise ApiError(503, str(exc), param) from None
        if record is None:
            why = (
                f"never stored, deleted, past its time to live ({self.store.ttl_s:g} s) or another token's"
                if self.store is not None
                else "this router keeps no responses (--response-store off)"
            )
            raise ApiError(404, f"no stored response {response_id!r}: {why}", param)
        return record

    def _store(self) -> Store:
        """The store, where a response is stored: parse_responses_request refuses `store` and
        `background` without one, and no record is found without one."""
        if self.store is None:
            raise RuntimeError("the Responses API reached for a store with --response-store off")
        return self.store


def _finished(events: list[ResponseEvent]) -> ResponseObject:
    """The finished Response object a run's events end with."""
    last = events[-1] if events else None
    if last is None or not is_terminal(last):
        raise RuntimeError("a response's calls ended without its last event")
    return last["response"]
