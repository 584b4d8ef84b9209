"""The router's OpenAI-compatible HTTP face: /v1/chat/completions, /v1/completions, /v1/responses (and its
stored responses), /v1/embeddings, /v1/rerank, /score, /v1/models and /health, served by Starlette on
uvicorn in the router's own event loop.

Each choice of an HTTP request is a Generate request run by the same GenerationService.generate as a gRPC
call (router/faces/http_calls.py): validation, limits and auth, routing, retries and failover are the gRPC
path's, and a call's abort becomes an OpenAI-shaped error with the matching HTTP status. A client that
disconnects cancels its calls, which aborts their requests on the workers, as a gRPC cancel does. The
Responses API's lifecycle (stored, background, followed and cancelled responses) is its service's
(router/faces/response_service.py): here only its routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanovllm.common.serving import MAX_MESSAGE_BYTES
from nanovllm.common.tracing import CARRIER_KEYS
from nanovllm.router.faces.auth import Access, AuthError
from nanovllm.router.faces.http_calls import CallAborted, CallContext, Metadata, RunningCalls
from nanovllm.router.faces.openai_protocol import (
    ApiError,
    Choice,
    OpenAIRequest,
    ProtocolError,
    chunk_body,
    completion_body,
    parse_request,
    usage_chunk,
)
from nanovllm.router.faces.pooling_api import (
    embeddings_body,
    parse_embeddings,
    parse_rerank,
    parse_score,
    rerank_body,
    score_body,
)
from nanovllm.router.faces.response_objects import ResponseEvent
from nanovllm.router.faces.response_service import ResponsesService
from nanovllm.router.faces.response_store import Store
from nanovllm.router.fleet.catalog import NoModelYet
from nanovllm.router.fleet.pool import WorkerPool
from nanovllm.v1 import generate_pb2


class Service(Protocol):
    """What the HTTP face needs of router/faces/server.py's GenerationService."""

    pool: WorkerPool
    access: Access
    draining: bool

    async def generate(self, request: generate_pb2.GenerateRequest, context: Any, api: str) -> None: ...

    async def embed(
        self, request: generate_pb2.EmbedRequest, context: Any, api: str
    ) -> generate_pb2.EmbedResponse: ...

    async def score(
        self, request: generate_pb2.ScoreRequest, context: Any, api: str
    ) -> generate_pb2.ScoreResponse: ...


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


_FORWARDED_HEADERS = ("authorization", *CARRIER_KEYS)  # auth, and a caller's W3C trace context


def _metadata(request: Request) -> Metadata:
    """The request's headers that a gRPC call would carry as metadata: its token and trace context."""
    return tuple((name, request.headers[name]) for name in _FORWARDED_HEADERS if name in request.headers)


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _aborted(exc: CallAborted) -> Response:
    status = _HTTP_STATUS.get(exc.code, 500)
    headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
    return error_response(status, str(exc), headers=headers)


