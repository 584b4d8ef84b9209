"""One Generate call, from its validated request to its last response: where it runs (the attempt), what
it has produced, and how it moves to another worker, fails or cuts off a client that stopped reading."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn

import grpc
from opentelemetry.trace import Tracer

from nanovllm.common.logging import get_logger
from nanovllm.common.server_config import RouterConfig
from nanovllm.common.v1 import worker_pb2
from nanovllm.router.calls.accounting import RequestTrace, request_content
from nanovllm.router.calls.completion import CompletionText
from nanovllm.router.calls.generate_replies import (
    add_prompt_logprobs,
    build_response,
    failed_response,
    finish_name,
    merge_responses,
)
from nanovllm.router.calls.limits import Lease
from nanovllm.router.calls.metrics import RouterMetrics
from nanovllm.router.calls.reasoning import reasoning_format
from nanovllm.router.calls.spans import call_spans
from nanovllm.router.calls.tool_calls import tool_call_format
from nanovllm.router.calls.validation import (
    ChatFormats,
    NoTokenizerError,
    ValidRequest,
    check_request,
    validate_generate,
)
from nanovllm.router.fleet.catalog import ModelChoice
from nanovllm.router.fleet.pool import ModelRefused, WorkerPool, resolve_model
from nanovllm.router.fleet.routing import Decision
from nanovllm.router.fleet.tokenizer import ModelTokenizer
from nanovllm.router.fleet.workers import RequestEvent, WorkerConnection, WorkerLost
from nanovllm.v1 import generate_pb2

log = get_logger(__name__)

# Worker errors another worker may not have: draining, its queue full, the adapter unloaded there.
_RETRYABLE = {
    worker_pb2.ERROR_CODE_UNAVAILABLE: "worker_unavailable",
    worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: "worker_full",
    worker_pb2.ERROR_CODE_NOT_FOUND: "adapter_not_found",
}
STALL_CHECK_S = 0.5  # how often a blocked write looks at the stall timeout and the backlog
_ERROR_CODES = {
    worker_pb2.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    worker_pb2.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    worker_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    worker_pb2.ERROR_CODE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
}
OffLoop = Callable[..., Awaitable]  # runs a blocking function (tokenization) off the event loop


class StreamStalled(Exception):
    """The client stopped taking responses."""


async def reject(
    context: grpc.aio.ServicerContext, metrics: RouterMetrics, api: str, code: grpc.StatusCode, message: str
) -> NoReturn:
    """End a Generate call that never reached a worker; `api` is the face it came through (grpc, http)."""
    metrics.requests.labels(status=code.name.lower(), api=api).inc()
    await context.abort(code, message)
    raise AssertionError("context.abort returns only by raising")


@dataclass
class Attempt:
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


class GenerateCall:
    """A Generate call's state: its request, trace, text stream, current attempt and every token the
    workers produced for it, in order. `run` drives it to exactly one end: the last response, or a
    status."""

    def __init__(
        self,
        request: generate_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        lease: Lease,
        pool: WorkerPool,
        metrics: RouterMetrics,
        config: RouterConfig,
        off_loop: OffLoop,
        api: str,
        tracer: Tracer | None,
    ) -> None:
        """`api`: the face the call came through, grpc or http, for its metrics, log line and span;
        `tracer`: None when tracing is off."""
        self.request = request
        self.context = context
        self.lease = lease
        self.pool = pool
        self.metrics = metrics
        self.config = config
        self.off_loop = off_loop
        self.api = api
        self.spans = call_spans(tracer, context, api)
        self.refusal = "client_cancelled"  # the outcome if the call ends before its trace starts
        self.trace: RequestTrace | None = None
        self.generated: list[int] = []
        self.prompt_scored = False  # its prompt's logprobs went to the client
        self.worker_running = True  # until the worker reports the request ended there
        # What request.model selected: None until admit sets it, typed as what every later use finds.
        self.model: ModelChoice = None  # type: ignore[assignment]

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.spans.end(*(self.trace.span_ending() if self.trace is not None else (self.refusal, {})))

    async def _refuse(self, code: grpc.StatusCode, message: str) -> NoReturn:
        self.refusal = code.name.lower()
        await reject(self.context, self.metrics, self.api, code, message)

    async def _run(self) -> None:
        self.valid, tokenizer = await self.admit()
        request = self.request
        self.request_id = request.request_id or uuid.uuid4().hex
        prompt_len = len(self.valid.prompt_token_ids)
        self.lease.charge(prompt_len)
        content = request_content(request) if self.config.log_request_content else None
        self.trace = trace = RequestTrace(
            self.metrics, self.request_id, prompt_len, self.lease, self.api, content
        )
        decision = self.pool.pick(self.model, self.valid.prompt_token_ids, images=self.valid.image_spans)
        if decision is None:
            await self._refuse(
                grpc.StatusCode.UNAVAILABLE,
                f"no worker serving {self.model.name!r} is reachable ({self.pool.addresses})",
            )
        self.attempt = self.submit(decision, frozenset(), "first")
        self.completion = CompletionText.for_request(self.valid, tokenizer, _formats(self.config, self.model))
        # Without a tokenizer, token ids are all there is.
        self.with_ids = request.return_token_ids or tokenizer is None
        try:
            await self._stream()
        except StreamStalled as exc:
            trace.outcome = "stalled"
            log.warning("client_stalled", request_id=self.request_id[:64], reason=str(exc))
            # Free the worker's KV blocks first: the status below waits behind the data the client does
            # not read, until it reads or its connection dies.
            self.attempt.worker.release(self.attempt.wire_id, abort=self.worker_running)
            trace.close()
            await self.context.abort(grpc.StatusCode.CANCELLED, f"the router cut this stream off: {exc}")
        finally:
            # Both no-ops when done above.
            self.attempt.worker.release(self.attempt.wire_id, abort=self.worker_running)
            trace.close()

    async def admit(self) -> tuple[ValidRequest, ModelTokenizer | None]:
        """The request checked and tokenized with its tokenizer, or the call ended with the status that
        blames it."""
        try:
            self.model = resolve_model(self.pool, self.request.model)
        except ModelRefused as exc:
            await self._refuse(exc.code, str(exc))
        tokenizer, info = self.model.base.tokenizer, self.model.base.info
        span = self.spans.child("nanovllm.router.validate")
        try:
            check_request(self.request, tokenizer, info, self.config.limits)
            valid = await self.off_loop(
                validate_generate,
                self.request,
                tokenizer,
                info,
                _formats(self.config, self.model),
                self.config.limits,
            )
            span.set_attribute("nanovllm.prompt_tokens", len(valid.prompt_token_ids))
            return valid, tokenizer
        except NoTokenizerError as exc:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        except ValueError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        finally:
            span.end()
        await self._refuse(code, message)

    async def _stream(self) -> None:
        """Relay the worker's updates as responses until the last one, moving to another worker when the
        current one cannot serve the request."""
        while True:
            event = await self.attempt.next_event()
            reason = _retry_reason(event)
            if reason is not None and await self.move(reason):
                continue
            if isinstance(event, WorkerLost) or event.error_code != worker_pb2.ERROR_CODE_UNSPECIFIED:
                self.worker_running = False
                await self.fail(event)
                return
            response = self._respond(event)
            # Updates already waiting (the client or this router fell behind the worker) leave as one
            # response: a lagging stream catches up instead of paying per-message costs (HTTP/2 frames,
            # TLS records, the client's parsing) for every step it missed.
            while (response is None or not response.finish_reason) and (
                waiting := self.attempt.waiting_update()
            ):
                event = waiting
                response = merge_responses(response, self._respond(event))
            if response is None:
                continue
            if response.finish_reason:
                # A stop string ends the call while the worker still runs the request.
                self.worker_running = event.finish_reason == worker_pb2.FINISH_REASON_UNSPECIFIED
                assert self.trace is not None  # set by _run before it streams
                self.trace.on_finish(finish_name(response.finish_reason))
                response.timings.CopyFrom(self.trace.timings())
            await self.send(response)
            if response.finish_reason:
                return

    def _respond(self, update: worker_pb2.RequestUpdate) -> generate_pb2.GenerateResponse | None:
        self.generated.extend(update.new_token_ids)
        trace = self.trace
        assert trace is not None  # set by _run before it streams
        trace.on_tokens(len(update.new_token_ids), update.num_cached_tokens)
        if update.HasField("timings"):
            trace.on_worker_timings(update.timings)
        response = build_response(
            update,
            self.completion,
            self.request_id,
            self.with_ids,
            trace.num_tokens,
            trace.cached_tokens,
        )
        if update.prompt_logprobs and not self.prompt_scored:  # once, even if a stream moves
            response = response or generate_pb2.GenerateResponse(request_id=self.request_id)
            add_prompt_logprobs(response, update, self.valid.prompt_token_ids)
            self.prompt_scored = True
        return response

    def submit(self, decision: Decision[WorkerConnection], tried: frozenset[str], kind: str) -> Attempt:
        """Send the request, with the tokens generated so far, to the worker `decision` chose; `kind`:
        first, retry or resume (its span's attribute)."""
        worker = decision.worker
        carrier = self.spans.routed(worker.address, decision.expected_hit_tokens, decision.candidates, kind)
        assert self.trace is not None  # set by _run before it submits
        self.trace.on_worker(worker.address, decision.expected_hit_tokens)
        log.debug(
            "request_routed",
            request_id=self.request_id[:64],
            worker=worker.address,
            expected_hit_tokens=decision.expected_hit_tokens,
            cost=decision.cost,
            queue=worker.queue_estimate,
            candidates=decision.candidates,
        )
        wire_id = uuid.uuid4().hex  # unique on the worker link whatever ids clients choose
        params = self.valid.params
        if self.prompt_scored:  # a resumed stream: its prompt's logprobs went with its first response
            params = dataclasses.replace(params, prompt_logprobs=None)
        events = worker.submit(
            wire_id,
            self.valid.prompt_token_ids,
            params,
            self.request.priority,
            self.request_id,
            self.generated,
            decision.block_hashes,
            carrier,
            self.model.lora_name,
            self.valid.shared_prefix_tokens,
            self.valid.images,
        )
        return Attempt(worker, wire_id, events, tried | {worker.address})

    async def send(self, response: generate_pb2.GenerateResponse) -> None:
        """Write one response, cutting off a client that stopped taking them (see RouterConfig and
        docs/reliability.md).

        The write runs as a task raced against a timed wait. A leaner path (awaiting the write directly,
        one stall-check timer per call) cost the router less per response, yet lost more than it
        saved: its writes finished within one turn of the event loop, so under load no update was waiting
        when they did and nothing merged (1.0 tokens per response against 3.2 with the router and client
        sharing a CPU), and the router and client then paid per-message costs for every token, halving
        throughput (docs/performance.md#measurements-behind-choices-in-the-code)."""
        write = asyncio.ensure_future(self.context.write(response))
        backlog = self.attempt.events
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

    async def fail(self, event: RequestEvent) -> None:
        """End a call whose worker failed it: a stream that has tokens ends with FINISH_REASON_ERROR on an
        engine error; otherwise the call ends with the status of the failure."""
        trace = self.trace
        assert trace is not None  # set by _run before it streams
        if isinstance(event, WorkerLost):
            trace.outcome = "unavailable"
            message = f"worker {event.address} went away while serving this request ({event.reason})"
            await self.context.abort(grpc.StatusCode.UNAVAILABLE, message)
            return  # not reached: abort raises
        if trace.num_tokens and event.error_code == worker_pb2.ERROR_CODE_INTERNAL:
            trace.on_finish("error")
            response = failed_response(trace.request_id, self.completion, event.error_message)
            response.timings.CopyFrom(trace.timings())
            await self.send(response)
            return
        code = _ERROR_CODES[event.error_code]
        trace.outcome = code.name.lower()
        await self.context.abort(code, event.error_message)

    async def move(self, reason: str) -> bool:
        """Send a request its worker could not serve to another worker; False when the failure stands.

        Before its first token, a retry: up to max_attempts workers, each tried once. After it, a resume
        (resume_streams): the new worker gets the tokens generated so far and continues after them, and
        since a seeded sampler's draws depend only on the seed and the position, the client's stream goes
        on as if nothing had happened."""
        failed, trace, config, generated = self.attempt, self.trace, self.config, self.generated
        assert trace is not None  # set by _run before it streams
        if not generated:
            if trace.attempts >= config.max_attempts:
                return False
            exclude, counter = failed.tried, self.metrics.retries
        elif config.resume_streams and trace.resumes < config.max_resumes:
            exclude, counter = frozenset({failed.worker.address}), self.metrics.resumes
        else:
            return False
        backoff = config.retry_backoff_s * 2 ** (trace.attempts - 1)
        await asyncio.sleep(random.uniform(0.5, 1.0) * backoff)  # jitter: retries do not arrive in waves
        tokens = self.valid.prompt_token_ids + generated
        if generated:
            decision = await self.pool.wait_for_worker(
                self.model, tokens, exclude, config.resume_wait_s, self.valid.image_spans
            )
        else:
            decision = self.pool.pick(self.model, tokens, exclude, self.valid.image_spans)
        if decision is None:
            return False
        failed.worker.release(failed.wire_id, abort=False)  # it ended there already
        self.spans.moved(reason, resume=bool(generated), tokens_so_far=len(generated))
        self.attempt = self.submit(decision, failed.tried, "resume" if generated else "retry")
        trace.resumes += bool(generated)
        counter.labels(reason=reason).inc()
        log.info(
            "request_resumed" if generated else "request_retried",
            request_id=self.request_id[:64],
            reason=reason,
            worker=self.attempt.worker.address,
            tokens_so_far=len(generated),
        )
        return True


def _formats(config: RouterConfig, model: ModelChoice) -> ChatFormats:
    """The model's reasoning and tool-call formats, as the router's flags choose them."""
    architectures, tokenizer = model.base.info.architectures, model.base.tokenizer
    return ChatFormats(
        reasoning_format(config.reasoning_parser, architectures),
        tool_call_format(
            config.tool_call_parser, architectures, tokenizer.chat_template if tokenizer else ""
        ),
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
