"""The public gRPC service (nanovllm.v1.Generation): tokenizes, routes to a worker, streams text back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from nanovllm.common.logging import get_logger
from nanovllm.common.metrics import serve_metrics
from nanovllm.common.serving import GrpcServer
from nanovllm.router.metrics import RouterMetrics
from nanovllm.router.text_stream import TextStream
from nanovllm.router.tokenizer import ModelTokenizer, auto_tokenizer
from nanovllm.router.validation import NoTokenizerError, prompt_token_ids, validate_generate
from nanovllm.router.workers import WorkerLost, WorkerPool
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.v1 import worker_pb2

log = get_logger(__name__)

_FINISH_REASONS = {
    worker_pb2.FINISH_REASON_STOP: generate_pb2.FINISH_REASON_STOP,
    worker_pb2.FINISH_REASON_LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    worker_pb2.FINISH_REASON_ABORT: generate_pb2.FINISH_REASON_CANCELLED,
}
_ERROR_CODES = {
    worker_pb2.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    worker_pb2.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    worker_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


@dataclass
class RouterConfig:
    workers: list[str] = field(default_factory=list)  # worker addresses, HOST:PORT
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9090  # Prometheus /metrics over HTTP, on `host`; 0 picks a free port
    # On SIGTERM, how long streams in flight may take to finish before they are cut.
    drain_timeout_s: float = 30.0
    shutdown_grace_s: float = 1.0


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.metrics = metrics
        self.draining = False
        self._in_flight = 0
        self.idle = asyncio.Event()  # set while no Generate call is in flight
        self.idle.set()

    async def _model(
        self, context: grpc.aio.ServicerContext, count_as_request: bool = False
    ) -> tuple[ModelTokenizer | None, worker_pb2.WorkerInfo]:
        """The tokenizer (None for a model without one) and worker info, or UNAVAILABLE before any worker
        has connected."""
        if self.pool.info is None:
            message = f"no worker has been reachable yet ({self.pool.addresses})"
            if count_as_request:
                await self._reject(context, grpc.StatusCode.UNAVAILABLE, message)
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        return self.pool.tokenizer, self.pool.info

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        """End a Generate call that never reached a worker."""
        self.metrics.requests.labels(status=code.name.lower()).inc()
        await context.abort(code, message)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        if self.draining:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "the router is shutting down; retry")
        self._in_flight += 1
        self.idle.clear()
        try:
            async for response in self._generate(request, context):
                yield response
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()

    async def _generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        tokenizer, info = await self._model(context, count_as_request=True)
        try:
            valid = validate_generate(request, tokenizer, info)
        except NoTokenizerError as exc:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        worker = self.pool.pick()
        if worker is None:
            await self._reject(
                context, grpc.StatusCode.UNAVAILABLE, f"no worker is reachable ({self.pool.addresses})"
            )
        request_id = request.request_id or uuid.uuid4().hex
        wire_id = uuid.uuid4().hex  # unique on the worker link whatever ids clients choose
        stream = TextStream(tokenizer.backend if tokenizer else None, valid.stop)
        events = worker.submit(wire_id, valid.prompt_token_ids, valid.params, request.priority, request_id)
        in_flight = self.metrics.requests_in_flight.labels(worker=worker.address)
        in_flight.inc()
        start = last_token_at = time.perf_counter()
        first_token_s: float | None = None
        num_tokens = 0
        cached_tokens = 0
        worker_running = True
        outcome = "client_cancelled"  # unless the loop below ends otherwise
        try:
            while True:
                event = await events.get()
                if isinstance(event, WorkerLost):
                    worker_running = False
                    outcome = "unavailable"
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"worker {event.address} went away while serving this request ({event.reason})",
                    )
                if event.error_code != worker_pb2.ERROR_CODE_UNSPECIFIED:
                    worker_running = False
                    if num_tokens and event.error_code == worker_pb2.ERROR_CODE_INTERNAL:
                        outcome = "error"
                        yield generate_pb2.GenerateResponse(
                            request_id=request_id,
                            text=stream.finish(),
                            finish_reason=generate_pb2.FINISH_REASON_ERROR,
                            error=event.error_message,
                        )
                        return
                    code = _ERROR_CODES[event.error_code]
                    outcome = code.name.lower()
                    await context.abort(code, event.error_message)
                if event.new_token_ids:
                    now = time.perf_counter()
                    if first_token_s is None:
                        first_token_s = now - start
                        self.metrics.time_to_first_token.observe(first_token_s)
                    else:
                        gap = (now - last_token_at) / len(event.new_token_ids)
                        for _ in event.new_token_ids:
                            self.metrics.inter_token_latency.observe(gap)
                    last_token_at = now
                num_tokens += len(event.new_token_ids)
                cached_tokens = event.num_cached_tokens
                text = stream.push(event.new_token_ids)
                finish = _FINISH_REASONS.get(event.finish_reason)
                if finish is not None:
                    worker_running = False
                if finish is not None and not stream.stopped:
                    text += stream.finish()
                if stream.stopped:
                    finish = generate_pb2.FINISH_REASON_STOP  # a stop string (the worker may still run it)
                response = generate_pb2.GenerateResponse(request_id=request_id, text=text)
                if request.return_token_ids or tokenizer is None:  # without a tokenizer, ids are all there is
                    response.token_ids.extend(event.new_token_ids)
                _add_logprobs(response, event.logprobs)
                if finish is not None:
                    response.finish_reason = finish
                    response.usage.prompt_tokens = event.num_prompt_tokens
                    response.usage.completion_tokens = num_tokens
                    response.usage.cached_prompt_tokens = event.num_cached_tokens
                    outcome = generate_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
                    self.metrics.e2e_request_latency.observe(time.perf_counter() - start)
                    yield response
                    return
                if text or response.token_ids or response.logprobs:
                    yield response
        finally:
            worker.release(wire_id, abort=worker_running)
            in_flight.dec()
            self.metrics.requests.labels(status=outcome).inc()
            log.info(
                "request_finished",
                request_id=request_id,
                worker=worker.address,
                outcome=outcome,
                prompt_tokens=len(valid.prompt_token_ids),
                completion_tokens=num_tokens,
                cached_tokens=cached_tokens,
                ttft_s=None if first_token_s is None else round(first_token_s, 4),
                total_s=round(time.perf_counter() - start, 4),
            )

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        tokenizer, info = await self._model(context)
        try:
            ids = prompt_token_ids(request, tokenizer, info.model)
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
            num_workers=len(self.pool.connected),
            dtype=info.dtype,
        )


def _add_logprobs(response: generate_pb2.GenerateResponse, logprobs: list[worker_pb2.TokenLogprobs]) -> None:
    for lp in logprobs:
        entry = response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
        for token_id, value in zip(lp.top_token_ids, lp.top_logprobs):
            entry.top.add(token_id=token_id, logprob=value)


async def serve_router(
    config: RouterConfig, stop: asyncio.Event, on_listening: Callable[[str, str], None]
) -> None:
    """Listen, connect to the workers (health is SERVING while at least one is connected), serve until
    `stop` is set, then drain: NOT_SERVING, new calls UNAVAILABLE, calls in flight finish within the
    drain timeout."""
    server = GrpcServer([generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name])
    metrics = RouterMetrics()
    service: GenerationService | None = None

    def on_change(serving: bool) -> None:
        if service is not None and not service.draining:
            asyncio.get_running_loop().create_task(server.set_serving(serving))

    pool = WorkerPool(config.workers, on_change)
    service = GenerationService(pool, metrics)
    generate_pb2_grpc.add_GenerationServicer_to_server(service, server.server)
    address = await server.start(config.host, config.port)
    metrics_address = serve_metrics(metrics.registry, config.host, config.metrics_port)
    on_listening(address, metrics_address)
    preloading = asyncio.create_task(asyncio.to_thread(auto_tokenizer))  # overlaps the workers' start-up
    pool.start()
    log.info("router_serving", address=address, metrics=metrics_address, workers=config.workers)
    await stop.wait()
    service.draining = True
    await server.set_serving(False)
    log.info(
        "router_draining", address=address, in_flight=service._in_flight, timeout_s=config.drain_timeout_s
    )
    try:
        await asyncio.wait_for(service.idle.wait(), config.drain_timeout_s)
    except asyncio.TimeoutError:
        log.warning("router_drain_timeout", timeout_s=config.drain_timeout_s)
    log.info("router_stopping", address=address)
    await server.stop(config.shutdown_grace_s)
    await pool.close()
    await preloading