class HttpApi:
    """The routes: each parses its HTTP request, runs its calls (router/faces/http_calls.py) or asks the
    Responses API's service (router/faces/response_service.py), and answers with the result, or with the
    error it raised in OpenAI's shape (`_answering`)."""

    def __init__(self, service: Service, store: Store | None = None) -> None:
        self.service = service
        self.responses = ResponsesService(store)  # store None: --response-store off
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", _answering(self.chat), methods=["POST"]),
                Route("/v1/completions", _answering(self.completions), methods=["POST"]),
                Route("/v1/responses", _answering(self.create_response), methods=["POST"]),
                Route("/v1/responses/{id}", _answering(self.stored_response), methods=["GET", "DELETE"]),
                Route("/v1/responses/{id}/input_items", _answering(self.input_items), methods=["GET"]),
                Route("/v1/responses/{id}/cancel", _answering(self.cancel_response), methods=["POST"]),
                Route("/v1/embeddings", _answering(self.embeddings), methods=["POST"]),
                Route("/v1/rerank", _answering(self.rerank), methods=["POST"]),
                Route("/score", _answering(self.score), methods=["POST"]),
                Route("/v1/models", _answering(self.models), methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        serving = bool(self.service.pool.available) and not self.service.draining
        return JSONResponse(
            {"status": "serving" if serving else "not serving"}, status_code=200 if serving else 503
        )

    async def models(self, request: Request) -> Response:
        self._owner(request)  # a token, as gRPC's GetModelInfo needs one (health stays open for probes)
        catalog = self.service.pool.catalog
        if not catalog.bases:
            raise ApiError(503, "no worker has been reachable yet")
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

    async def embeddings(self, request: Request) -> Response:
        embed, encoding = parse_embeddings(await _json_body(request))
        response = await self.service.embed(embed, self._context(request), "http")
        return JSONResponse(embeddings_body(response, self._model_name(embed.model), encoding))

    async def rerank(self, request: Request) -> Response:
        score, top_n, return_documents = parse_rerank(await _json_body(request))
        response = await self.service.score(score, self._context(request), "http")
        name = self._model_name(score.model)
        return JSONResponse(rerank_body(score, response, name, top_n, return_documents))

    async def score(self, request: Request) -> Response:
        score = parse_score(await _json_body(request))
        response = await self.service.score(score, self._context(request), "http")
        return JSONResponse(score_body(response, self._model_name(score.model)))

    @staticmethod
    def _context(request: Request) -> CallContext:
        """The stand-in gRPC context of an Embed or Score call (its abort raises CallAborted)."""
        return CallContext(_metadata(request), 0, asyncio.Queue())

    def _model_name(self, name: str) -> str:
        """The name an answer gives: the request's, or the one base model served."""
        bases = self.service.pool.catalog.bases
        return name or (next(iter(bases)) if len(bases) == 1 else "")

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        parsed = self._named(parse_request(await _json_body(request), chat))
        calls = await RunningCalls.start(self.service.generate, parsed.generate, _metadata(request))
        if parsed.stream:
            return StreamingResponse(self._sse(parsed, calls), media_type="text/event-stream")
        try:
            return await self._whole(parsed, calls)
        finally:
            await calls.cancel()

    async def create_response(self, request: Request) -> Response:
        """OpenAI's Responses API: a chat call underneath, answered whole, streamed, or (background) run on
        without the client, which gets the queued response or follows its kept events."""
        body = await _json_body(request)
        parsed = await self.responses.request(self._owner(request), body)
        parsed.chat = self._named(parsed.chat)
        calls = await RunningCalls.start(self.service.generate, parsed.chat.generate, _metadata(request))
        if parsed.background:  # the service owns the calls now
            queued = await self.responses.start_background(parsed, calls)
            if not parsed.chat.stream:
                return JSONResponse(queued)
            events = self.responses.follow(parsed.owner, parsed.id, -1)
        elif parsed.chat.stream:
            events = self.responses.events(parsed, calls)
        else:
            try:
                return JSONResponse(await self.responses.answer(parsed, calls))
            finally:
                await calls.cancel()
        return StreamingResponse(_event_stream(events), media_type="text/event-stream")

    async def stored_response(self, request: Request) -> Response:
        """GET: a stored Response object, or (`stream=true`) a background response's events after
        `starting_after`, then live; DELETE: forget it."""
        owner, response_id = self._owner(request), request.path_params["id"]
        if request.method == "DELETE":
            return JSONResponse(await self.responses.delete(owner, response_id))
        if request.query_params.get("stream") != "true":
            return JSONResponse(await self.responses.retrieve(owner, response_id))
        after = request.query_params.get("starting_after", "-1")
        events = await self.responses.replay(owner, response_id, after)
        return StreamingResponse(_event_stream(events), media_type="text/event-stream")

    async def input_items(self, request: Request) -> Response:
        query = request.query_params
        page = await self.responses.input_items(
            self._owner(request),
            request.path_params["id"],
            query.get("order", "desc"),
            query.get("limit", "20"),
            query.get("after"),
        )
        return JSONResponse(page)

    async def cancel_response(self, request: Request) -> Response:
        return JSONResponse(await self.responses.cancel(self._owner(request), request.path_params["id"]))

    async def close(self) -> None:
        """Stop the background responses still running (ResponsesService.close)."""
        await self.responses.close()

    def _owner(self, request: Request) -> str:
        """The caller's token name (every stored response is its owner's alone), or ApiError."""
        try:
            return self.service.access.identify(_metadata(request))
        except AuthError as exc:
            raise ApiError(_HTTP_STATUS[exc.code], str(exc)) from None

    def _named(self, chat: OpenAIRequest) -> OpenAIRequest:
        """`chat`, naming the one base model served when it names none: answers name the model."""
        bases = self.service.pool.catalog.bases
        if not chat.model and len(bases) == 1:
            return dataclasses.replace(chat, model=next(iter(bases)))
        return chat

    async def _whole(self, parsed: OpenAIRequest, calls: RunningCalls) -> Response:
        choices = [Choice(i) for i in range(len(parsed.generate))]
        async for index, item in calls:
            if isinstance(item, CallAborted):
                return _aborted(item)
            choices[index].add(item)
        return JSONResponse(completion_body(parsed, choices, self._decoder(parsed.model)))

    async def _sse(self, parsed: OpenAIRequest, calls: RunningCalls) -> AsyncIterator[str]:
        """Server-sent events: a chunk per Generate response, usage last when asked, then [DONE]."""
        choices = [Choice(i) for i in range(len(parsed.generate))]
        started: set[int] = set()
        streamed = [0] * len(choices)  # each choice's text length sent so far (completions' text_offset)
        decode = self._decoder(parsed.model)
        try:
            async for index, item in calls:
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
            if parsed.include_usage:
                yield f"data: {json.dumps(usage_chunk(parsed, choices))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await calls.cancel()  # a client gone: its requests are aborted on the workers

    def _decoder(self, model: str) -> Callable[[int], str]:
        """Token id -> its text, with the tokenizer of the model the request named; ids as text where it
        has none, or where the name went since the call started (its adapter unloaded everywhere)."""
        try:
            tokenizer = self.service.pool.catalog.resolve(model).base.tokenizer
        except (LookupError, ValueError, NoModelYet):
            tokenizer = None
        if tokenizer is None:
            return str
        return lambda token_id: tokenizer.backend.decode([token_id], skip_special_tokens=False)


Handler = Callable[[Request], Awaitable[Response]]


def _answering(handler: Handler) -> Handler:
    """`handler`, answering what it refuses in OpenAI's error shape: an ApiError with its status, a
    ProtocolError (a bad field) with 400, a call refused before any token with the matching status."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc.status, str(exc), exc.param)
        except ProtocolError as exc:
            return error_response(400, str(exc), exc.param)
        except CallAborted as exc:
            return _aborted(exc)

    return route


async def _json_body(request: Request) -> Any:
    """The body as JSON, or ApiError: over MAX_MESSAGE_BYTES (413), or not JSON (400)."""
    data = await _read_body(request)
    if data is None:
        raise ApiError(413, f"the request body is over {MAX_MESSAGE_BYTES} bytes", "body")
    try:
        return json.loads(data)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more than 4,300 digits
        raise ApiError(400, f"the request body is not JSON: {exc}", "body") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply", "body") from None


async def _event_stream(events: AsyncGenerator[ResponseEvent, None]) -> AsyncIterator[str]:
    """The Responses API's events as server-sent events, each named in its `event:` line too, as OpenAI
    sends them; `events` closed with the stream (a client gone: the calls behind them cancelled)."""
    async with contextlib.aclosing(events):
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


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


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes may bind too."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, reuse_port=True)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router's own handle SIGTERM (drain) for both faces."""

    task: asyncio.Task[None]
    api: HttpApi

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
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
