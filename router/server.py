"""The public gRPC service (nanovllm.v1.Generation): tokenizes, routes to a worker, streams text back."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc

from nanovllm.common.logging import get_logger
from nanovllm.common.metrics import serve_metrics
from nanovllm.common.server_config import RouterConfig
from nanovllm.common.serving import GrpcServer
from nanovllm.common.tls import server_credentials
from nanovllm.router.auth import Access, AuthInterceptor, TokenTable
from nanovllm.router.limits import Lease, TokenLimits
from nanovllm.router.metrics import RouterMetrics
from nanovllm.router.pool import WorkerPool
from nanovllm.router.responses import build_response, error_response, finish_name, merge_responses
from nanovllm.router.routing import Decision
from nanovllm.router.text_stream import TextStream
from nanovllm.router.tokenizer import ModelTokenizer, auto_tokenizer
from nanovllm.router.trace import RequestTrace, request_content
from nanovllm.router.validation import (
    NoTokenizerError,
    ValidRequest,
    check_prompt_size,
    check_request,
    prompt_token_ids,
    validate_generate,
)
from nanovllm.router.workers import RequestEvent, WorkerConnection, WorkerLost
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.v1 import worker_pb2

log = get_logger(__name__)

# Worker errors another worker may not have: draining, its queue full.
_RETRYABLE = {
    worker_pb2.ERROR_CODE_UNAVAILABLE: "worker_unavailable",
    worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: "worker_full",
}
STALL_CHECK_S = 0.5  # how often a blocked write looks at the stall timeout and the backlog
T = TypeVar("T")
_ERROR_CODES = {
    worker_pb2.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    worker_pb2.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    worker_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class StreamStalled(Exception):
    """The client stopped taking responses."""


@dataclass
class _Attempt:
    """A request's current worker and the queue its updates arrive on."""

    worker: WorkerConnection
    wire_id: str
    events: asyncio.Queue[RequestEvent]
    tried: frozenset[str]  # addresses of every worker this request went to, this one included
    held: RequestEvent | None = None  # a failure found by waiting_update, for next_event

    async def next_event(self) -> RequestEvent:
        if self.held is not None:
            event, self.held = self.held, None
            return event
        return await self.events.get()

    def waiting_update(self) -> worker_pb2.RequestUpdate | None:
        """The next event if it is already here and carries tokens. A failure is kept for next_event."""
        if self.held is not None or self.events.empty():
            return None
        event = self.events.get_nowait()
        if (
            isinstance(event, worker_pb2.RequestUpdate)
            and event.error_code == worker_pb2.ERROR_CODE_UNSPECIFIED
        ):
            return event
        self.held = event
        return None


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self, pool: WorkerPool, metrics: RouterMetrics, config: RouterConfig, access: Access
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.config = config
        self.access = access  # who calls (auth) and whether their limits allow another stream
        self.draining = False
        self._in_flight = 0
        self.idle = asyncio.Event()  # set while no Generate call is in flight
        self.idle.set()
        self._tokenizers = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    async def _model(
        self, context: grpc.aio.ServicerContext
    ) -> tuple[ModelTokenizer | None, worker_pb2.WorkerInfo]:
        """The tokenizer (None for a model without one) and worker info, or UNAVAILABLE before any worker
        has connected."""
        if self.pool.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._never_reached())
        return self.pool.tokenizer, self.pool.info

    def _never_reached(self) -> str:
        return f"no worker has been reachable yet ({self.pool.addresses})"

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
    ) -> NoReturn:
        """End a Generate call that never reached a worker."""
        self.metrics.requests.labels(status=code.name.lower()).inc()
        await context.abort(code, message)

    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, *args)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if self.draining:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "the router is shutting down; retry")
        lease = await self.access.admit(context)
        self._in_flight += 1
        self.idle.clear()
        try:
            await self._generate(request, context, lease)
        finally:
            lease.close()
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()

    async def _admit(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[ValidRequest, ModelTokenizer | None]:
        """The request checked and tokenized, or the call ended with the status that blames it."""
        if self.pool.info is None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, self._never_reached())
        tokenizer, info = self.pool.tokenizer, self.pool.info
        try:
            check_request(request, tokenizer, info, self.config.limits)
            return await self._off_loop(validate_generate, request, tokenizer, info), tokenizer
        except NoTokenizerError as exc:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        except ValueError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        await self._reject(context, code, message)

    def _submit(
        self,
        valid: ValidRequest,
        request: generate_pb2.GenerateRequest,
        trace: RequestTrace,
    ) -> _Attempt | None:
        """Send a new request where it costs least (router/routing.py); None when no worker is available."""
        decision = self.pool.pick(valid.prompt_token_ids)
        if decision is None:
            return None
        return self._submit_to(decision, valid, request, trace, frozenset(), [])

    def _submit_to(
        self,
        decision: Decision,
        valid: ValidRequest,
        request: generate_pb2.GenerateRequest,
        trace: RequestTrace,
        tried: frozenset[str],
        generated: list[int],
    ) -> _Attempt:
        worker = decision.worker
        trace.on_worker(worker.address, decision.expected_hit_tokens)
        log.debug(
            "request_routed",
            request_id=trace.request_id[:64],
            worker=worker.address,
            expected_hit_tokens=decision.expected_hit_tokens,
            cost=decision.cost,
            queue=worker.queue_estimate,
            candidates=decision.candidates,
        )
        wire_id = uuid.uuid4().hex  # unique on the worker link whatever ids clients choose
        events = worker.submit(
            wire_id,
            valid.prompt_token_ids,
            valid.params,
            request.priority,
            trace.request_id,
            generated,
            decision.block_hashes,
        )
        return _Attempt(worker, wire_id, events, tried | {worker.address})

    async def _send(
        self,
        context: grpc.aio.ServicerContext,
        response: generate_pb2.GenerateResponse,
        backlog: asyncio.Queue,
    ) -> None:
        """Write one response, cutting off a client that stopped taking them (see RouterConfig).

        The write runs as a task raced against a timed wait. A leaner path (awaiting the write directly,
        one stall-check timer per call) cost the router 10 µs less per response, yet lost more than it
        saved: its writes finished within one turn of the event loop, so under load no update was waiting
        when they did and nothing merged (1.0 tokens per response against 3.2 with the router and client
        sharing a CPU), and the router and client then paid per-message costs for every token, halving
        throughput (bench/security.py --placement pin-worker, plaintext, 2026-11-24: 9,200 against 16,300
        tok/s)."""
        write = asyncio.ensure_future(context.write(response))
        try:
            waited = 0.0
            while True:
                done, _ = await asyncio.wait({write}, timeout=STALL_CHECK_S)
                if done:
                    return write.result()
                waited += STALL_CHECK_S
                limit = self.config.max_buffered_responses
                if waited >= self.config.stall_timeout_s:
                    reason = f"the client took no response for {waited:.1f} s (stall timeout)"
                elif backlog.qsize() > limit:
                    reason = f"{backlog.qsize()} responses wait behind one the client has not taken (limit {limit})"
                else:
                    continue
                raise StreamStalled(reason)
        except BaseException:
            # Stalled, or the call was cancelled while we waited (a client gone, a keepalive timeout): the
            # write may end, or may have just ended, in an error that is this call's end, not news for the
            # event loop's log.
            write.cancel()
            write.add_done_callback(_retrieve)
            raise

    async def _generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext, lease: Lease
    ) -> None:
        valid, tokenizer = await self._admit(request, context)
        request_id = request.request_id or uuid.uuid4().hex
        lease.charge(len(valid.prompt_token_ids))
        content = request_content(request) if self.config.log_request_content else None
        trace = RequestTrace(self.metrics, request_id, len(valid.prompt_token_ids), lease, content)
        attempt = self._submit(valid, request, trace)
        if attempt is None:
            message = f"no worker is reachable ({self.pool.addresses})"
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, message)
        stream = TextStream(tokenizer.backend if tokenizer else None, valid.stop)
        with_ids = request.return_token_ids or tokenizer is None  # without a tokenizer, ids are all there is
        generated: list[int] = []  # every token the workers produced for this call, in order
        worker_running = True  # until the worker reports the request ended there

        def respond(update: worker_pb2.RequestUpdate) -> generate_pb2.GenerateResponse | None:
            generated.extend(update.new_token_ids)
            trace.on_tokens(len(update.new_token_ids), update.num_cached_tokens)
            return build_response(update, stream, request_id, with_ids, trace.num_tokens, trace.cached_tokens)

        try:
            while True:
                event = await attempt.next_event()
                reason = _retry_reason(event)
                if reason is not None:
                    moved = await self._move(attempt, valid, request, trace, reason, generated)
                    if moved is not None:
                        attempt = moved
                        continue
                if isinstance(event, WorkerLost) or event.error_code != worker_pb2.ERROR_CODE_UNSPECIFIED:
                    worker_running = False
                    await self._fail(context, event, stream, trace, attempt.events)
                    return
                response = respond(event)
                # Updates already waiting (the client or this router fell behind the worker) leave as one
                # response: a lagging stream catches up instead of paying per-message costs (HTTP/2
                # frames, TLS records, the client's parsing) for every step it missed.
                while (response is None or not response.finish_reason) and (
                    waiting := attempt.waiting_update()
                ):
                    event = waiting
                    response = merge_responses(response, respond(event))
                if response is None:
                    continue
                if response.finish_reason:
                    worker_running = (
                        event.finish_reason == worker_pb2.FINISH_REASON_UNSPECIFIED
                    )  # stop string
                    trace.on_finish(finish_name(response.finish_reason))
                await self._send(context, response, attempt.events)
                if response.finish_reason:
                    return
        except StreamStalled as exc:
            trace.outcome = "stalled"
            log.warning("client_stalled", request_id=request_id[:64], reason=str(exc))
            # Free the worker's KV blocks first: the status below waits behind the data the client does
            # not read, until it reads or its connection dies.
            attempt.worker.release(attempt.wire_id, abort=worker_running)
            trace.close()
            await context.abort(grpc.StatusCode.CANCELLED, f"the router cut this stream off: {exc}")
        finally:
            attempt.worker.release(attempt.wire_id, abort=worker_running)  # both no-ops when done above
            trace.close()

    async def _fail(
        self,
        context: grpc.aio.ServicerContext,
        event: RequestEvent,
        stream: TextStream,
        trace: RequestTrace,
        backlog: asyncio.Queue,
    ) -> None:
        """End a call whose worker failed it: a stream that has tokens ends with FINISH_REASON_ERROR on an
        engine error; otherwise the call ends with the status of the failure."""
        if isinstance(event, WorkerLost):
            trace.outcome = "unavailable"
            message = f"worker {event.address} went away while serving this request ({event.reason})"
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        if trace.num_tokens and event.error_code == worker_pb2.ERROR_CODE_INTERNAL:
            trace.on_finish("error")
            await self._send(context, error_response(trace.request_id, stream, event.error_message), backlog)
            return
        code = _ERROR_CODES[event.error_code]
        trace.outcome = code.name.lower()
        await context.abort(code, event.error_message)

    async def _move(
        self,
        failed: _Attempt,
        valid: ValidRequest,
        request: generate_pb2.GenerateRequest,
        trace: RequestTrace,
        reason: str,
        generated: list[int],
    ) -> _Attempt | None:
        """Send a request its worker could not serve to another worker; None when the failure stands.

        Before its first token, a retry: up to max_attempts workers, each tried once. After it, a resume
        (resume_streams): the new worker gets the tokens generated so far and continues after them, and
        since a seeded sampler's draws depend only on the seed and the position, the client's stream goes
        on as if nothing had happened."""
        if not generated:
            if trace.attempts >= self.config.max_attempts:
                return None
            exclude, counter = failed.tried, self.metrics.retries
        elif self.config.resume_streams and trace.resumes < self.config.max_resumes:
            exclude, counter = frozenset({failed.worker.address}), self.metrics.resumes
        else:
            return None
        backoff = self.config.retry_backoff_s * 2 ** (trace.attempts - 1)
        await asyncio.sleep(random.uniform(0.5, 1.0) * backoff)  # jitter: retries do not arrive in waves
        tokens = valid.prompt_token_ids + generated
        if generated:
            decision = await self.pool.wait_for_worker(tokens, exclude, self.config.resume_wait_s)
        else:
            decision = self.pool.pick(tokens, exclude)
        if decision is None:
            return None
        failed.worker.release(failed.wire_id, abort=False)  # it ended there already
        attempt = self._submit_to(decision, valid, request, trace, failed.tried, generated)
        trace.resumes += bool(generated)
        counter.labels(reason=reason).inc()
        log.info(
            "request_resumed" if generated else "request_retried",
            request_id=trace.request_id[:64],
            reason=reason,
            worker=attempt.worker.address,
            tokens_so_far=len(generated),
        )
        return attempt

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        tokenizer, info = await self._model(context)
        try:
            check_prompt_size(request, self.config.limits, info.max_model_len)
            ids = await self._off_loop(prompt_token_ids, request, tokenizer, info.model)
        except NoTokenizerError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelInfo:
        _, info = await self._model(context)
        return generate_pb2.ModelInfo(
            model=info.model,
            max_model_len=info.max_model_len,
            architectures=info.architectures,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            num_workers=len(self.pool.available),
            dtype=info.dtype,
        )


