"""The router's OpenAI-compatible HTTP face: /v1/chat/completions, /v1/completions, /v1/responses (and its
stored responses), /v1/models and /health, served by Starlette on uvicorn in the router's own event loop.

Each choice of an HTTP request is a Generate request run by the same GenerationService.generate as a gRPC
call: validation, limits and auth, routing, retries and failover are the gRPC path's. CallContext stands
in for the gRPC context: the responses it is handed go to the HTTP response, and an abort becomes an
OpenAI-shaped error with the matching HTTP status. A client that disconnects cancels its calls, which
aborts their requests on the workers, as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanovllm.common.logging import get_logger
from nanovllm.common.serving import MAX_MESSAGE_BYTES
from nanovllm.common.tracing import CARRIER_KEYS
from nanovllm.router.calls.limits import RETRY_AFTER_KEY
from nanovllm.router.faces.auth import Access, AuthError
from nanovllm.router.faces.openai_protocol import (
    Choice,
    OpenAIRequest,
    ProtocolError,
    check_unicode,
    chunk_body,
    completion_body,
    parse_request,
    usage_chunk,
)
from nanovllm.router.faces.response_objects import TERMINAL_EVENTS
from nanovllm.router.faces.response_store import Store, StoreFull, StoreUnavailable
from nanovllm.router.faces.responses import ResponseBuilder, ResponsesRequest, parse_responses_request
from nanovllm.router.fleet.catalog import NoModelYet
from nanovllm.router.fleet.pool import WorkerPool
from nanovllm.v1 import generate_pb2


class Service(Protocol):
    """What the HTTP face needs of router/faces/server.py's GenerationService."""

    pool: WorkerPool
    access: Access
    draining: bool

    async def generate(self, request: generate_pb2.GenerateRequest, context: Any, api: str) -> None: ...


log = get_logger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


class CallAborted(Exception):
    """A call ended with a status instead of a last response."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.code, self.retry_after = code, retry_after


class CallContext:
    """The part of grpc.aio.ServicerContext that a Generate call uses, for choice `index` of an HTTP
    request: responses go into `queue` as (index, response); abort raises CallAborted."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], index: int, queue: asyncio.Queue) -> None:
        self._metadata = metadata
        self._index, self._queue = index, queue
        self._retry_after: str | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._retry_after = dict(metadata).get(RETRY_AFTER_KEY)

    async def write(self, response: generate_pb2.GenerateResponse) -> None:
        await self._queue.put((self._index, response))

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise CallAborted(code, message, self._retry_after)


_FORWARDED_HEADERS = ("authorization", *CARRIER_KEYS)  # auth, and a caller's W3C trace context


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The request's headers that a gRPC call would carry as metadata: its token and trace context."""
    return tuple((name, request.headers[name]) for name in _FORWARDED_HEADERS if name in request.headers)


def error_response(
    status: int, message: str, param: str | None = None, headers: dict | None = None
) -> Response:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _aborted(exc: CallAborted) -> Response:
    status = _HTTP_STATUS.get(exc.code, 500)
    headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
    return error_response(status, str(exc), headers=headers)