def _access(config: RouterConfig, metrics: RouterMetrics) -> tuple[Access, list[grpc.aio.ServerInterceptor]]:
    """Auth (with a tokens file: every call but health and reflection needs a token) and the per-token
    limits; the tokens file is read here, so a bad one fails the start naming the file."""

    def denied(reason: str) -> None:
        metrics.access_denied.labels(reason=reason).inc()

    table = TokenTable(config.auth_tokens_file) if config.auth_tokens_file else None
    limits = TokenLimits(config.max_streams_per_token, config.tokens_per_minute_per_token)
    interceptors = [AuthInterceptor(table, denied)] if table is not None else []
    return Access(table, limits, denied), interceptors


def _worker_pool(config: RouterConfig, on_change: Callable[[bool], None]) -> WorkerPool:
    """The pool, over mutual TLS when configured: its files are checked here, so a bad one fails the start
    naming the file rather than every connection attempt."""
    if config.worker_tls.enabled:
        config.worker_tls.check(need_identity=True, need_ca=True)  # workers always ask for a certificate
    return WorkerPool(
        config.workers,
        on_change,
        config.routing,
        config.discovery_interval_s,
        config.worker_tls,
        config.worker_tls_server_name,
    )


def _retrieve(write: asyncio.Future) -> None:
    """Mark an abandoned write's outcome as seen."""
    if not write.cancelled():
        write.exception()


def _retry_reason(event: RequestEvent) -> str | None:
    """Why a request may go to another worker, if this first event says its worker could not serve it."""
    if isinstance(event, WorkerLost):
        return "worker_lost"
    return _RETRYABLE.get(event.error_code)


async def serve_router(
    config: RouterConfig, stop: asyncio.Event, on_listening: Callable[[str, str], None]
) -> None:
    """Listen, connect to the workers (health is SERVING while at least one is connected), serve until
    `stop` is set, then drain: NOT_SERVING, new calls UNAVAILABLE, calls in flight finish within the
    drain timeout."""
    metrics = RouterMetrics()
    access, interceptors = _access(config, metrics)
    server = GrpcServer(
        [generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        keepalive_time_s=config.keepalive_time_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
        credentials=server_credentials(config.tls, require_client_cert=bool(config.tls_client_ca)),
        interceptors=interceptors,
    )
    service: GenerationService | None = None

    def on_change(serving: bool) -> None:
        if service is not None and not service.draining:
            asyncio.get_running_loop().create_task(server.set_serving(serving))

    pool = _worker_pool(config, on_change)
    metrics.watch_workers(lambda: pool.workers)
    service = GenerationService(pool, metrics, config, access)
    generate_pb2_grpc.add_GenerationServicer_to_server(service, server.server)
    address = await server.start(config.host, config.port)
    if config.health_port is not None:
        log.info("health_listening", address=await server.start_health(config.host, config.health_port))
    metrics_address = serve_metrics(metrics.registry, config.host, config.metrics_port)
    on_listening(address, metrics_address)
    preloading = asyncio.create_task(asyncio.to_thread(auto_tokenizer))  # overlaps the workers' start-up
    pool.start()
    log.info(
        "router_serving",
        address=address,
        metrics=metrics_address,
        workers=config.workers,
        tls=config.tls.enabled,
        worker_tls=config.worker_tls.enabled,
        auth=access.table is not None,
    )
    await stop.wait()
    service.draining = True
    await server.set_serving(False)
    log.info(
        "router_draining", address=address, in_flight=service.in_flight, timeout_s=config.drain_timeout_s
    )
    try:
        await asyncio.wait_for(service.idle.wait(), config.drain_timeout_s)
    except asyncio.TimeoutError:
        log.warning("router_drain_timeout", timeout_s=config.drain_timeout_s)
    log.info("router_stopping", address=address)
    await server.stop(config.shutdown_grace_s)
    await pool.close()
    service.close()
    await preloading