class HttpError(Exception):
    """A request refused before it runs with an HTTP status of its own (404, 401, 507...)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


class HttpApi:
    def __init__(self, service: Service, store: Store | None = None) -> None:
        self.service = service
        self.store = store  # stored responses (the Responses API's `store`); None: --response-store off
        self._background: set[asyncio.Task] = set()  # background responses running in this process
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/responses/{id}", self._stored(self.stored_response), methods=["GET", "DELETE"]),
                Route("/v1/responses/{id}/input_items", self._stored(self.input_items), methods=["GET"]),
                Route("/v1/responses/{id}/cancel", self._stored(self.cancel_response), methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        serving = bool(self.service.pool.available) and not self.service.draining
        return JSONResponse(
            {"status": "serving" if serving else "not serving"}, status_code=200 if serving else 503
        )

    async def models(self, request: Request) -> Response:
        try:  # a token, as gRPC's GetModelInfo needs one (health stays open for probes)
            self.service.access.identify(_metadata(request))
        except AuthError as exc:
            return error_response(_HTTP_STATUS[exc.code], str(exc))
        catalog = self.service.pool.catalog
        if not catalog.bases:
            return error_response(503, "no worker has been reachable yet")
        cards = [
            {
                "id": served.name,
                "object": "model",
                "owned_by": "nanovllm",
                "parent": served.parent or None,  # a LoRA adapter's base model
                "max_model_len": catalog.bases[served.parent or served.name].info.max_model_len,
            }
            for served in catalog.served()
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        async def parse(body: Any) -> OpenAIRequest:
            return parse_request(body, chat)

        return await self._answer(request, parse, self._sse, self._whole)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: a chat call underneath (router/faces/responses.py), continuing
        the stored conversation its previous_response_id names, kept in the store when `store`."""

        async def parse(body: Any) -> ResponsesRequest:
            owner = self._owner(request)
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
                    await self.store.check_space()
                except StoreFull as exc:
                    raise HttpError(507, str(exc), "store") from None
                except StoreUnavailable as exc:
                    raise HttpError(503, str(exc), "store") from None
            parsed.owner = owner
            return parsed

        return await self._answer(request, parse, self._response_sse, self._response_whole)

    async def close(self) -> None:
        """Stop the background responses still running (past the drain): their worker requests are
        aborted; their records stay as last kept."""
        for runner in self._background:
            runner.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _owner(self, request: Request) -> str:
        """The caller's token name (every stored response is its owner's alone), or HttpError."""
        try:
            return self.service.access.identify(_metadata(request))
        except AuthError as exc:
            raise HttpError(_HTTP_STATUS[exc.code], str(exc)) from None

    async def _record(self, owner: str, response_id: str, param: str | None = None) -> dict[str, Any]:
        try:
            record = None if self.store is None else await self.store.get(owner, response_id)
        except StoreUnavailable as exc:
            raise HttpError(503, str(exc), param) from None
        if record is None:
            why = (
                f"never stored, deleted, past its time to live ({self.store.ttl_s:g} s) or another token's"
                if self.store is not None
                else "this router keeps no responses (--response-store off)"
            )
            raise HttpError(404, f"no stored response {response_id!r}: {why}", param)
        return record

    def _stored(self, handler):
        """A route on one stored response: `handler(request, owner, response_id, record)` with the caller's
        record, or the answer why there is none for them (401, 403, 404, 503)."""

        async def route(request: Request) -> Response:
            response_id = request.path_params["id"]
            try:
                owner = self._owner(request)
                record = await self._record(owner, response_id)
            except HttpError as exc:
                return error_response(exc.status, str(exc), exc.param)
            return await handler(request, owner, response_id, record)

        return route

    async def stored_response(self, request: Request, owner: str, response_id: str, record: dict) -> Response:
        """GET: a stored Response object, or (`stream=true`) a background response's events after
        `starting_after`, then live; DELETE: forget it."""
        if request.method == "DELETE":
            await self.store.delete(owner, response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        if request.query_params.get("stream") != "true":
            return JSONResponse(record["response"])
        after = request.query_params.get("starting_after", "-1")
        if not record["response"].get("background"):
            return error_response(
                400, "only a background response's events are kept to stream again", "stream"
            )
        if not after.lstrip("-").isdigit():
            return error_response(400, f"starting_after must be an event's sequence_number, got {after!r}")
        return StreamingResponse(self._follow(owner, response_id, int(after)), media_type="text/event-stream")

    async def input_items(self, request: Request, owner: str, response_id: str, record: dict) -> Response:
        """The input items a stored response was asked with, its conversation's earlier turns' included:
        `order` desc (the default, as OpenAI's) or asc, `limit` 1 to 100 (20), `after` an item id."""
        order, limit = request.query_params.get("order", "desc"), request.query_params.get("limit", "20")
        if order not in ("asc", "desc") or not limit.isdigit() or not 1 <= int(limit) <= 100:
            return error_response(
                400, f"order must be asc or desc and limit 1 to 100, got {order!r}, {limit!r}"
            )
        items = record["input_items"][:: -1 if order == "desc" else 1]
        after = request.query_params.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[: int(limit)]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > len(page),
            }
        )

    async def cancel_response(self, request: Request, owner: str, response_id: str, record: dict) -> Response:
        """Stop a background response (its process sees the request at its next event and aborts the
        worker's request); answers with the response once it ended, cancelled or not."""
        if not record["response"].get("background"):
            return error_response(
                400, f"{response_id} is not a background response: only those can be cancelled"
            )
        await self.store.request_cancel(owner, response_id)
        async for _ in self._kept_events(owner, response_id, -1):  # until its last event is kept
            pass
        return JSONResponse((await self._record(owner, response_id))["response"])

    async def _answer(self, request: Request, parse, stream, whole) -> Response:
        """Read and parse the body (`parse`: to an OpenAIRequest, or a ResponsesRequest around one), run
        its calls, and answer with `stream` (server-sent events) or `whole`."""
        data = await _read_body(request)
        if data is None:
            return error_response(413, f"the request body is over {MAX_MESSAGE_BYTES} bytes", "body")
        try:
            body = json.loads(data)
        except ValueError as exc:  # not JSON, not UTF-8, or an integer of more than 4,300 digits
            return error_response(400, f"the request body is not JSON: {exc}", "body")
        except RecursionError:
            return error_response(400, "the request body nests too deeply", "body")
        try:
            parsed = await parse(body)
        except ProtocolError as exc:
            return error_response(400, str(exc), exc.param)
        except HttpError as exc:
            return error_response(exc.status, str(exc), exc.param)
        calls = parsed if isinstance(parsed, OpenAIRequest) else parsed.chat
        bases = self.service.pool.catalog.bases
        if not calls.model and len(bases) == 1:  # answers name the model served
            calls = dataclasses.replace(calls, model=next(iter(bases)))
            if isinstance(parsed, OpenAIRequest):
                parsed = calls
            else:
                parsed.chat = calls
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(calls.generate))
        metadata = _metadata(request)
        tasks = [
            asyncio.create_task(self._run(r, CallContext(metadata, i, queue), i, queue))
            for i, r in enumerate(calls.generate)
        ]
        events = _events(queue, len(tasks))
        try:
            first = await anext(events)
        except BaseException:
            await _cancel(tasks)
            raise
        if isinstance(first[1], CallAborted):  # refused before any token: a plain HTTP error
            await _cancel(tasks)
            return _aborted(first[1])
        if getattr(parsed, "background", False):  # runs on without the client: it owns the calls now
            return await self._start_background(parsed, first, events, tasks)
        if calls.stream:
            return StreamingResponse(stream(parsed, first, events, tasks), media_type="text/event-stream")
        try:
            return await whole(parsed, first, events)
        finally:
            await _cancel(tasks)

    async def _run(
        self, request: generate_pb2.GenerateRequest, context: CallContext, index: int, queue: asyncio.Queue
    ) -> None:
        """Run one choice's call, then say how it ended on the queue. A cancelled one (its client gone, or
        a sibling refused) says nothing: nobody reads the queue any more, and a full one would block."""
        outcome: Any = _DONE
        try:
            await self.service.generate(request, context, "http")
        except CallAborted as exc:
            outcome = exc
        except Exception as exc:  # a bug: the HTTP answer must still end
            log.exception("http_call_failed", choice=index)
            outcome = CallAborted(grpc.StatusCode.INTERNAL, f"the router failed this call: {exc}")
        await queue.put((index, outcome))

    async def _whole(self, parsed: OpenAIRequest, first, events: AsyncIterator) -> Response:
        choices = [Choice(i) for i in range(len(parsed.generate))]
        event = first
        while event is not None:
            index, item = event
            if isinstance(item, CallAborted):
                return _aborted(item)
            choices[index].add(item)
            event = await anext(events, None)
        return JSONResponse(completion_body(parsed, choices, self._decoder(parsed.model)))

    async def _sse(self, parsed: OpenAIRequest, first, events: AsyncIterator, tasks) -> AsyncIterator[str]:
        """Server-sent events: a chunk per Generate response, usage last when asked, then [DONE]."""
        choices = [Choice(i) for i in range(len(parsed.generate))]
        started: set[int] = set()
        streamed = [0] * len(choices)  # each choice's text length sent so far (completions' text_offset)
        decode = self._decoder(parsed.model)
        try:
            event = first
            while event is not None:
                index, item = event
                if isinstance(item, CallAborted):  # mid-stream: the status can no longer change
                    status = _HTTP_STATUS.get(item.code, 500)
                    error = {
                        "error": {"message": str(item), "type": "server_error", "param": None, "code": status}
                    }
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                calls_before = len(choices[index].tool_calls)
                choices[index].add(item)
                chunk = chunk_body(
                    parsed, index, item, index not in started, calls_before, decode, streamed[index]
                )
                streamed[index] += len(chunk["choices"][0].get("text", ""))
                yield f"data: {json.dumps(chunk)}\n\n"
                started.add(index)
                event = await anext(events, None)
            if parsed.include_usage:
                yield f"data: {json.dumps(usage_chunk(parsed, choices))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await _cancel(tasks)  # a client gone: its requests are aborted on the workers

    async def _response_whole(self, parsed: ResponsesRequest, first, events: AsyncIterator) -> Response:
        builder = ResponseBuilder(parsed, int(time.time()))
        event = first
        while event is not None:
            _, item = event
            if isinstance(item, CallAborted):
                return _aborted(item)
            builder.add(item)
            event = await anext(events, None)
        response = builder.response(builder.status)
        await self._keep(parsed, response)
        return JSONResponse(response)

    async def _keep(self, parsed: ResponsesRequest, response: dict[str, Any]) -> None:
        """Store a finished response; a store that fails now costs the record, never the answer."""
        if parsed.store:
            try:
                await self.store.put(parsed.owner, parsed.id, parsed.record(response))
            except StoreUnavailable as exc:
                log.error("response_not_stored", response_id=parsed.id, error=str(exc))

    async def _response_sse(
        self, parsed: ResponsesRequest, first, events: AsyncIterator, tasks
    ) -> AsyncIterator[str]:
        """The Responses stream: semantic events, each named in its SSE `event:` line too, as OpenAI sends them."""
        builder = ResponseBuilder(parsed, int(time.time()))
        try:
            for started in builder.start():
                yield _sse_event(started)
            event = first
            while event is not None:
                _, item = event
                if isinstance(item, CallAborted):  # mid-stream: the response fails
                    for out in builder.fail(str(item)):
                        yield _sse_event(out)
                    break
                for out in builder.add(item):
                    if out["type"] in TERMINAL_EVENTS:
                        await self._keep(parsed, out["response"])  # stored before the client hears it ended
                    yield _sse_event(out)
                event = await anext(events, None)
        finally:
            await _cancel(tasks)

    async def _start_background(
        self, parsed: ResponsesRequest, first, events: AsyncIterator, tasks
    ) -> Response:
        """Store the response as queued, run it in a task of this process that keeps every event in the
        store, and answer with the queued Response object, or (stream) with its events as they are kept."""
        builder = ResponseBuilder(parsed, int(time.time()))
        queued = builder.response("queued")
        try:
            await self.store.put(parsed.owner, parsed.id, parsed.record(queued))
        except StoreUnavailable as exc:
            await _cancel(tasks)
            return error_response(503, str(exc), "store")
        runner = asyncio.create_task(self._run_background(parsed, builder, first, events, tasks))
        self._background.add(runner)  # held: the loop keeps only weak references to tasks
        runner.add_done_callback(self._background.discard)
        if parsed.chat.stream:
            return StreamingResponse(
                self._follow(parsed.owner, parsed.id, -1), media_type="text/event-stream"
            )
        return JSONResponse(queued)

    async def _run_background(
        self, parsed: ResponsesRequest, builder: ResponseBuilder, first, events, tasks
    ) -> None:
        """A background response's call to its end (or a cancel asked for through any process), each
        update's events kept as they come, then the finished record."""
        owner, response_id = parsed.owner, parsed.id
        try:
            pending, event = builder.start(), first
            while event is not None:
                _, item = event
                if isinstance(item, CallAborted):
                    pending += builder.fail(str(item))
                    break
                pending += builder.add(item)
                if pending and pending[-1]["type"] in TERMINAL_EVENTS:
                    break
                if await self.store.append_events(owner, response_id, pending):  # a cancel was asked for
                    pending = builder.fail("cancelled by POST /v1/responses/{id}/cancel", "cancelled")
                    break
                pending, event = [], await anext(events, None)
            # The finished record first: whoever sees the last event (a follower, a cancel) finds it final.
            await self.store.put(owner, response_id, parsed.record(pending[-1]["response"]))
            await self.store.append_events(owner, response_id, pending)
        except Exception:  # the store failing, or a bug: the response must still end, as failed
            log.exception("background_response_failed", response_id=response_id)
            failed = builder.fail("the router failed this response")
            with contextlib.suppress(StoreUnavailable):  # nothing more to do if it is the store
                await self.store.put(owner, response_id, parsed.record(failed[-1]["response"]))
                await self.store.append_events(owner, response_id, failed)
        finally:
            await _cancel(tasks)

    async def _follow(self, owner: str, response_id: str, after: int) -> AsyncIterator[str]:
        """A background response's stream from past `after` (`_kept_events`), as server-sent events."""
        async for event in self._kept_events(owner, response_id, after):
            yield _sse_event(event)

    async def _kept_events(self, owner: str, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """A background response's kept events past `after`, then the new ones as they are kept, until its
        last (polled: the process running it may be another)."""
        while True:
            new = await self.store.events_after(owner, response_id, after)
            for event in new:
                yield event
            if new:
                after = new[-1]["sequence_number"]
                if new[-1]["type"] in TERMINAL_EVENTS:
                    return
            else:
                await asyncio.sleep(FOLLOW_POLL_S)

    def _decoder(self, model: str):
        """Token id -> its text, with the tokenizer of the model the request named; ids as text where it
        has none, or where the name went since the call started (its adapter unloaded everywhere)."""
        try:
            tokenizer = self.service.pool.catalog.resolve(model).base.tokenizer
        except (LookupError, ValueError, NoModelYet):
            tokenizer = None
        if tokenizer is None:
            return str
        return lambda token_id: tokenizer.backend.decode([token_id], skip_special_tokens=False)


_DONE = object()
# How often a background response's follower looks for new events in the store (the process running it may
# be another): a token's delay at most, and a small query.
FOLLOW_POLL_S = 0.02


def _sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def _read_body(request: Request) -> bytes | None:
    """The body, or None past MAX_MESSAGE_BYTES (gRPC's message limit), read no further than that."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_MESSAGE_BYTES:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_MESSAGE_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _events(queue: asyncio.Queue, calls: int) -> AsyncIterator[tuple[int, Any]]:
    """(index, response or CallAborted) until every call ended."""
    running = calls
    while running:
        index, item = await queue.get()
        if item is _DONE:
            running -= 1
            continue
        yield index, item
        if isinstance(item, CallAborted):
            running -= 1


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes may bind too."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, reuse_port=True)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router's own handle SIGTERM (drain) for both faces."""

    task: asyncio.Task
    api: HttpApi

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def stop(self) -> None:
        """Stop once the router drained: the connections left are idle keep-alives (or streams past the
        drain timeout), closed at once. uvicorn would close them politely, and a TLS close waits for the
        client's close_notify, which an idle client never sends (30 s, asyncio's timeout)."""
        for connection in list(self.server_state.connections):
            connection.transport.abort()
        self.should_exit = True
        await self.task
        await self.api.close()


async def start_http(
    api: HttpApi, host: str, port: int, tls: ssl.SSLContext | None, share_port: bool = False
) -> tuple[_Server, str]:
    """Serve the API on host:port (0 picks a free one), over TLS with `tls`; returns the server and its
    bound address. `share_port`: SO_REUSEPORT, for several router processes (router/faces/process_group.py)."""
    config = uvicorn.Config(api.app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    config.load()
    config.ssl = tls  # uvicorn builds its context from files once; this one reloads them (common/tls.py)
    server = _Server(config)
    server.api = api
    sockets = [_shared_socket(host, port)] if share_port else None
    task = asyncio.create_task(server.serve(sockets), name="http-api")
    while not server.started:  # uvicorn has no event for it: look every 10 ms while it binds
        if task.done():
            task.result()  # the bind failed: raise its error
            raise OSError(f"the HTTP port {host}:{port} could not be served")
        await asyncio.sleep(0.01)
    server.task = task
    bound = server.servers[0].sockets[0].getsockname()
    return server, f"{host}:{bound[1]}"
